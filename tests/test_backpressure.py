"""Producer backpressure: watermarks on the run's un-trained features, with hysteresis.

Real SQLite files (and PostgreSQL where the fixture says so), a real shared-directory
store and a real consumer process; the gate's state machine against a reference model.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _gloo import forkserver_context
from _paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dataflow import (
    BackpressureError,
    Consumer,
    Kind,
    Ledger,
    Producer,
    RunMetrics,
    RunState,
    StreamError,
    Watermarks,
    replay,
)
from dataflow.live import _backpressure
from dataflow.live._backpressure import Backlog, Gate, itemsize
from dataflow.streams import (
    MemoryStream,
    ReceiverConfig,
    SenderConfig,
    ZmqRefReceiver,
    ZmqRefSender,
)
from stores import LocalFeatureStore, SharedDirFeatureStore

RUN = "run"


def features(n: int, floats: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.full((floats,), float(n))}


def backlog_of(state: RunState) -> int:
    """Un-trained refs in the store, by the fold's own sets (pending or leased)."""
    return len(state.pending) + len(state.leased)


# -- the watermarks ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({}, ValueError, "needs a pair of marks"),
        ({"high_refs": 8}, ValueError, "high_refs and low_refs together"),
        ({"low_bytes": 10}, ValueError, "high_bytes and low_bytes together"),
        ({"high_refs": 8, "low_refs": 8}, ValueError, "low_refs (8) must be below high_refs (8)"),
        ({"high_refs": 4, "low_refs": 8}, ValueError, "low_refs (8) must be below high_refs (4)"),
        ({"high_refs": 8, "low_refs": 0}, ValueError, "low_refs must be >= 1, got 0"),
        ({"high_bytes": -5, "low_bytes": 1}, ValueError, "high_bytes must be >= 1, got -5"),
        ({"high_refs": 8.0, "low_refs": 4}, TypeError, "high_refs must be an int or None"),
        ({"high_refs": True, "low_refs": 4}, TypeError, "got bool True"),
        ({"high_bytes": "1GiB", "low_bytes": 1}, TypeError, "got str '1GiB'"),
    ],
)
def test_bad_watermarks_are_refused_naming_the_value(kwargs, error, says) -> None:
    with pytest.raises(error) as info:
        Watermarks(**kwargs)
    assert says in str(info.value)


def test_watermarks_and_emit_arguments_are_checked(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    with pytest.raises(TypeError, match=r"backpressure must be a dataflow\.Watermarks"):
        Producer(led, store, run_id=RUN, backpressure={"high_refs": 8, "low_refs": 4})
    prod = Producer(led, store, run_id=RUN, backpressure=Watermarks(high_refs=8, low_refs=4))
    claimed = led.head_seq(RUN)
    with pytest.raises(TypeError, match="block must be a bool"):
        prod.emit("a", features(0), block=0)
    for bad in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="timeout must be a non-negative number"):
            prod.emit("a", features(0), timeout=bad)
    assert led.head_seq(RUN) == claimed and store.stats().objects == 0


def test_backpressure_error_still_is_a_stream_error_and_a_timeout() -> None:
    assert issubclass(BackpressureError, StreamError)
    assert issubclass(BackpressureError, TimeoutError)


def test_itemsize_by_name_agrees_with_torch_for_every_dtype() -> None:
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert len(dtypes) > 30
    for dtype in dtypes:
        assert itemsize(str(dtype).removeprefix("torch.")) == dtype.itemsize, dtype


# -- producers and consumers ---------------------------------------------------------


def test_at_the_high_mark_emits_are_refused_until_the_backlog_is_below_the_low_mark(
    ledger, store
) -> None:
    prod = Producer(ledger, store, run_id=RUN, backpressure=Watermarks(high_refs=8, low_refs=4))
    cons = Consumer(ledger, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    emitted = 0
    trace: list[tuple[str, int, bool]] = []  # (what came before, backlog then, emit admitted)

    def try_emit(before: str) -> None:
        nonlocal emitted
        level = backlog_of(replay(ledger, RUN))
        head, stored = ledger.head_seq(RUN), store.stats()
        try:
            prod.emit(f"s{emitted:03d}", features(emitted), block=False)
        except BackpressureError as exc:
            assert "nothing was stored or committed" in str(exc) and "high_refs=8" in str(exc)
            assert ledger.head_seq(RUN) == head and store.stats() == stored  # left unchanged
            trace.append((before, level, False))
            return
        emitted += 1
        trace.append((before, level, True))

    for _ in range(9):
        try_emit("emit")
    for step in range(1, 6):
        cons.ack(cons.lease(1), step=step)
        try_emit("ack")
    for _ in range(5):
        try_emit("emit")

    assert trace == [
        *[("emit", n, True) for n in range(8)],
        ("emit", 8, False),  # the 9th un-trained sample: at the high mark
        ("ack", 7, False),  # hysteresis: closed until below the low mark
        ("ack", 6, False),
        ("ack", 5, False),
        ("ack", 4, False),  # at the low mark is not below it
        ("ack", 3, True),
        *[("emit", n, True) for n in range(4, 8)],
        ("emit", 8, False),
    ]
    assert replay(ledger, RUN).verify() == []


def test_re_emitting_committed_ids_at_the_high_mark_does_not_wait(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, backpressure=Watermarks(high_refs=2, low_refs=1))
    prod.emit_many([("a", features(0)), ("b", features(1))])
    assert prod.emit_many([("a", features(0)), ("b", features(1))], block=False) == [None, None]
    with pytest.raises(BackpressureError):
        prod.emit_many([("a", features(0)), ("c", features(2))], block=False)
    assert sorted(replay(led, RUN).committed) == ["a", "b"] and store.stats().objects == 2


def test_a_batch_counts_whole_and_goes_alone_into_an_empty_backlog(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, backpressure=Watermarks(high_refs=6, low_refs=2))
    prod.emit_many([(f"a{i}", features(i)) for i in range(4)], block=False)
    with pytest.raises(BackpressureError):  # 4 + 3 would pass 6
        prod.emit_many([(f"b{i}", features(i)) for i in range(3)], block=False)
    assert len(replay(led, RUN).committed) == 4
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    cons.ack(cons.lease(4), step=1)
    # A batch larger than the high mark cannot wait forever: into an empty backlog it goes.
    prod.emit_many([(f"c{i}", features(i)) for i in range(10)], block=False)
    assert len(replay(led, RUN).committed) == 14


def test_byte_watermarks_count_the_tensor_bytes_of_the_refs(sqlite_url, tmp_path) -> None:
    led, store = Ledger.open(sqlite_url), SharedDirFeatureStore(tmp_path / "features")
    marks = Watermarks(high_bytes=1000, low_bytes=400)  # 160-byte samples (40 float32)
    prod = Producer(led, store, run_id=RUN, backpressure=marks)
    for i in range(6):
        prod.emit(f"s{i}", features(i, floats=40), block=False)  # 960 bytes
    with pytest.raises(BackpressureError, match="6 un-trained refs \\(960 bytes\\)"):
        prod.emit("s6", features(6, floats=40), block=False)  # 1120 > 1000
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    admitted = []
    for step in range(1, 5):
        cons.ack(cons.lease(1), step=step)
        try:
            prod.emit(f"s{5 + step}", features(step, floats=40), block=False)
            admitted.append(step)
        except BackpressureError:
            pass
    assert admitted == [4]  # 800, 640, 480 bytes are not below 400; 320 is


def test_a_timeout_ends_the_wait_with_nothing_stored(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, backpressure=Watermarks(high_refs=2, low_refs=1))
    prod.emit_many([("a", features(0)), ("b", features(1))])
    with pytest.raises(BackpressureError, match="the timeout"):
        prod.emit("c", features(2), timeout=0.2)
    assert list(replay(led, RUN).committed) == ["a", "b"] and store.stats().objects == 2


class _SetOnWait(logging.Handler):
    """Sets ``event`` when a producer logs that it waits at the high mark."""

    def __init__(self, event) -> None:
        super().__init__(logging.DEBUG)
        self.event = event
        self.waits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "blocked_on", None) == "high_mark" and " waits " in record.getMessage():
            self.waits += 1
            self.event.set()


def consume_one_at_a_time(url: str, store_dir: str, producer_waits) -> None:
    """A trainer process: once the producer waits, lease and ack one sample at a time."""
    with Ledger.open(url) as led:
        cons = Consumer(led, SharedDirFeatureStore(store_dir), run_id=RUN, consumer_id="trainer")
        cons.resume()
        assert producer_waits.wait(120), "the producer never waited at the high mark"
        for step, refs in enumerate(cons.batches(1), start=1):  # until all is trained
            cons.ack(refs, step=step)
            time.sleep(0.05)  # pace the acks: a producer that resumed too early would show


def test_a_blocked_producer_resumes_below_the_low_mark_as_a_consumer_process_trains(
    sqlite_url, tmp_path
) -> None:
    store_dir = str(tmp_path / "features")
    led, store = Ledger.open(sqlite_url), SharedDirFeatureStore(store_dir)
    prod = Producer(led, store, run_id=RUN, backpressure=Watermarks(high_refs=8, low_refs=4))
    context = forkserver_context(__name__)
    producer_waits = context.Event()
    handler = _SetOnWait(producer_waits)
    logger = logging.getLogger("dataflow")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    trainer = context.Process(
        target=consume_one_at_a_time, args=(sqlite_url, store_dir, producer_waits)
    )
    trainer.start()
    try:
        for i in range(14):
            prod.emit(f"s{i:02d}", features(i), timeout=120)  # blocks at the 9th
        prod.close()
        trainer.join(120)
        assert trainer.exitcode == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if trainer.is_alive():
            trainer.kill()
    assert handler.waits >= 1

    # The log tells the story: the backlog before each commit, in commit order.
    state, before_commits = RunState(RUN), []
    for row in led.rows(RUN):
        if row[1] == Kind.COMMIT:
            before_commits.append(backlog_of(state))
        state.apply(row)
    assert before_commits[:8] == list(range(8))  # no consumer acked before the producer waited
    assert max(before_commits) <= 7  # never past the high mark
    assert before_commits[8] < 4  # the 9th commit only once the backlog was below the low mark
    assert state.verify() == [] and len(state.trained) == 14


def test_the_backlog_follows_the_fold_through_nacks_losses_releases_and_a_rewind(
    sqlite_url,
) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN)
    live = Backlog(led, RUN)

    def check() -> None:
        live.refresh()
        fresh = Backlog(led, RUN)
        fresh.refresh()
        state = replay(led, RUN)
        expected = [
            s
            for s in state.committed
            if s not in state.trained and s not in state.dead and s not in state.regenerate
        ]
        assert live.refs == fresh.refs == len(expected) == backlog_of(state)
        assert live.bytes == fresh.bytes == sum(state.ref(s).nbytes for s in expected)

    for i in range(10):
        prod.emit(f"s{i}", {"x": torch.zeros(i + 1, dtype=torch.float64)})
    check()
    cons = Consumer(led, store, run_id=RUN, consumer_id="t1", max_attempts=2)
    cons.resume()
    check()
    cons.ack(cons.lease(2), step=1)
    cons.checkpoint(step=1, path=ckpt(1))  # releases s0, s1
    check()
    refs = cons.lease(4)
    cons.nack(refs[:1], retryable=False)  # dead
    cons.nack(refs[1:2])  # pending again
    cons.lost(refs[2:3], reason="file deleted")  # regenerate
    cons.ack(refs[3:], step=2)
    check()
    cons.ack(cons.lease(2), step=3)
    check()
    rewind = Consumer(led, store, run_id=RUN, consumer_id="t2")
    rewind.resume(1)  # the acks of steps 2 and 3 are void: back in the backlog
    check()
    prod.regenerate(refs[2].sample_id, {"x": torch.zeros(100, dtype=torch.float64)})
    check()
    assert live.refs == 7  # 10, less 2 trained into step 1, less 1 dead


# -- the gate's state machine ----------------------------------------------------------


def reference_admits(marks: Watermarks, trace: list[tuple[int, int, int, int]]) -> list[bool]:
    """The gate as the docs say it: an emit goes into an empty backlog, or while the gate is
    open and it stays within every high mark; a refused emit closes the gate, and only a
    backlog below every low mark opens it again."""
    highs = [(0, marks.high_refs), (1, marks.high_bytes)]
    lows = [(0, marks.low_refs), (1, marks.low_bytes)]
    admitted, closed = [], False
    for step in trace:
        level, added = step[:2], step[2:]
        if closed and all(mark is None or level[i] < mark for i, mark in lows):
            closed = False
        fits = all(mark is None or level[i] + added[i] <= mark for i, mark in highs)
        ok = level[0] == 0 or (not closed and fits)
        admitted.append(ok)
        closed = not ok
    return admitted


@st.composite
def marks_and_traces(draw):
    pairs = draw(st.sampled_from(["refs", "bytes", "both"]))
    kwargs = {}
    if pairs in ("refs", "both"):
        high = draw(st.integers(2, 20))
        kwargs.update(high_refs=high, low_refs=draw(st.integers(1, high - 1)))
    if pairs in ("bytes", "both"):
        high = draw(st.integers(2, 4000))
        kwargs.update(high_bytes=high, low_bytes=draw(st.integers(1, high - 1)))
    marks = Watermarks(**kwargs)
    step = st.tuples(
        st.integers(0, 25), st.integers(0, 5000), st.integers(1, 4), st.integers(0, 800)
    )
    # A backlog with no refs holds no bytes.
    trace = [(r, b if r else 0, n, nb) for r, b, n, nb in draw(st.lists(step, max_size=60))]
    return marks, trace


@settings(max_examples=400, deadline=None)
@given(marks_and_traces())
def test_the_gate_admits_as_the_reference_model_does(case) -> None:
    marks, trace = case
    gate = Gate(marks)
    admitted = [gate.admit(*step) for step in trace]
    assert admitted == reference_admits(marks, trace)
    refused_at = None
    for i, (ok, (refs, nbytes, add_refs, add_bytes)) in enumerate(
        zip(admitted, trace, strict=True)
    ):
        if ok:
            # Admitted: within every high mark, or into an empty backlog.
            assert refs == 0 or not marks.over_high(refs + add_refs, nbytes + add_bytes)
            if refused_at is not None:  # ... and after a refusal, only once below the lows
                assert any(marks.below_low(*trace[j][:2]) for j in range(refused_at + 1, i + 1))
            refused_at = None
        else:
            assert refs > 0
            refused_at = i if refused_at is None else refused_at
        if marks.high_refs is not None and marks.high_bytes is None and add_refs == 1:
            if refs >= marks.high_refs:
                assert not ok or refs == 0  # at the high mark: the gate is shut
            if refs < marks.low_refs:
                assert ok  # below the low mark: always open


def _memory_stream() -> tuple[Any, Any, Callable[[], None]]:
    stream = MemoryStream(window=2, send_timeout=0.2, expected_producers=1)
    return stream.receiver(0), stream.sender("p"), lambda: None


def _zmq_stream() -> tuple[Any, Any, Callable[[], None]]:
    fast = {"heartbeat_interval": 0.05, "heartbeat_timeout": 5.0}
    receiver = ZmqRefReceiver(ReceiverConfig(window=2, expected_producers=1, **fast))
    sender = ZmqRefSender(
        SenderConfig(endpoints=(receiver.endpoint,), send_timeout=0.2, close_timeout=5, **fast)
    )
    return receiver, sender, lambda: (sender.close(), receiver.close())


@pytest.mark.parametrize("make_stream", [_memory_stream, _zmq_stream], ids=["memory", "zmq"])
def test_refs_the_stream_did_not_take_are_sent_while_the_producer_waits(
    sqlite_url, make_stream
) -> None:
    # The trainer is late (an eval, a checkpoint): the stream's window stays full past the
    # sender's timeout, so committed refs are not sent. The backlog counts them, and a
    # streaming consumer leases them only once the stream ends, which the blocked producer
    # never reaches: they used to stay unsent and both sides waited for good.
    receiver, sender, close = make_stream()
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    cons = Consumer(led, store, run_id=RUN, consumer_id="rank0", stream=receiver)
    cons.resume()
    prod = Producer(
        led,
        store,
        run_id=RUN,
        producer_id="p",
        stream=sender,
        backpressure=Watermarks(high_refs=4, low_refs=2),
    )
    outcome: list[object] = []

    def produce() -> None:
        try:
            for i in range(10):
                prod.emit(f"s{i}", features(i), timeout=15)
            prod.close()
            outcome.append("closed")
        except Exception as exc:
            outcome.append(exc)

    unsent = threading.Event()
    handler = _SetOnUnsent(unsent, times=2)
    logger = logging.getLogger("dataflow")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # the stream's refusals are logged at DEBUG
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        # The trainer starts once the window stayed full for two commits (as many as the
        # low mark): the backlog cannot fall below it before those two are received.
        assert unsent.wait(30), "no ref went unsent: the test shows nothing"
        trained, step = 0, 0
        while trained < 10:
            refs = cons.lease(2, timeout=15)
            if not refs:
                break
            step += 1
            cons.ack(refs, step=step)
            trained += len(refs)
        thread.join(30)
        assert outcome == ["closed"], outcome
        assert trained == 10
        state = replay(led, RUN)
        assert state.verify() == [] and len(state.trained) == 10
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        close()


class _SetOnUnsent(logging.Handler):
    """Sets ``event`` once a producer logged ``times`` times that its stream did not take
    a committed ref."""

    def __init__(self, event: threading.Event, *, times: int) -> None:
        super().__init__(logging.DEBUG)
        self.event, self.left = event, times

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("stream backpressure:"):
            self.left -= 1
            if self.left <= 0:
                self.event.set()


def _fresh_producer_id() -> str:
    # The metrics sum the producers of one id in the process: other tests' stay apart.
    return f"p-{uuid.uuid4().hex[:8]}"


def _blocked_records(caplog, cause: str, producer_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "blocked_on", None) == cause
        and r.producer_id == producer_id
        and r.levelno >= logging.INFO
    ]


def _quiet_stream(
    kind: str, producer_id: str, window: int, send_timeout: float
) -> tuple[Any, Any, Callable]:
    """A stream whose consumer receives only when the test says so."""
    if kind == "memory":
        stream = MemoryStream(window=window, send_timeout=send_timeout, expected_producers=1)
        return stream.receiver(0), stream.sender(producer_id), lambda: None
    fast = {"heartbeat_interval": 0.05, "heartbeat_timeout": 10.0}
    receiver = ZmqRefReceiver(ReceiverConfig(window=window, expected_producers=1, **fast))
    sender = ZmqRefSender(
        SenderConfig(
            endpoints=(receiver.endpoint,),
            producer_id=producer_id,
            send_timeout=send_timeout,
            close_timeout=5,
            **fast,
        )
    )
    return receiver, sender, lambda: (sender.close(), receiver.close())


@pytest.mark.parametrize("kind", ["memory", "zmq"])
def test_a_producer_blocked_on_credit_warns_once_per_episode_and_exports_it(
    sqlite_url, kind, caplog, monkeypatch
) -> None:
    # A trainer outage: the stream's window stays full. Producers stalled for 40 s with
    # one unprefixed stderr line per emit as the only sign.
    monkeypatch.setattr(_backpressure, "BLOCKED_WARNING_S", 0.3)
    pid = _fresh_producer_id()
    receiver, sender, close = _quiet_stream(kind, pid, window=4, send_timeout=1.0)
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, producer_id=pid, stream=sender)
    registry = CollectorRegistry()
    RunMetrics(led, RUN, registry=registry)

    def metric(name: str) -> float | None:
        labels = {"run": RUN, "producer": pid, "cause": "credit"}
        return registry.get_sample_value(f"dataflow_producer_{name}", labels)

    caplog.set_level(logging.INFO, logger="dataflow")
    try:
        for i in range(4):  # the window takes these (a first wait for the link is no episode)
            prod.emit(f"s{i}", features(i))
        caplog.clear()
        assert metric("blocked") == 0
        before = metric("blocked_seconds_total")
        prod.emit("s4", features(4))  # waits the sender's timeout: committed, not sent
        returned = time.time()
        assert metric("blocked") == 1
        assert metric("blocked_seconds_total") - before >= 1.0 - 0.05
        prod.emit("s5", features(5))  # the same episode: no second warning
        (started,) = _blocked_records(caplog, "credit", pid)
        assert started.levelno == logging.WARNING
        assert (started.run_id, started.producer_id) == (RUN, pid)
        assert f"producer {pid!r} of run {RUN!r} is blocked" in started.getMessage()
        assert "grant no credit" in started.getMessage()
        assert started.created < returned  # said while the producer waited, not after
        received: list[Any] = []
        while len(received) < 4:  # the trainer is back: it reads and frees the window
            received += receiver.receive(4 - len(received), timeout=10)
        receiver.credit(4)
        prod.emit("s6", features(6))  # s4, s5 and s6 go out: the episode ends
        assert metric("blocked") == 0
        assert metric("blocked_seconds_total") - before >= 2 * (1.0 - 0.05)
        started, ended = _blocked_records(caplog, "credit", pid)
        assert ended.levelno == logging.WARNING and "goes on" in ended.getMessage()
        assert (ended.run_id, ended.producer_id) == (RUN, pid)
        assert ended.blocked_seconds >= 2 * (1.0 - 0.05)
        assert f"after {ended.blocked_seconds:.1f} s blocked" in ended.getMessage()
        prod.close()
    finally:
        close()
    assert len(_blocked_records(caplog, "credit", pid)) == 2


def test_a_producer_blocked_at_the_high_mark_warns_once_and_exports_it(
    sqlite_url, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(_backpressure, "BLOCKED_WARNING_S", 0.3)
    pid = _fresh_producer_id()
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(
        led,
        store,
        run_id=RUN,
        producer_id=pid,
        backpressure=Watermarks(high_refs=2, low_refs=1),
        metrics_port=0,
    )

    def metric(name: str) -> float:
        with urllib.request.urlopen(prod.metrics.url, timeout=30) as response:
            text = response.read().decode()
        labels = {"run": RUN, "producer": pid, "cause": "high_mark"}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"dataflow_producer_{name}" and sample.labels == labels:
                    return sample.value
        raise AssertionError(f"no dataflow_producer_{name} for {labels}")

    caplog.set_level(logging.INFO, logger="dataflow")
    try:
        prod.emit_many([("a", features(0)), ("b", features(1))])
        assert metric("blocked") == 0 and metric("blocked_seconds_total") == 0
        emitted: list[object] = []
        emit = threading.Thread(target=lambda: emitted.append(prod.emit("c", features(2))))
        emit.start()
        deadline = time.monotonic() + 30
        while not _blocked_records(caplog, "high_mark", pid):
            assert time.monotonic() < deadline, "no warning from the blocked producer"
            time.sleep(0.02)
        assert metric("blocked") == 1 and metric("blocked_seconds_total") > 0.3 - 0.05
        assert emit.is_alive()
        cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
        cons.resume()
        cons.ack(cons.lease(2), step=1)  # the backlog falls below the low mark
        emit.join(30)
        assert len(emitted) == 1 and emitted[0] is not None
        assert metric("blocked") == 0
        waited = metric("blocked_seconds_total")
        started, ended = _blocked_records(caplog, "high_mark", pid)
        for record in (started, ended):
            assert record.levelno == logging.WARNING
            assert (record.run_id, record.producer_id) == (RUN, pid)
        assert "at the producer's high mark (high_refs=2, low_refs=1)" in started.getMessage()
        assert "goes on, the backlog below the low marks" in ended.getMessage()
        assert ended.blocked_seconds >= waited - 0.1 > 0.3 - 0.15
    finally:
        prod.close()
    assert len(_blocked_records(caplog, "high_mark", pid)) == 2
