"""One rank restarts alone (``Consumer.rejoin``), and retries go back to the rank that nacked.

Real SQLite files, a real shared-directory store and real processes (from a fork server): a rank is
SIGKILLed while it holds leases and a new process with the same consumer id rejoins the
epoch, gets those leases back first and never fences the rank that went on. A retry
nacked after the other rank drained and exited is still trained. The workers live at
module level so that the children can import them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import forkserver_context

from dataflow import (
    Consumer,
    Kind,
    Ledger,
    LedgerStateError,
    Producer,
    SampleRef,
    StaleEpochError,
    replay,
)
from dataflow.streams import MemoryStream
from stores import LocalFeatureStore, SharedDirFeatureStore

pytestmark = pytest.mark.slow

RUN = "run"
FORKED = forkserver_context(__name__)
WAIT = 120.0  # seconds before a stuck child fails the test instead of hanging it


# -- workers -------------------------------------------------------------------------------
def _consumer(url: str, features: str, rank: int, **options: Any) -> Consumer:
    return Consumer(
        Ledger.open(url),
        SharedDirFeatureStore(features),
        run_id=RUN,
        consumer_id=f"rank{rank}",
        rank=rank,
        world_size=2,
        **options,
    )


def _train(consumer: Consumer, refs: list[SampleRef], step: int) -> None:
    for ref in refs:
        consumer.load(ref)  # the features are there
    consumer.ack(refs, step=step)


def rank0_trains_across_the_restart(url: str, features: str, events: Any, go: Any) -> None:
    consumer = _consumer(url, features, 0)
    consumer.resume()
    for step in (1, 2):
        _train(consumer, consumer.lease(2), step)
    events.put(("rank0", "halfway", consumer.epoch))
    if not go.wait(WAIT):
        raise SystemExit("rank 1 never rejoined")
    step = 2
    for refs in consumer.batches(2):
        step += 1
        _train(consumer, refs, step)
    consumer.refresh()  # StaleEpochError had rank 1's restart fenced this rank off
    events.put(("rank0", "done", consumer.epoch))


def rank1_dies_holding_leases(url: str, features: str, pipe: Any) -> None:
    consumer = _consumer(url, features, 1)
    consumer.resume()
    _train(consumer, consumer.lease(2), 1)
    held = consumer.lease(3)
    # A pipe of its own, written in this thread: a Queue's feeder thread, killed between
    # its write and the release of the queue's shared lock, would block every other writer.
    pipe.send([r.sample_id for r in held])
    time.sleep(WAIT)  # SIGKILLed here


def rank1_rejoins(url: str, features: str, events: Any) -> None:
    consumer = _consumer(url, features, 1)
    reclaimed = consumer.rejoin()
    first = consumer.lease(8)
    step = consumer.state.last_ack_step(consumer.consumer_id) + 1
    _train(consumer, first, step)
    events.put(("rank1", "reclaimed", list(reclaimed), [r.sample_id for r in first]))
    for refs in consumer.batches(2):
        step += 1
        _train(consumer, refs, step)
    events.put(("rank1", "done", consumer.epoch))


def rank1_drains(url: str, features: str, events: Any) -> None:
    consumer = _consumer(url, features, 1)
    consumer.resume()
    trained: list[str] = []
    for step, refs in enumerate(consumer.batches(2), start=1):
        _train(consumer, refs, step)
        trained += [r.sample_id for r in refs]
    events.put(("rank1", "drained", trained))


# -- helpers -------------------------------------------------------------------------------
class Children:
    """Child processes and their messages; killed at the end whatever happens."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.events = FORKED.Queue()
        self.backlog: list[tuple[Any, ...]] = []

    def start(self, target: Any, *args: Any) -> mp.process.BaseProcess:
        proc = FORKED.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def expect(self, who: str, what: str) -> tuple[Any, ...]:
        """The next message ``what`` from ``who`` (its fields); others wait for their turn."""
        deadline = time.monotonic() + WAIT
        while True:
            for message in self.backlog:
                if message[:2] == (who, what):
                    self.backlog.remove(message)
                    return message[2:]
            try:
                self.backlog.append(self.events.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"waited {WAIT}s for {who} {what!r}; got {self.backlog}")

    def join(self, proc: mp.process.BaseProcess) -> int | None:
        proc.join(WAIT)
        if proc.is_alive():
            pytest.fail(f"{proc.name} hung")
        return proc.exitcode


@pytest.fixture
def children() -> Iterator[Children]:
    made = Children()
    yield made
    for proc in made.procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, str]:
    """A committed dataset of 16 samples (closed): the ledger URL and the store's directory."""
    url, features = f"sqlite:///{tmp_path}/ledger.db", str(tmp_path / "features")
    with Ledger.open(url) as ledger:
        producer = Producer(ledger, SharedDirFeatureStore(features), run_id=RUN)
        for i in range(16):
            producer.emit(f"s{i:02d}", {"x": torch.full((4,), float(i))})
        producer.close()
    return url, features


def _held_by(state: Any, consumer_id: str) -> list[str]:
    return [sid for sid, holder in state.leased.items() if holder == consumer_id]


def _check_each_sample_trained_once(url: str) -> list[Any]:
    """The final lineage trains every committed sample exactly once; the run's events."""
    with Ledger.open(url) as ledger:
        state = replay(ledger, RUN)
        events = list(ledger.events(RUN))
    assert state.verify() == []
    assert set(state.trained) == set(state.committed) and len(state.committed) == 16
    assert not state.pending and not state.leased and not state.dead
    acks = Counter(s for e in events if e.kind == Kind.ACK for s in e.sample_ids)
    assert set(acks.values()) == {1}, acks
    return events


# -- a rank killed and restarted alone ------------------------------------------------------
def test_a_killed_rank_rejoins_gets_its_leases_back_first_and_fences_no_one(
    children: Children, dataset: tuple[str, str]
) -> None:
    url, features = dataset
    go = FORKED.Event()
    rank0 = children.start(rank0_trains_across_the_restart, url, features, children.events, go)
    (epoch,) = children.expect("rank0", "halfway")
    reader, writer = FORKED.Pipe(duplex=False)
    doomed = children.start(rank1_dies_holding_leases, url, features, writer)
    assert reader.poll(WAIT), "rank 1 never took its leases"
    held = reader.recv()
    os.kill(doomed.pid, signal.SIGKILL)
    assert children.join(doomed) == -signal.SIGKILL
    with Ledger.open(url) as ledger:
        assert _held_by(replay(ledger, RUN), "rank1") == held  # stranded without a rejoin

    rejoined = children.start(rank1_rejoins, url, features, children.events)
    reclaimed, first = children.expect("rank1", "reclaimed")
    go.set()  # rank 0 trains the rest of its queue only now, after the rejoin
    assert reclaimed == first == held  # its own leases, first, in the order it took them
    assert children.expect("rank0", "done") == (epoch,)  # never fenced off
    assert children.expect("rank1", "done") == (epoch,)
    assert children.join(rank0) == 0 and children.join(rejoined) == 0

    events = _check_each_sample_trained_once(url)
    assert [e.kind for e in events].count(Kind.RESUME) == 1
    leases = Counter(s for e in events if e.kind == Kind.LEASE for s in e.sample_ids)
    assert set(leases.values()) == {1}  # the reclaimed leases were not leased again
    first_acks = [
        e.step for e in events if e.kind == Kind.ACK and e.actor == "rank1" for _ in e.sample_ids
    ][:2]
    assert first_acks == [1, 1]  # the dead process's acks stayed


# -- retries are not stranded --------------------------------------------------------------
def test_a_retry_nacked_after_the_other_rank_drained_and_exited_is_trained(
    children: Children, dataset: tuple[str, str]
) -> None:
    url, features = dataset
    rank0 = _consumer(url, features, 0)
    rank0.resume()
    held = rank0.lease(2)
    rank1 = children.start(rank1_drains, url, features, children.events)
    (drained,) = children.expect("rank1", "drained")
    assert children.join(rank1) == 0 and len(drained) == 8
    rank0.nack(held, reason="a loader hiccup")  # one of two went to rank 1 by round robin
    trained: list[str] = []
    for step, refs in enumerate(rank0.batches(2), start=1):
        _train(rank0, refs, step)
        trained += [r.sample_id for r in refs]
    assert {r.sample_id for r in held} <= set(trained)
    assert rank0.finished
    _check_each_sample_trained_once(url)


def test_with_a_seed_a_retry_stays_with_its_seeded_owner(dataset: tuple[str, str]) -> None:
    url, features = dataset
    ranks = [_consumer(url, features, r, order_seed=7) for r in (0, 1)]
    for consumer in ranks:
        consumer.resume()
    (taken,) = ranks[1].lease(1)
    ranks[1].nack([taken])
    assert taken.sample_id in set(ranks[1].state.pending_for(1))
    orders: list[list[str]] = [[], []]
    for step in range(1, 20):
        for rank, consumer in enumerate(ranks):
            refs = consumer.lease(2)
            orders[rank] += [r.sample_id for r in refs]
            if refs:
                consumer.ack(refs, step=step)
    assert taken.sample_id in orders[1] and taken.sample_id not in orders[0]
    _check_each_sample_trained_once(url)


def test_a_streamed_retry_goes_back_to_the_rank_that_nacked_it(tmp_path: Path) -> None:
    stream = MemoryStream(ranks=2, expected_producers=1)
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore()
    rank0 = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", rank=0, world_size=2)
    rank0.resume()  # it takes no stream refs: rank 1 has the only receiver
    rank1 = Consumer(
        ledger,
        store,
        run_id=RUN,
        consumer_id="rank1",
        rank=1,
        world_size=2,
        stream=stream.receiver(1),
    )
    rank1.resume()
    producer = Producer(ledger, store, run_id=RUN, producer_id="p", stream=stream.sender("p"))
    for i in range(2):
        producer.emit(f"s{i}", {"x": torch.zeros(2)})
    producer.close()
    refs = rank1.lease(2, timeout=WAIT)
    assert [r.sample_id for r in refs] == ["s0", "s1"]  # s0 sat in rank 0's queue
    rank1.nack(refs)
    assert sorted(rank1.state.pending_for(1)) == ["s0", "s1"]
    again = rank1.lease(2, timeout=WAIT)
    assert sorted(r.sample_id for r in again) == ["s0", "s1"]
    rank1.ack(again, step=1)
    rank0.refresh()
    assert rank0.drained and rank1.finished
    assert replay(ledger, RUN).verify() == []
    ledger.close()


# -- rejoin in one process: the rules ------------------------------------------------------
def test_rank_zero_rejoins_without_a_new_epoch(dataset: tuple[str, str]) -> None:
    url, features = dataset
    old0, rank1 = _consumer(url, features, 0), _consumer(url, features, 1)
    old0.resume()
    rank1.resume()
    held = [r.sample_id for r in old0.lease(3)]
    old0.ack(old0.lease(1), step=1)
    new0 = _consumer(url, features, 0)  # the restarted process of rank 0
    assert new0.rejoin() == tuple(held)
    assert not new0.drained  # its reclaimed leases are still to come
    assert [r.sample_id for r in new0.lease(2)] == held[:2]
    assert [r.sample_id for r in new0.lease(2)] == held[2:]  # a lease gives reclaimed ones alone
    assert [r.sample_id for r in new0.lease(1)] == ["s08"]  # then its queue: s06 was acked
    rank1.ack(rank1.lease(2), step=1)  # not fenced: same epoch
    assert new0.epoch == rank1.epoch == 1
    assert new0.state.last_ack_step("rank0") == 1  # where its steps go on


def test_resume_of_a_rank_above_zero_reclaims_its_leases(dataset: tuple[str, str]) -> None:
    url, features = dataset
    rank0, old1 = _consumer(url, features, 0), _consumer(url, features, 1)
    rank0.resume()
    old1.resume()
    held = [r.sample_id for r in old1.lease(2)]
    new1 = _consumer(url, features, 1)
    new1.resume()  # joins epoch 1, as rank 1 of a restart always did
    assert [r.sample_id for r in new1.lease(4)] == held
    new1.resume()  # again in the same epoch: what it handed out is not handed out twice
    assert not set(held) & {r.sample_id for r in new1.lease(4)}


def test_a_reclaimed_lease_finished_meanwhile_is_not_handed_out(dataset: tuple[str, str]) -> None:
    url, features = dataset
    _consumer(url, features, 0).resume()
    old1 = _consumer(url, features, 1)
    old1.resume()
    held = old1.lease(3)
    new1 = _consumer(url, features, 1)
    assert len(new1.rejoin()) == 3
    old1.ack(held[:1], step=1)  # the old process was not dead after all
    assert [r.sample_id for r in new1.lease(8)] == [r.sample_id for r in held[1:]]


def test_a_full_resume_fences_a_rejoined_rank(dataset: tuple[str, str]) -> None:
    url, features = dataset
    _consumer(url, features, 0).resume()
    rejoined = _consumer(url, features, 0)
    rejoined.rejoin()
    _consumer(url, features, 0).resume()  # a new epoch
    with pytest.raises(StaleEpochError):
        rejoined.lease(1)


def test_rejoin_before_any_resume_is_refused(dataset: tuple[str, str]) -> None:
    url, features = dataset
    consumer = _consumer(url, features, 1)
    head = consumer.ledger.head_seq(RUN)
    with pytest.raises(LedgerStateError, match=r"cannot rejoin run 'run'.*call resume\(\)"):
        consumer.rejoin()
    assert consumer.ledger.head_seq(RUN) == head and consumer.epoch is None


def test_rejoin_with_another_world_size_is_refused(dataset: tuple[str, str]) -> None:
    url, features = dataset
    _consumer(url, features, 0).resume()
    other = Consumer(
        Ledger.open(url),
        SharedDirFeatureStore(features),
        run_id=RUN,
        consumer_id="rank1",
        rank=1,
        world_size=3,
    )
    with pytest.raises(LedgerStateError, match="world_size 2, but this consumer has world_size 3"):
        other.rejoin()
    assert other.epoch is None


def test_rejoin_after_resume_is_refused(dataset: tuple[str, str]) -> None:
    url, features = dataset
    consumer = _consumer(url, features, 0)
    consumer.resume()
    with pytest.raises(LedgerStateError, match=r"already joined epoch 1.*new Consumer"):
        consumer.rejoin()
