"""Producer epochs: one live process holds a producer id; its predecessor is fenced.

A restarted producer (same id, as the docs recommend) claims the id; the process it
replaced, presumed dead but alive, can then neither commit nor close: a close from it
used to end the run early for ``Consumer(producers=[...])``, leaving most of the
replacement's samples untrained while ``verify`` said clean.
"""

from __future__ import annotations

import json
import selectors
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import (
    CommitOutcomeUnknownError,
    Consumer,
    InvalidArgumentError,
    Kind,
    Ledger,
    LedgerStateError,
    Producer,
    ProducerFencedError,
    SchemaVersionError,
    replay,
)
from dataflow.streams import (
    MemoryStream,
    ReceiverConfig,
    SenderConfig,
    ZmqRefReceiver,
    ZmqRefSender,
)
from stores import LocalFeatureStore, SharedDirFeatureStore
from tests import _zygote

RUN = "run"
WAIT_S = 120.0  # only ever waited out when something is broken

#: One producer process: claims "rollout-0", then does what each line of stdin says
#: ("emit ID...", "close") and answers each with one JSON line.
_PRODUCER = textwrap.dedent(
    """
    import json, sys
    import torch
    from dataflow import DataflowError, Ledger, Producer
    from stores import open_store

    ledger = Ledger.open(sys.argv[1])
    store = open_store(sys.argv[2])
    producer = Producer(ledger, store, run_id=sys.argv[3], producer_id="rollout-0")
    print(json.dumps({"ok": getattr(producer, "epoch", None)}), flush=True)
    for line in sys.stdin:
        command, *ids = line.split()
        try:
            if command == "emit":
                refs = producer.emit_many((i, {"x": torch.ones(2)}) for i in ids)
                answer = {"ok": [ref is not None for ref in refs]}
            else:
                producer.close()
                answer = {"ok": "closed"}
        except DataflowError as exc:
            answer = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(answer), flush=True)
    """
)


class ProducerProcess:
    """A real producer process of id "rollout-0", driven line by line."""

    def __init__(self, ledger_url: str, store_uri: str) -> None:
        # forked from the test zygote: a process of its own, without torch imported anew
        self.proc = _zygote.Popen(
            [sys.executable, "-c", _PRODUCER, ledger_url, store_uri, RUN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.claimed = self._answer()

    def ask(self, line: str) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(WAIT_S):
                raise AssertionError(f"the producer process said nothing for {WAIT_S:g} s")
        line = self.proc.stdout.readline()
        assert line, f"the producer process ended (exit code {self.proc.wait(WAIT_S)})"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _train(consumer: Consumer, step: list[int]) -> list[str]:
    """Lease and ack whatever the consumer can lease now; the ids trained."""
    trained = []
    while refs := consumer.lease(8):
        step[0] += 1
        consumer.ack(refs, step=step[0])
        trained += [ref.sample_id for ref in refs]
    return trained


def test_a_fenced_producer_process_can_neither_commit_nor_end_the_run(
    ledger_url: str, tmp_path: Path
) -> None:
    store = SharedDirFeatureStore(tmp_path / "features")
    ledger = Ledger.open(ledger_url)
    old = ProducerProcess(ledger_url, store.uri)
    new: ProducerProcess | None = None
    try:
        assert old.ask("emit " + " ".join(f"a{i}" for i in range(10))) == {"ok": [True] * 10}
        new = ProducerProcess(ledger_url, store.uri)  # the restart: same id, old still alive
        assert new.claimed == {"ok": 2}
        assert new.ask("emit " + " ".join(f"b{i}" for i in range(10))) == {"ok": [True] * 10}

        closed = old.ask("close")  # presumed dead, it closes "rollout-0" while new emits
        assert closed["error"] == "ProducerFencedError", closed
        assert "'rollout-0'" in closed["message"] and "epoch 1" in closed["message"]
        assert "epoch 2" in closed["message"] and "another process took the id" in closed["message"]
        late = old.ask("emit a10")
        assert late["error"] == "ProducerFencedError", late

        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="t", producers=["rollout-0"])
        consumer.resume()
        step = [0]
        trained = _train(consumer, step)
        assert not consumer.producers_done and not consumer.drained  # the new one is open
        assert new.ask("emit " + " ".join(f"b{i}" for i in range(10, 20))) == {"ok": [True] * 10}
        assert new.ask("close") == {"ok": "closed"}
        consumer.refresh()
        trained += _train(consumer, step)
        assert consumer.drained

        state = replay(ledger, RUN)
        assert state.verify() == []
        assert sorted(trained) == sorted(state.committed) == sorted(state.trained)
        assert len(state.committed) == 30 and "a10" not in state.committed
        assert "a10" not in {obj.sample_id for obj in store.scan()}  # its put was deleted
    finally:
        old.stop()
        if new is not None:
            new.stop()
        ledger.close()


def test_a_fenced_producer_leaves_no_features_of_a_refused_commit(ledger, tmp_path) -> None:
    store = SharedDirFeatureStore(tmp_path / "features")
    old = Producer(ledger, store, run_id=RUN, producer_id="p")
    Producer(ledger, store, run_id=RUN, producer_id="p")
    head = ledger.head_seq(RUN)
    with pytest.raises(ProducerFencedError, match=r"'p' .* epoch 1, but the id is held by epoch 2"):
        old.emit_many([("s0", {"x": torch.ones(2)}), ("s1", {"x": torch.ones(2)})])
    with pytest.raises(ProducerFencedError):
        old.commit([store.put("s2", {"x": torch.ones(2)})])
    with pytest.raises(ProducerFencedError):
        old.close()
    assert ledger.head_seq(RUN) == head and list(store.scan()) == []


def test_a_producer_that_closed_emits_nothing_until_it_is_started_again(ledger, store) -> None:
    producer = Producer(ledger, store, run_id=RUN, producer_id="p")
    producer.emit("a", {"x": torch.ones(1)})
    producer.close()
    producer.close()  # again: nothing more
    with pytest.raises(LedgerStateError, match=r"'p' of run 'run' is closed.*new Producer"):
        producer.emit("b", {"x": torch.ones(1)})
    assert replay(ledger, RUN).producers_done and ledger.kind_counts(RUN)[Kind.CLOSE] == 1
    again = Producer(ledger, store, run_id=RUN, producer_id="p")  # its claim reopens "p"
    assert not replay(ledger, RUN).producers_done
    again.emit("b", {"x": torch.ones(1)})
    again.close()
    state = replay(ledger, RUN)
    assert state.producers_done and state.verify() == [] and state.producer_epochs == {"p": 2}


# -- the fold: what a hand-written or pre-epoch log says ------------------------------------


def _insert(url: str, kind: str, actor: str, epoch: int, sample_id: str | None = None) -> None:
    payload = None
    if kind == Kind.COMMIT:
        payload = json.dumps(
            {"generation": 0, "metadata": {}, "sample_id": sample_id, "specs": {}, "store": "x"},
            separators=(",", ":"),
            sort_keys=True,
        )
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        conn.execute(
            "INSERT INTO dataflow_events (run_id, kind, sample_id, revision, epoch, actor,"
            " payload, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (RUN, kind, sample_id, 0 if kind == Kind.COMMIT else None, epoch, actor, payload, 0),
        )


def test_a_stale_close_in_the_log_does_not_end_the_run_and_is_reported(sqlite_url) -> None:
    ledger, store = Ledger.open(sqlite_url), LocalFeatureStore()
    Producer(ledger, store, run_id=RUN, producer_id="p")
    Producer(ledger, store, run_id=RUN, producer_id="p").emit("a", {"x": torch.ones(1)})
    _insert(sqlite_url, Kind.CLOSE, "p", 1)  # the fenced holder's close, forged past the ledger
    _insert(sqlite_url, Kind.COMMIT, "p", 1, "z")
    state = replay(ledger, RUN)
    assert not state.producers_done
    problems = state.verify()
    assert any("close by producer 'p' with producer epoch 1, but epoch 2" in p for p in problems)
    assert any("commit of 'z' by producer 'p' with producer epoch 1" in p for p in problems)


def test_a_commit_after_a_close_without_a_claim_is_reported(sqlite_url) -> None:
    """The twin producers of a pre-epoch ledger: one closed, the other went on committing.
    A consumer may have finished between the two, so verify must not say clean."""
    ledger, store = Ledger.open(sqlite_url), LocalFeatureStore()
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("DELETE FROM dataflow_producers")
    for kind, sample_id in ((Kind.COMMIT, "a"), (Kind.CLOSE, None), (Kind.COMMIT, "b")):
        _insert(sqlite_url, kind, "rollout-0", 0, sample_id)
    problems = replay(ledger, RUN).verify()
    assert problems == [
        f"seq {ledger.head_seq(RUN)}: commit of 'b' by producer 'rollout-0' after its close, "
        "with no claim between: a consumer may have taken the run as finished without it"
    ]
    assert store is not None


def test_a_claim_that_does_not_raise_the_epoch_is_reported(sqlite_url) -> None:
    ledger = Ledger.open(sqlite_url)
    Producer(ledger, LocalFeatureStore(), run_id=RUN, producer_id="p")
    _insert(sqlite_url, Kind.CLAIM, "p", 1)
    state = replay(ledger, RUN)
    assert state.verify() == [
        f"seq {ledger.head_seq(RUN)}: claim of producer 'p' with epoch 1, not above the epoch "
        "1 holding it"
    ]


def test_a_schema_2_ledger_is_read_as_is_and_migrated_by_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    with sqlite3.connect(path) as conn:  # what dataflow wrote before producer epochs
        conn.executescript(
            """
            CREATE TABLE dataflow_schema (id INTEGER PRIMARY KEY, version INTEGER NOT NULL);
            INSERT INTO dataflow_schema VALUES (1, 2);
            CREATE TABLE dataflow_runs (run_id VARCHAR(256) PRIMARY KEY, epoch INTEGER NOT NULL);
            INSERT INTO dataflow_runs VALUES ('run', 0);
            CREATE TABLE dataflow_events (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                run_id VARCHAR(256) NOT NULL, kind VARCHAR(16) NOT NULL, sample_id VARCHAR(256),
                revision INTEGER, epoch INTEGER NOT NULL, step BIGINT,
                actor VARCHAR(256) NOT NULL, payload TEXT, ts FLOAT NOT NULL);
            CREATE UNIQUE INDEX ux_dataflow_events_commit
                ON dataflow_events (run_id, sample_id, revision) WHERE revision IS NOT NULL;
            CREATE TABLE dataflow_snapshots (run_id VARCHAR(256) NOT NULL, seq BIGINT NOT NULL,
                format INTEGER NOT NULL, digest VARCHAR(64) NOT NULL, body BLOB NOT NULL,
                ts FLOAT NOT NULL, PRIMARY KEY (run_id, seq));
            """
        )
    url = f"sqlite:///{path}"
    _insert(url, Kind.COMMIT, "old", 0, "a")
    _insert(url, Kind.CLOSE, "old", 0)
    with Ledger.open(url, create=False) as reader:  # read-only: read as it is
        state = replay(reader, RUN)
        assert (list(state.committed), state.producers_done, state.verify()) == (["a"], True, [])
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM dataflow_schema").fetchall() == [(2,)]
    with Ledger.open(url) as writer:  # a writer migrates
        producer = Producer(writer, LocalFeatureStore(), run_id=RUN, producer_id="old")
        assert producer.epoch == 1
        producer.emit("b", {"x": torch.ones(1)})
        producer.close()
        state = replay(writer, RUN)
        assert list(state.committed) == ["a", "b"] and state.verify() == []
    with sqlite3.connect(path) as conn:  # through 3 (producer epochs) to 4 (batch rows)
        assert conn.execute("SELECT version FROM dataflow_schema").fetchall() == [(4,)]


# -- the invariant --------------------------------------------------------------------------

_IDS = ("p0", "p1")
_step = st.tuples(st.sampled_from(("start", "emit", "close")), st.sampled_from(_IDS), st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, max_size=14))
def test_a_run_is_done_exactly_when_the_holder_of_every_started_producer_closed(
    steps: list[tuple[str, str, bool]],
) -> None:
    """Two holders of each id (the current one and the one it fenced) claim, commit and
    close at random: only the current holders' writes count, and the run is done (drained,
    producers_done) iff the current holder of every producer started so far closed."""
    with tempfile.TemporaryDirectory() as tmp, LocalFeatureStore() as store:
        ledger = Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}", durability="normal")
        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="t")
        consumer.resume()
        holders: dict[str, Producer] = {}
        fenced: dict[str, Producer] = {}
        closed: set[str] = set()
        committed: set[str] = set()
        step = [0]
        for n, (what, pid, by_fenced) in enumerate(steps):
            if what == "start" or pid not in holders:
                if pid in holders:
                    fenced[pid] = holders[pid]
                holders[pid] = Producer(ledger, store, run_id=RUN, producer_id=pid)
                closed.discard(pid)
            elif by_fenced and pid in fenced:
                zombie, head = fenced[pid], ledger.head_seq(RUN)
                with pytest.raises((ProducerFencedError, LedgerStateError)):
                    if what == "emit" or zombie._closed:
                        zombie.emit(f"{pid}-{n}", {"x": torch.ones(1)})
                    else:
                        zombie.close()
                assert ledger.head_seq(RUN) == head
            elif what == "emit":
                if pid in closed:
                    with pytest.raises(LedgerStateError, match="is closed"):
                        holders[pid].emit(f"{pid}-{n}", {"x": torch.ones(1)})
                else:
                    holders[pid].emit(f"{pid}-{n}", {"x": torch.ones(1)})
                    committed.add(f"{pid}-{n}")
            else:
                holders[pid].close()
                closed.add(pid)
            consumer.refresh()
            _train(consumer, step)
            done = bool(holders) and set(holders) <= closed
            state = replay(ledger, RUN)
            assert state.producers_done == consumer.producers_done == done, steps[: n + 1]
            assert consumer.drained == done, steps[: n + 1]
        state = replay(ledger, RUN)
        assert state.verify() == [] and set(state.committed) == committed
        assert set(state.trained) == committed
        ledger.close()


# -- one producer id: the stream's sender and the Producer ---------------------------------


def test_a_zmq_sender_without_an_id_speaks_for_its_producer(ledger, store) -> None:
    receiver = ZmqRefReceiver(ReceiverConfig(expected_producers=1))
    sender = ZmqRefSender(SenderConfig(endpoints=(receiver.endpoint,), close_timeout=10))
    try:
        producer = Producer(ledger, store, run_id=RUN, producer_id="rollout-7", stream=sender)
        assert sender.producer_id == "rollout-7"
        ref = producer.emit("a", {"x": torch.ones(1)})
        assert receiver.receive(1, timeout=WAIT_S) == [ref]
        producer.close()
        # The EOF came under "rollout-7": the one producer it expects closed, the stream ends.
        assert receiver.receive(1, timeout=WAIT_S) == [] and receiver.exhausted
    finally:
        sender.close()
        receiver.close()


def test_a_sender_naming_another_producer_is_refused_naming_both(ledger, store) -> None:
    receiver = ZmqRefReceiver(ReceiverConfig())
    sender = ZmqRefSender(SenderConfig(endpoints=(receiver.endpoint,), producer_id="rollout-1"))
    try:
        with pytest.raises(InvalidArgumentError, match=r"'rollout-1' is not the Producer's .*'p'"):
            Producer(ledger, store, run_id=RUN, producer_id="p", stream=sender)
        Producer(ledger, store, run_id=RUN, producer_id="rollout-1", stream=sender)  # equal: ok
    finally:
        sender.close()
        receiver.close()
    stream = MemoryStream()
    with pytest.raises(InvalidArgumentError, match=r"producer 'a', not the Producer's .*'b'"):
        Producer(ledger, store, run_id=RUN, producer_id="b", stream=stream.sender("a"))
    unnamed = stream.sender()
    Producer(ledger, store, run_id=RUN, producer_id="b", stream=unnamed)
    assert unnamed.producer_id == "b"


@pytest.mark.parametrize("bad", [5, "", "x" * 300])
def test_a_bad_sender_producer_id_is_refused(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="producer_id must be a str of 1-256"):
        SenderConfig(endpoints=("tcp://127.0.0.1:1",), producer_id=bad)


def test_a_commit_retry_after_an_unknown_outcome_settles_for_the_holder_only(
    sqlite_url, monkeypatch
) -> None:
    """The retry after CommitOutcomeUnknownError is the holder's own (its epoch): it settles
    as before. Fenced between the two tries, it keeps the features (the first may have
    landed) and says both."""
    store = LocalFeatureStore()
    with Ledger.open(sqlite_url) as ledger, Ledger.open(sqlite_url) as elsewhere:
        producer = Producer(ledger, store, run_id=RUN, producer_id="p")
        dialect = ledger._engine.dialect
        real, fence = type(dialect).do_commit, [False]

        def do_commit(dbapi_connection) -> None:
            real(dialect, dbapi_connection)  # it lands; the reply is lost
            if fence[0]:
                fence[0] = False
                Producer(elsewhere, store, run_id=RUN, producer_id="p")  # a restart claims
            raise dialect.dbapi.OperationalError("server closed the connection unexpectedly")

        refs = [store.put(s, {"x": torch.ones(1)}) for s in ("a", "b")]
        calls = {"n": 0}

        def fail_first(dbapi_connection) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                do_commit(dbapi_connection)
            real(dialect, dbapi_connection)

        monkeypatch.setattr(dialect, "do_commit", fail_first)
        assert producer.commit(refs) == refs  # the same holder's retry: committed once
        assert replay(ledger, RUN).committed == {r.sample_id: r for r in refs}

        more = [store.put("c", {"x": torch.ones(1)})]
        calls["n"], fence[0] = 0, True
        fenced = r"producer epoch 1, but the id is held by epoch 2"
        with pytest.raises(CommitOutcomeUnknownError, match=fenced):
            producer.commit(more)
        assert store.exists(more[0])  # it landed: its features stay
        state = replay(ledger, RUN)
        assert "c" in state.committed and state.verify() == []


def test_a_producer_on_a_schema_2_ledger_opened_without_create_is_told_to_migrate(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/v2.db"
    Ledger.open(url).close()
    with sqlite3.connect(tmp_path / "v2.db") as conn:
        conn.execute("DROP TABLE dataflow_producers")
        conn.execute("UPDATE dataflow_schema SET version = 2")
    with Ledger.open(url, create=False) as reader:
        with pytest.raises(SchemaVersionError, match=r"predates producer epochs.*Ledger\.open"):
            Producer(reader, LocalFeatureStore(), run_id=RUN, producer_id="p")
        assert reader.head_seq(RUN) == 0


def test_a_producer_that_fails_to_start_claims_nothing(ledger, store) -> None:
    """A claimed id is waited for until it closes: a Producer whose start fails (here its
    metrics port is taken) must not leave one behind."""
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(OSError, match="metrics"):
        Producer(ledger, store, run_id=RUN, producer_id="p", metrics_port=taken.getsockname()[1])
    assert ledger.head_seq(RUN) == 0
    with pytest.raises(InvalidArgumentError):
        Producer(ledger, store, run_id=RUN, producer_id="p", stream=MemoryStream().sender("q"))
    assert ledger.head_seq(RUN) == 0
