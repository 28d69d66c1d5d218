"""Consumer.ack_and_lease: the acks of some steps and the next lease in one ledger write.

Real SQLite files and a real PostgreSQL server (the ``ledger`` fixture); a stream is
the in-process MemoryStream, whose behaviour the stream tests pin down.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, CorruptLedgerError, Kind, Ledger, LedgerStateError, Producer, replay
from dataflow.streams import MemoryStream
from stores import LocalFeatureStore
from tests._writes import record_writes


@pytest.fixture
def writes(ledger) -> list[str]:
    """What each of the ledger's write transactions was for, in order."""
    return record_writes(ledger)


def kinds(ledger, run_id) -> list[tuple[Kind, str | None]]:
    """(kind, sample) of each ack and lease, a batch row once for each sample it names."""
    return [
        (e.kind, sid)
        for e in ledger.events(run_id)
        if e.kind in (Kind.ACK, Kind.LEASE)
        for sid in e.sample_ids
    ]


def ids(refs) -> list[str]:
    return [r.sample_id for r in refs]


def test_the_acks_and_the_lease_are_one_write_acks_first(
    ledger, run_id, emit, make_consumer, writes
) -> None:
    emit("a", "b", "c", "d", "e")
    consumer = make_consumer()
    consumer.resume()
    first, second = consumer.lease(1), consumer.lease(1)
    writes.clear()
    leased = consumer.ack_and_lease([(first, 1), (second, 2)], 2)
    assert ids(leased) == ["c", "d"]
    assert writes == ["ack+lease"]
    assert kinds(ledger, run_id)[2:] == [
        (Kind.ACK, "a"), (Kind.ACK, "b"), (Kind.LEASE, "c"), (Kind.LEASE, "d"),
    ]  # fmt: skip
    state = replay(ledger, run_id)
    assert state.trained == {"a": 1, "b": 2}
    assert state.leased == {"c": "trainer", "d": "trainer"}
    assert consumer.state.snapshot() == state.snapshot()
    assert consumer.load(leased[0])["x"].tolist() == list(b"c")


def test_with_nothing_ready_the_acks_are_written_alone(
    ledger, run_id, emit, make_consumer, producer, writes
) -> None:
    emit("a", "b")
    producer.close()
    consumer = make_consumer()
    consumer.resume()
    refs = consumer.lease(2)
    writes.clear()
    assert consumer.ack_and_lease([(refs, 1)], 4) == []
    assert writes == ["ack+lease"]
    assert replay(ledger, run_id).trained == {"a": 1, "b": 1}
    assert consumer.finished


@pytest.mark.parametrize(
    ("acks", "max_refs", "error", "match"),
    [
        ("a", 2, TypeError, "ack_many takes a list of \\(refs, step\\) pairs"),
        ([(["a"], 1, 2)], 2, TypeError, "ack_many takes \\(refs, step\\) pairs"),
        ([(["a"], 2), (["b"], 1)], 2, LedgerStateError, "got step 1 after step 2"),
        ([(["a"], 1), (["a"], 2)], 2, ValueError, "the same sample more than once"),
        ([(["a"], 0)], 2, LedgerStateError, "ack step must be >= 1, got 0"),
        ([(["a"], 1), (["c"], 2)], 2, LedgerStateError, "cannot ack 'c': it is not leased"),
        ([(["a"], 1)], 0, ValueError, "max_refs"),
        ([(["a"], 1)], "2", TypeError, "max_refs"),
        ([(["a"], 1)], True, TypeError, "max_refs"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(
    ledger, run_id, emit, make_consumer, acks, max_refs, error, match
) -> None:
    emit("a", "b", "c", "d")
    consumer = make_consumer()
    consumer.resume()
    consumer.lease(2)
    head = replay(ledger, run_id).head_seq
    with pytest.raises(error, match=match):
        consumer.ack_and_lease(acks, max_refs)
    state = replay(ledger, run_id)
    assert state.head_seq == head and state.trained == {}
    assert sorted(state.leased) == ["a", "b"]


def test_an_ack_the_ledger_refuses_leases_nothing(ledger, run_id, emit, make_consumer, tmp_path):
    emit("a", "b", "c", "d")
    consumer = make_consumer()
    consumer.resume()
    refs = consumer.lease(2)
    consumer.checkpoint(3, tmp_path)
    head = replay(ledger, run_id).head_seq
    with pytest.raises(LedgerStateError, match="a checkpoint at step 3 already exists"):
        consumer.ack_and_lease([(refs, 2)], 2)
    assert replay(ledger, run_id).head_seq == head
    assert consumer.state.snapshot() == replay(ledger, run_id).snapshot()
    assert ids(consumer.ack_and_lease([(refs, 4)], 2)) == ["c", "d"]


def test_a_seeded_order_waiting_for_a_regeneration_writes_only_the_acks(
    ledger, run_id, emit, make_consumer, producer, writes
) -> None:
    emit("a", "b", "c", "d")
    producer.close()
    consumer = make_consumer(order_seed=7)
    consumer.resume()
    first, gone = consumer.lease(1), consumer.lease(1)
    consumer.lost(gone, reason="features gone")  # the order waits until it is regenerated
    writes.clear()
    assert consumer.ack_and_lease([(first, 1)], 2) == []
    assert writes == ["ack+lease"]
    assert replay(ledger, run_id).trained == {first[0].sample_id: 1}
    producer.regenerate(gone[0].sample_id, {"x": torch.tensor(1.0)})
    producer.close()
    assert len(consumer.lease(4)) == 3


def _streaming(ledger, store, run_id, *sample_ids: str, window: int = 8):
    """A consumer whose refs come over a MemoryStream, with ``sample_ids`` sent to it."""
    stream = MemoryStream(window=window, expected_producers=1)
    consumer = Consumer(
        ledger, store, run_id=run_id, consumer_id="trainer", stream=stream.receiver()
    )
    consumer.resume()
    producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=stream.sender("p"))
    for sample_id in sample_ids:
        producer.emit(sample_id, {"x": torch.tensor(1.0)})
    return consumer, producer


def test_with_refs_coming_from_a_stream_those_it_holds_are_leased_in_the_same_write(
    ledger, store, run_id, writes
) -> None:
    consumer, producer = _streaming(ledger, store, run_id, "a", "b", "c", "d")
    refs = consumer.lease(2)
    writes.clear()
    leased = consumer.ack_and_lease([(refs, 1)], 2)
    assert ids(leased) == ["c", "d"]
    assert writes == ["ack+lease"]
    state = replay(ledger, run_id)
    assert state.trained == {"a": 1, "b": 1} and sorted(state.leased) == ["c", "d"]
    assert consumer.stream.stats().in_flight == 2  # a and b's slots went back with their acks
    assert consumer.ack_and_lease([(leased, 2)], 2) == []  # the stream holds nothing now
    assert consumer.stream.stats().in_flight == 0
    producer.close()
    assert replay(ledger, run_id).verify() == []


def test_an_ack_the_ledger_refuses_takes_nothing_off_the_stream(
    ledger, store, run_id, tmp_path
) -> None:
    consumer, _ = _streaming(ledger, store, run_id, "a", "b", "c", "d")
    refs = consumer.lease(2)
    consumer.checkpoint(3, tmp_path)
    with pytest.raises(LedgerStateError, match="a checkpoint at step 3 already exists"):
        consumer.ack_and_lease([(refs, 2)], 2)
    assert consumer.stream.stats().delivered == 2  # c and d are still on the stream
    assert ids(consumer.ack_and_lease([(refs, 4)], 2)) == ["c", "d"]


@pytest.mark.parametrize("call", ["ack_and_lease", "lease"])
def test_refs_taken_off_the_stream_for_a_failed_write_give_their_slots_back(
    tmp_path: Path, call: str
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(f"sqlite:///{path}")
    consumer, producer = _streaming(ledger, LocalFeatureStore(), "run", "a", "b")
    refs = consumer.lease(2)
    producer.emit("c", {"x": torch.tensor(1.0)})
    producer.emit("d", {"x": torch.tensor(1.0)})
    # Before the consumer folds it, c's commit is damaged: it still names c (the fold
    # takes it), but no ref can be made of it.
    seq = next(e.seq for e in ledger.events("run") if e.kind == Kind.COMMIT and e.sample_id == "c")
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE dataflow_events SET payload = ? WHERE seq = ?", ('{"sample_id":"c"}', seq)
        )
    head = ledger.head_seq("run")
    with pytest.raises(CorruptLedgerError, match="the commit of 'c'"):
        if call == "lease":
            consumer.lease(2)
        else:
            consumer.ack_and_lease([(refs, 1)], 2)
    assert ledger.head_seq("run") == head  # neither the acks nor a lease
    stats = consumer.stream.stats()
    assert (stats.delivered, stats.credited, stats.in_flight) == (4, 2, 2)  # c, d: slots back
    consumer.ack(refs, step=1)
    assert replay(ledger, "run").trained == {"a": 1, "b": 1}
