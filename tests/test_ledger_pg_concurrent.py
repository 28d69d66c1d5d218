"""Producers of one run append at once on PostgreSQL, and readers, dedup and fencing stay exact.

Real processes against a real server: producer processes commit batches into one
run while a follower process tails it (``Ledger.follow``) and records every seq
it reads; processes race for the same sample ids; a second process claims a
producer id, or resumes a consumer, while the first keeps writing. Hypothesis
draws the batches and the overlaps. The worker processes are started once per
module and take commands as JSON lines (this file, run as a script), so that
each example costs commits, not interpreter starts.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy

from dataflow import (
    Consumer,
    Kind,
    Ledger,
    OperationalError,
    Producer,
    ProducerFencedError,
    SchemaVersionError,
    StaleEpochError,
    replay,
)
from dataflow.interfaces import FeatureStore
from dataflow.model import SampleRef
from dataflow.recorder._ledger import NewEvent

pytestmark = pytest.mark.postgres

WORKERS = 6
SENTINEL = "sentinel"
_REPLY_S = 120.0  # the most any one command may take before the test fails


class RefOnlyStore(FeatureStore):
    """Refs without features: what the ledger records is all these tests look at (and a
    worker that never imports torch starts in a second)."""

    def _put(self, sample_id: str, tensors: Any, metadata: Any) -> SampleRef:
        raise AssertionError("the workers commit refs; they put nothing")

    def _get(self, ref: SampleRef, names: list[str]) -> Any:
        raise AssertionError("nothing is read")

    def _delete(self, ref: SampleRef) -> None:
        pass

    def _exists(self, ref: SampleRef) -> bool:
        return True  # a duplicate's committed features are live: ours are dropped

    def _scan(self) -> Iterator[Any]:
        return iter(())


# -- the worker process ---------------------------------------------------------------------


def _produce(
    ledger: Ledger,
    store: FeatureStore,
    run: str,
    producer: str,
    batches: list[list[str]],
    until_fenced: int = 0,
    close: bool = False,
) -> dict[str, Any]:
    """Claim ``producer`` and commit ``batches``; with ``until_fenced``, go on committing
    fresh ids (up to that many batches) until another process claims the id; with
    ``close``, close the producer after its batches."""
    made = Producer(ledger, store, run_id=run, producer_id=producer)
    _say({"claimed": made.epoch})
    committed: list[str] = []
    fenced = False
    if until_fenced:
        batches = [
            [f"{producer}-{made.epoch}-{i}-{j}" for j in range(4)] for i in range(until_fenced)
        ]
    for batch in batches:
        refs = [SampleRef(sid, store.open_uri, 1) for sid in batch]
        try:
            results = made.commit(refs)
        except ProducerFencedError:
            fenced = True
            break
        committed += [ref.sample_id for ref in results if ref is not None]
    if close:
        made.close()
    return {"epoch": made.epoch, "committed": committed, "fenced": fenced}


def _consume(
    ledger: Ledger, store: FeatureStore, run: str, consumer: str, rounds: int
) -> dict[str, Any]:
    """Resume, then lease and ack up to ``rounds`` times or until a newer epoch fences it."""
    made = Consumer(ledger, store, run_id=run, consumer_id=consumer)
    epoch = made.resume().epoch
    _say({"resumed": epoch})
    acked, fenced = 0, False
    for step in range(1, rounds + 1):
        try:
            refs = made.lease(2)
            if refs:
                made.ack(refs, step=step)
                acked += len(refs)
        except StaleEpochError:
            fenced = True
            break
    return {"epoch": epoch, "acked": acked, "fenced": fenced}


def _rank(
    ledger: Ledger, store: FeatureStore, run: str, rank: int, world: int, rounds: int
) -> dict[str, Any]:
    """Rank ``rank`` of ``world``: resume (rank 0 first: the others join its epoch), then
    lease and ack (alternately with ``ack_and_lease``) until it is finished."""
    made = Consumer(
        ledger, store, run_id=run, consumer_id=f"rank{rank}", rank=rank, world_size=world
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no events yet": producers just began
        epoch = made.resume().epoch
    _say({"resumed": epoch})
    acked: list[str] = []
    refs: list[SampleRef] = []
    step = 0
    for i in range(rounds):
        if refs:
            step += 1
            acked += [ref.sample_id for ref in refs]
            if i % 2:
                refs = made.ack_and_lease([(refs, step)], 4)
                continue
            made.ack(refs, step=step)
        refs = made.lease(4, timeout=0.02)
        if not refs and made.finished:
            return {"acked": acked, "finished": True}
    return {"acked": acked, "finished": False}


def _resume(ledger: Ledger, store: FeatureStore, run: str, consumer: str) -> dict[str, Any]:
    return {"epoch": Consumer(ledger, store, run_id=run, consumer_id=consumer).resume().epoch}


def _follow(ledger: Ledger, store: FeatureStore, run: str) -> dict[str, Any]:
    """Tail the run from its start until the sentinel's event; every seq read, in order."""
    seqs = []
    for event in ledger.follow(run, poll_interval=0.01, timeout=_REPLY_S):
        seqs.append(event.seq)
        if event.actor == SENTINEL:
            return {"seqs": seqs}
    return {"seqs": seqs, "error": "no sentinel"}


_OPS = {
    "produce": _produce,
    "consume": _consume,
    "rank": _rank,
    "resume": _resume,
    "follow": _follow,
}


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _serve(url: str, index: int) -> None:
    """A worker: one JSON command a line on stdin, its reply (after any progress lines)."""
    with Ledger.open(url) as ledger:
        store = RefOnlyStore(f"mem://refs-{index}")
        _say({"ready": index})
        for line in sys.stdin:
            command = json.loads(line)
            try:
                reply = _OPS[command.pop("op")](ledger, store, **command)
            except Exception:
                reply = {"error": traceback.format_exc()}
            _say({"reply": reply})


# -- the test side ----------------------------------------------------------------------------


class Worker:
    def __init__(self, url: str, index: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.process = subprocess.Popen(
            [sys.executable, __file__, url, str(index)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        # A thread reads the lines: a selector would miss those already in the pipe's buffer.
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for got in self.process.stdout:
            self._lines.put(got)
        self._lines.put("")

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def line(self) -> dict[str, Any]:
        """The worker's next line (a progress line, or the reply to its command)."""
        try:
            got = self._lines.get(timeout=_REPLY_S)
        except queue.Empty:
            raise AssertionError("the worker said nothing in time") from None
        assert got, f"the worker ended (exit code {self.process.wait(timeout=10)})"
        return json.loads(got)

    def reply(self) -> dict[str, Any]:
        while "reply" not in (message := self.line()):
            pass
        reply = message["reply"]
        assert "error" not in reply, reply["error"]
        return reply

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def pg(postgres_server: str) -> Iterator[tuple[str, list[Worker]]]:
    """A database, and WORKERS worker processes on it."""
    from dataflow.testing._postgres import create_database, drop_database

    name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    url = create_database(postgres_server, name)
    Ledger.open(url).close()  # the schema, once
    workers = [Worker(url, i) for i in range(WORKERS)]
    try:
        for worker in workers:
            assert "ready" in worker.line()
        yield url, workers
    finally:
        for worker in workers:
            worker.close()
        drop_database(postgres_server, name)


@pytest.fixture
def ledger(pg: tuple[str, list[Worker]]) -> Iterator[Ledger]:
    with Ledger.open(pg[0]) as led:
        yield led


def _end(ledger: Ledger, run: str) -> None:
    """The event the follower stops at, appended after everything else."""
    with ledger.write(run, SENTINEL) as tx:
        tx.append([NewEvent(Kind.CLOSE, SENTINEL)])


def _plans(batch_sizes: list[list[int]], overlap: bool) -> list[list[list[str]]]:
    """Per producer, its batches of ids: its own ids, or (``overlap``) ids every producer
    commits too, each in an order of its own."""
    plans = []
    for p, sizes in enumerate(batch_sizes):
        total = sum(sizes)
        ids = [f"s{(i + 5 * p) % total:04d}" if overlap else f"p{p}-{i:04d}" for i in range(total)]
        batches, start = [], 0
        for size in sizes:
            batches.append(ids[start : start + size])
            start += size
        plans.append(batches)
    return plans


def _check_run(ledger: Ledger, run: str, seqs_read: list[int], replies: list[dict]) -> None:
    everything = [e.seq for e in ledger.events(run)]
    # The follower read every event once, in seq order, and nothing the table lacks.
    assert seqs_read == sorted(set(seqs_read))
    assert seqs_read == everything
    commits = [(e.sample_id, e.revision) for e in ledger.events(run) if e.kind == Kind.COMMIT]
    assert [key for key, n in Counter(commits).items() if n > 1] == []
    committed = [sid for reply in replies for sid in reply["committed"]]
    assert sorted(committed) == sorted(sid for sid, _ in commits)  # each by one producer
    assert replay(ledger, run).verify() == []


def test_producer_processes_commit_at_once_and_a_follower_reads_each_event_once(
    pg: tuple[str, list[Worker]], ledger: Ledger
) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _, workers = pg
    producers, follower = workers[:4], workers[4]

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        batch_sizes=st.lists(
            st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=4, max_size=4
        ),
        overlap=st.booleans(),
    )
    def run_one(batch_sizes: list[list[int]], overlap: bool) -> None:
        run = f"run-{uuid.uuid4().hex[:8]}"
        follower.send("follow", run=run)
        for worker, batches in zip(producers, _plans(batch_sizes, overlap), strict=True):
            worker.send("produce", run=run, producer=f"p{producers.index(worker)}", batches=batches)
        replies = [worker.reply() for worker in producers]
        _end(ledger, run)
        _check_run(ledger, run, follower.reply()["seqs"], replies)

    run_one()


def test_a_claim_fences_a_producer_that_keeps_committing(
    pg: tuple[str, list[Worker]], ledger: Ledger
) -> None:
    _, workers = pg
    old, new, other = workers[0], workers[1], workers[2]
    run = f"run-{uuid.uuid4().hex[:8]}"
    other.send("produce", run=run, producer="other", batches=[[f"o{i}"] for i in range(200)])
    old.send("produce", run=run, producer="p", batches=[], until_fenced=3000)
    assert old.line() == {"claimed": 1}
    new.send("produce", run=run, producer="p", batches=[["late"]])
    fenced, taken, _ = old.reply(), new.reply(), other.reply()
    assert fenced["fenced"] and taken["epoch"] == 2
    events = list(ledger.events(run))
    claim = next(e.seq for e in events if e.kind == Kind.CLAIM and e.epoch == 2)
    old_commits = [e for e in events if e.actor == "p" and e.kind == Kind.COMMIT and e.epoch == 1]
    assert sorted(e.sample_id for e in old_commits) == sorted(fenced["committed"])
    assert all(e.seq < claim for e in old_commits)  # nothing of the fenced epoch after it
    assert replay(ledger, run).verify() == []


def test_a_resume_fences_a_consumer_that_keeps_writing_beside_producers(
    pg: tuple[str, list[Worker]], ledger: Ledger
) -> None:
    _, workers = pg
    run = f"run-{uuid.uuid4().hex[:8]}"
    producers, old, new = workers[:3], workers[3], workers[4]
    for i, worker in enumerate(producers):
        batches = [[f"p{i}-{b}-{j}" for j in range(8)] for b in range(40)]
        worker.send("produce", run=run, producer=f"p{i}", batches=batches)
    old.send("consume", run=run, consumer="old", rounds=3000)
    assert old.line() == {"resumed": 1}
    new.send("resume", run=run, consumer="new")
    assert new.reply() == {"epoch": 2}
    stopped = old.reply()
    for worker in producers:
        worker.reply()
    assert stopped["fenced"]
    events = list(ledger.events(run))
    resume = next(e.seq for e in events if e.kind == Kind.RESUME and e.epoch == 2)
    assert [e for e in events if e.actor == "old" and e.seq > resume] == []
    assert replay(ledger, run).verify() == []


def test_processes_claiming_one_producer_id_at_once_get_one_epoch_each_in_order(
    pg: tuple[str, list[Worker]], ledger: Ledger
) -> None:
    _, workers = pg
    run = f"run-{uuid.uuid4().hex[:8]}"
    for i, worker in enumerate(workers):
        worker.send("produce", run=run, producer="p", batches=[[f"s{i}"]])
    replies = [worker.reply() for worker in workers]
    assert sorted(reply["epoch"] for reply in replies) == list(range(1, len(workers) + 1))
    claims = [e.epoch for e in ledger.events(run) if e.kind == Kind.CLAIM]
    assert claims == list(range(1, len(workers) + 1))  # in the log in the order of their epochs
    # Only the holder's commit, if it came after every claim, counts; the rest were fenced.
    state = replay(ledger, run)
    assert state.verify() == [] and state.producer_epochs == {"p": len(workers)}


# -- in one process: the locks themselves ----------------------------------------------------


def _commit(ledger: Ledger, run: str, sample_id: str) -> None:
    with ledger.write(run, "commit", shared=True) as tx:
        tx.append_first_commits("p", {sample_id: json.dumps({"sample_id": sample_id})})


def _open_in_a_thread(
    ledger: Ledger, open_write: Callable[[str], Any]
) -> Iterator[tuple[str, threading.Event]]:
    """A write of a fresh run (whose producer "p" claimed), ``open_write(run)`` giving the
    write and what to append in it, held open in a thread until the event yielded is set."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    with ledger.write(run, "claim") as tx:
        tx.claim_producer("p", None)
    inside, release, failed = threading.Event(), threading.Event(), []

    def hold() -> None:
        try:
            write, append = open_write(run)
            with write as tx:
                append(tx)
                inside.set()
                assert release.wait(timeout=_REPLY_S)
        except BaseException as exc:
            failed.append(exc)
            inside.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert inside.wait(timeout=_REPLY_S) and not failed, failed
    yield run, release
    release.set()
    thread.join(timeout=_REPLY_S)
    assert not thread.is_alive() and not failed, failed


@pytest.fixture
def held(ledger: Ledger) -> Iterator[tuple[str, threading.Event]]:
    """A producer transaction of a fresh run, open in a thread (its commit appended) until
    the event returned is set."""

    def commit(run: str) -> Any:
        tx = ledger.write(run, "commit", shared=True)
        return tx, lambda t: t.append_first_commits(
            "p", {"first": json.dumps({"sample_id": "first"})}
        )

    yield from _open_in_a_thread(ledger, commit)


def test_two_producer_transactions_of_one_run_are_open_at_once(
    ledger: Ledger, held: tuple[str, threading.Event]
) -> None:
    run, release = held
    quick = Ledger.open(ledger.url, busy_timeout=5)
    try:
        _commit(quick, run, "second")  # under the old row lock: a lock timeout here
        # Committed above the open transaction's seqs: readers wait for that one first.
        assert [e.sample_id for e in quick.events(run) if e.kind == Kind.COMMIT] == []
        release.set()
        for _ in range(1000):  # until the thread's COMMIT is in
            if len(list(quick.events(run))) == 3:
                break
            time.sleep(0.01)
        assert [e.sample_id for e in quick.events(run) if e.kind == Kind.COMMIT] == [
            "first",
            "second",
        ]
    finally:
        quick.close()


def test_a_consumer_write_waits_for_the_producers_in_flight_within_the_busy_timeout(
    ledger: Ledger, held: tuple[str, threading.Event]
) -> None:
    run, _ = held
    with Ledger.open(ledger.url, busy_timeout=0.2) as quick:
        with (
            pytest.raises(OperationalError, match="held the ledger's write lock for longer"),
            quick.write(run, "ack"),
        ):
            pass
        _commit(quick, run, "beside")  # producers still go on


def test_a_ledger_whose_sequence_gave_seqs_above_the_new_ones_is_refused(
    postgres_url: str,
) -> None:
    Ledger.open(postgres_url).close()

    engine = sqlalchemy.create_engine(postgres_url)
    try:
        with engine.begin() as conn:  # a ledger of an older dataflow: seqs from the sequence
            conn.exec_driver_sql(
                "INSERT INTO dataflow_events (run_id, kind, epoch, actor, ts) "
                "VALUES ('r', 'close', 0, 'old', 0)"
            )
        with Ledger.open(postgres_url) as led:  # opens: new seqs sort after the old ones
            with led.write("r", "close", shared=True) as tx:
                tx.append([NewEvent(Kind.CLOSE, "new")])
            assert [e.actor for e in led.events("r")] == ["old", "new"]
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"SELECT setval(pg_get_serial_sequence('dataflow_events', 'seq'), {2**62})"
            )
    finally:
        engine.dispose()
    with pytest.raises(SchemaVersionError, match=r"seqs up to 4611686018427387904 from the seq"):
        Ledger.open(postgres_url)
    Ledger.open(postgres_url, read_only=True).close()  # a reader reads it as it stands


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))


# -- consumer writes beside producers ------------------------------------------------------


def test_ranks_lease_and_ack_beside_producer_processes_and_a_follower_reads_each_event_once(
    pg: tuple[str, list[Worker]], ledger: Ledger
) -> None:
    """Consumer writes hold the run's lock shared (one consumer write at a time): ranks
    lease and ack while producers commit, and nothing is leased twice, lost, or read
    out of order by a follower."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _, workers = pg
    producers, ranks, follower = workers[:3], workers[3:5], workers[5]

    @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        batch_sizes=st.lists(
            st.lists(st.integers(1, 24), min_size=1, max_size=6), min_size=3, max_size=3
        ),
        overlap=st.booleans(),
    )
    def run_one(batch_sizes: list[list[int]], overlap: bool) -> None:
        run = f"run-{uuid.uuid4().hex[:8]}"
        follower.send("follow", run=run)
        for i, (worker, batches) in enumerate(
            zip(producers, _plans(batch_sizes, overlap), strict=True)
        ):
            worker.send("produce", run=run, producer=f"p{i}", batches=batches, close=True)
            assert "claimed" in worker.line()
        for rank, worker in enumerate(ranks):  # rank 0 resumes first, the other joins it
            worker.send("rank", run=run, rank=rank, world=len(ranks), rounds=5000)
            assert "resumed" in worker.line()
        replies = [worker.reply() for worker in producers]
        trained = [worker.reply() for worker in ranks]
        assert all(reply["finished"] for reply in trained)
        _end(ledger, run)
        _check_run(ledger, run, follower.reply()["seqs"], replies)
        acked = [sid for reply in trained for sid in reply["acked"]]
        committed = sorted(sid for reply in replies for sid in reply["committed"])
        assert sorted(acked) == committed  # each committed sample trained once, by one rank
        in_ledger = [s for e in ledger.events(run) if e.kind == Kind.ACK for s in e.sample_ids]
        assert sorted(in_ledger) == committed

    run_one()


@pytest.fixture
def consumer_write(ledger: Ledger) -> Iterator[tuple[str, threading.Event]]:
    """A consumer write of a fresh run (whose producer "p" claimed), open in a thread with
    a lease row appended, until the event returned is set."""

    def lease(run: str) -> Any:
        tx = ledger.write(run, "lease", consumers=True)
        return tx, lambda t: t.append([NewEvent(Kind.CLOSE, "consumer")])

    yield from _open_in_a_thread(ledger, lease)


def test_producers_commit_while_a_consumer_write_is_open_and_sort_after_it(
    ledger: Ledger, consumer_write: tuple[str, threading.Event]
) -> None:
    run, release = consumer_write
    with Ledger.open(ledger.url, busy_timeout=5) as quick:
        _commit(quick, run, "beside")  # under the old exclusive lock: a lock timeout here
        assert [e.actor for e in quick.events(run)] == ["p"]  # the claim; the rest waits
        release.set()
        for _ in range(1000):  # until the consumer's COMMIT is in
            if len(list(quick.events(run))) == 3:
                break
            time.sleep(0.01)
        assert [(e.kind, e.actor) for e in quick.events(run)] == [
            (Kind.CLAIM, "p"),
            (Kind.CLOSE, "consumer"),
            (Kind.COMMIT, "p"),
        ]


def test_consumer_writes_of_one_run_are_one_at_a_time_within_the_busy_timeout(
    ledger: Ledger, consumer_write: tuple[str, threading.Event]
) -> None:
    run, _ = consumer_write
    with (
        Ledger.open(ledger.url, busy_timeout=0.2) as quick,
        pytest.raises(OperationalError, match="held the ledger's write lock for longer"),
        quick.write(run, "ack", consumers=True),
    ):
        pass


def test_a_consumer_write_waits_for_the_producers_in_flight_within_the_busy_timeout_too(
    ledger: Ledger, held: tuple[str, threading.Event]
) -> None:
    run, release = held
    with Ledger.open(ledger.url, busy_timeout=0.2) as quick:
        with (
            pytest.raises(OperationalError, match="held the ledger's write lock for longer"),
            quick.write(run, "ack", consumers=True),
        ):
            pass
        release.set()  # the producer's transaction ends: the consumer write goes through
        with quick.write(run, "ack", consumers=True) as tx:
            assert [row[2] for row in tx.rows_after(0) if row[1] == Kind.COMMIT] == ["first"]


def test_a_consumer_write_is_not_held_back_by_a_transaction_open_outside_its_run(
    ledger: Ledger,
) -> None:
    """A transaction with an id, open elsewhere on the server, holds the horizon back: a
    consumer write then waits only for the writers of its own run (read from pg_locks)."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    with ledger.write(run, "claim") as tx:
        tx.claim_producer("p", None)
    engine = sqlalchemy.create_engine(ledger.url)
    try:
        with engine.connect() as other, other.begin():
            other.exec_driver_sql("SELECT pg_current_xact_id()")  # takes an id, stays open
            with Ledger.open(ledger.url, busy_timeout=5) as quick:
                with quick.write(run, "lease", consumers=True) as tx:
                    tx.append([NewEvent(Kind.CLOSE, "consumer")])
                _commit(quick, run, "after")
                # Readers outside a write wait for the horizon: the claim only, for now.
                assert [e.kind for e in quick.events(run)] == [Kind.CLAIM]
                with quick.write(run, "ack", consumers=True) as tx:  # reads its exact tail
                    assert [row[6] for row in tx.rows_after(0)] == ["p", "consumer", "p"]
    finally:
        engine.dispose()
    assert [e.actor for e in ledger.events(run)] == ["p", "consumer", "p"]
