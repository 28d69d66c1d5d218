"""The ZeroMQ stream between real processes: exactly-once delivery, kill -9, restarts.

The workers live at module level so that the children can import them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataflow import (
    BackpressureError,
    Consumer,
    Ledger,
    Producer,
    ProducerLostError,
    SampleRef,
    StreamIdleError,
    replay,
)
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from stores import LocalFeatureStore

pytestmark = pytest.mark.slow

# Each child is a process of its own, forked from a server that imported torch, ZeroMQ
# and the libraries once (as the demo's processes are): a spawned one imports them again,
# seconds of CPU a child on a busy machine, a dozen children a test. The kills are as real.
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "zmq", "dataflow", "dataflow.streams", "stores", __name__])
WAIT = 120.0  # seconds before a stuck child fails the test instead of hanging it
log = logging.getLogger(__name__)


# -- workers -------------------------------------------------------------------------------
def transport_consumer(rank: int, producers: int, events: Any) -> None:
    config = ReceiverConfig(window=32, expected_producers=producers, idle_timeout=WAIT)
    with ZmqRefReceiver(config) as receiver:
        events.put(("bound", rank, receiver.endpoint))
        ids: list[str] = []
        while refs := receiver.receive(64):
            ids.extend(r.sample_id for r in refs)
            receiver.credit(len(refs))
        events.put(("done", rank, ids, receiver.stats()))


def transport_producer(name: str, endpoints: tuple[str, ...], count: int) -> None:
    config = SenderConfig(endpoints=endpoints, producer_id=name, send_timeout=WAIT)
    with ZmqRefSender(config) as sender:
        for i in range(count):
            sender.send(SampleRef(f"{name}-{i}", "mem://nowhere", 1, metadata={"i": i}))


def silent_producer(endpoint: str, events: Any) -> None:
    sender = ZmqRefSender(SenderConfig(endpoints=(endpoint,), producer_id="doomed"))
    sender.send(SampleRef("last-words", "mem://nowhere", 1), timeout=WAIT)
    events.put("sent")
    time.sleep(WAIT)


def ledger_consumer(url: str, rank: int, endpoint: str, events: Any, acked: Any) -> None:
    config = ReceiverConfig(endpoint=endpoint, window=32, expected_producers=2, idle_timeout=WAIT)
    receiver = ZmqRefReceiver(config)
    events.put(("bound", rank, receiver.endpoint))
    ledger = Ledger.open(url, durability="normal")
    consumer = Consumer(
        ledger,
        LocalFeatureStore(),
        run_id="run",
        consumer_id=f"rank{rank}",
        rank=rank,
        world_size=2,
        stream=receiver,
    )
    consumer.resume()
    # A consumer that starts after producers closed never sees their EOF:
    # the ledger's close events end the stream instead.
    for producer_id in consumer.state.closed:
        receiver.mark_producer_closed(producer_id)
    events.put(("resumed", rank))
    step = 0
    while True:
        try:
            refs = consumer.lease(32, timeout=1.0)
        except StreamIdleError:
            refs = []
        except ProducerLostError as exc:  # a killed producer; its restart carries on
            log.warning("%s", exc)
            continue
        if refs:
            step += 1
            consumer.ack(refs, step=step)
            with acked.get_lock():
                acked.value += len(refs)
        elif consumer.finished:
            break
    events.put(("done", rank, receiver.stats()))
    consumer.close()
    ledger.close()


def ledger_producer(
    url: str,
    name: str,
    endpoints: tuple[str, ...],
    count: int,
    progress: Any,
    pause: float = 0,
    send_timeout: float = WAIT,
) -> None:
    ledger = Ledger.open(url, durability="normal")
    config = SenderConfig(
        endpoints=endpoints, producer_id=name, send_timeout=send_timeout, close_timeout=1.0
    )
    producer = Producer(
        ledger, LocalFeatureStore(), run_id="run", producer_id=name, stream=ZmqRefSender(config)
    )
    ids = [f"{name}-{i:05d}" for i in range(count)]
    for start in range(0, count, 20):
        batch = ids[start : start + 20]
        try:
            producer.emit_many([(sid, {"x": torch.full((2,), float(start))}) for sid in batch])
        except BackpressureError as exc:  # committed all the same: the ledger delivers them
            log.warning("%s", exc)
        with progress.get_lock():
            progress.value += len(batch)
        time.sleep(pause)  # a feature computation, so that kills land mid-stream
    producer.close()
    ledger.close()


# -- helpers -------------------------------------------------------------------------------
class Children:
    """Spawned processes, killed at the end whatever happens."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.events = CONTEXT.Queue()
        self.backlog: list[tuple] = []

    def start(self, target: Any, *args: Any) -> mp.process.BaseProcess:
        proc = CONTEXT.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def expect(self, kind: str, count: int = 1) -> list[tuple]:
        """The next ``count`` events of ``kind``; others wait for their own expect."""
        got = [event for event in self.backlog if event[0] == kind][:count]
        self.backlog = [event for event in self.backlog if all(event is not g for g in got)]
        deadline = time.monotonic() + WAIT
        while len(got) < count:
            try:
                event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"waited {WAIT}s for {count} {kind!r} events, got {got}")
            (got if event[0] == kind else self.backlog).append(event)
        return got

    def kill(self, proc: mp.process.BaseProcess) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT)

    def join_all(self) -> None:
        for proc in self.procs:
            proc.join(WAIT)
            assert proc.exitcode in (0, -signal.SIGKILL), f"{proc.name} exit {proc.exitcode}"


@pytest.fixture
def children() -> Iterator[Children]:
    made = Children()
    yield made
    for proc in made.procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def wait_for(value: Any, at_least: int) -> None:
    deadline = time.monotonic() + WAIT
    while value.value < at_least:
        assert time.monotonic() < deadline, f"progress stuck at {value.value} < {at_least}"
        time.sleep(0.02)


def start_consumers(children: Children, url: str, endpoints: list[str], acked: Any) -> list[str]:
    """Rank 0 first (it starts the epoch), then rank 1; returns the bound endpoints."""
    bound = []
    for rank in (0, 1):
        children.start(ledger_consumer, url, rank, endpoints[rank], children.events, acked)
        bound.append(children.expect("bound")[0][2])
        children.expect("resumed")
    return bound


def check_final_lineage(url: str, expected: int) -> None:
    with Ledger.open(url) as ledger:
        state = replay(ledger, "run")
    assert state.verify() == []
    assert len(state.committed) == expected
    assert set(state.trained) == set(state.committed)  # each trained, and verify: once
    assert not state.pending and not state.leased and not state.dead


# -- tests -----------------------------------------------------------------------------------
def test_two_producers_two_consumers_each_ref_exactly_once(children: Children) -> None:
    for rank in (0, 1):
        children.start(transport_consumer, rank, 2, children.events)
    endpoints = tuple(e[2] for e in sorted(children.expect("bound", 2), key=lambda e: e[1]))
    for name in ("p0", "p1"):
        children.start(transport_producer, name, endpoints, 10_000)
    done = children.expect("done", 2)
    children.join_all()
    ids = [sid for event in done for sid in event[2]]
    assert len(ids) == 20_000
    assert set(ids) == {f"{p}-{i}" for p in ("p0", "p1") for i in range(10_000)}
    for _, _, rank_ids, stats in done:
        assert rank_ids, "both ranks take part"
        assert stats.max_in_flight <= 32 and stats.bad_frames == 0 and stats.dropped_refs == 0


def test_silent_producer_death_raises_producer_lost(children: Children) -> None:
    config = ReceiverConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0, idle_timeout=WAIT)
    with ZmqRefReceiver(config) as receiver:
        proc = children.start(silent_producer, receiver.endpoint, children.events)
        assert [r.sample_id for r in receiver.receive(1)] == ["last-words"]
        assert children.events.get(timeout=WAIT) == "sent"
        children.kill(proc)
        with pytest.raises(ProducerLostError, match="doomed"):
            receiver.receive(1, timeout=WAIT)


def test_producers_and_consumers_through_the_ledger(children: Children, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    acked, progress = CONTEXT.Value("q", 0), CONTEXT.Value("q", 0)
    endpoints = start_consumers(children, url, ["tcp://127.0.0.1:0"] * 2, acked)
    for name in ("p0", "p1"):  # 100 credit windows each: the stream, not the start, dominates
        children.start(ledger_producer, url, name, tuple(endpoints), 3_000, progress)
    done = children.expect("done", 2)
    children.join_all()
    check_final_lineage(url, 6_000)
    assert all(stats.max_in_flight <= 32 for *_, stats in done)
    assert sum(stats.received for *_, stats in done) > 0


def test_consumer_kill_and_restart(children: Children, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    acked, progress = CONTEXT.Value("q", 0), CONTEXT.Value("q", 0)
    endpoints = start_consumers(children, url, ["tcp://127.0.0.1:0"] * 2, acked)
    first_generation = list(children.procs)
    for name in ("p0", "p1"):
        children.start(ledger_producer, url, name, tuple(endpoints), 1000, progress, 0.05)
    wait_for(acked, 300)
    assert progress.value < 2000, "the kill must land mid-stream"
    children.kill(first_generation[1])  # mid-stream, with refs leased and in flight
    children.kill(first_generation[0])  # the job restarts as a whole (as torchrun does)
    # A fresh counter: a consumer SIGKILLed inside acked's lock leaves it held forever.
    start_consumers(children, url, endpoints, CONTEXT.Value("q", 0))  # producers reconnect
    done = children.expect("done", 2)
    children.join_all()
    check_final_lineage(url, 2000)
    assert sum(stats.received for *_, stats in done) > 0, "the stream carried on"


def test_consumers_restarted_after_the_producers_closed(children: Children, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    acked, progress = CONTEXT.Value("q", 0), CONTEXT.Value("q", 0)
    endpoints = start_consumers(children, url, ["tcp://127.0.0.1:0"] * 2, acked)
    consumers = list(children.procs)
    producers = [
        children.start(ledger_producer, url, name, tuple(endpoints), 1000, progress, 0.02, 0.1)
        for name in ("p0", "p1")
    ]
    wait_for(acked, 300)
    for proc in consumers:
        children.kill(proc)
    for proc in producers:  # sends give up (BackpressureError); the ledger has every ref
        proc.join(WAIT)
        assert proc.exitcode == 0
    # A fresh counter: a consumer SIGKILLed inside acked's lock leaves it held forever.
    start_consumers(children, url, endpoints, CONTEXT.Value("q", 0))
    children.expect("done", 2)
    children.join_all()
    check_final_lineage(url, 2000)


def test_producer_kill_and_restart(children: Children, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    acked = CONTEXT.Value("q", 0)
    # A counter per producer: one SIGKILLed inside its counter's lock holds it forever.
    survivor, progress = CONTEXT.Value("q", 0), CONTEXT.Value("q", 0)
    endpoints = tuple(start_consumers(children, url, ["tcp://127.0.0.1:0"] * 2, acked))
    children.start(ledger_producer, url, "p0", endpoints, 1000, survivor, 0.05)
    doomed = children.start(ledger_producer, url, "p1", endpoints, 1000, progress, 0.05)
    wait_for(progress, 300)
    assert progress.value < 1000, "the kill must land mid-stream"
    children.kill(doomed)  # mid-stream, maybe between a commit and its send
    restarted = CONTEXT.Value("q", 0)  # referenced until the child has unpickled it
    children.start(ledger_producer, url, "p1", endpoints, 1000, restarted)
    children.expect("done", 2)
    children.join_all()
    check_final_lineage(url, 2000)


def test_benchmark_contenders_run() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
    from benchmarks import bench_streams

    seconds, _ = bench_streams.run("stream", 300)
    assert seconds > 0
    _, ages = bench_streams.run("stream", 200, rate=2000.0)
    assert len(ages) == 200 and min(ages) > 0
    _, ages = bench_streams.run("raw+json", 200, rate=2000.0)
    assert len(ages) == 200
