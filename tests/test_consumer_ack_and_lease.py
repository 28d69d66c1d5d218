"""Consumer.ack_and_lease: the acks of some steps and the next lease in one ledger write.

Real SQLite files and a real PostgreSQL server (the ``ledger`` fixture); a stream is
the in-process MemoryStream, whose behaviour the stream tests pin down.
"""

from __future__ import annotations

import pytest
import torch

from dataflow import Consumer, Kind, LedgerStateError, Producer, replay
from dataflow.streams import MemoryStream
from tests._writes import record_writes


@pytest.fixture
def writes(ledger) -> list[str]:
    """What each of the ledger's write transactions was for, in order."""
    return record_writes(ledger)


def kinds(ledger, run_id) -> list[tuple[Kind, str | None]]:
    return [
        (e.kind, e.sample_id) for e in ledger.events(run_id) if e.kind in (Kind.ACK, Kind.LEASE)
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


def test_with_refs_still_coming_from_a_stream_it_is_an_ack_then_a_lease(
    ledger, store, run_id, writes
) -> None:
    stream = MemoryStream(window=8, expected_producers=1)
    consumer = Consumer(
        ledger, store, run_id=run_id, consumer_id="trainer", stream=stream.receiver()
    )
    consumer.resume()
    producer = Producer(ledger, store, run_id=run_id, stream=stream.sender("p"))
    for sample_id in ("a", "b", "c", "d"):
        producer.emit(sample_id, {"x": torch.tensor(1.0)})
    refs = consumer.lease(2)
    writes.clear()
    assert ids(consumer.ack_and_lease([(refs, 1)], 2)) == ["c", "d"]
    assert writes == ["ack", "lease"]  # the lease waited on the stream outside the transaction
    state = replay(ledger, run_id)
    assert state.trained == {"a": 1, "b": 1} and sorted(state.leased) == ["c", "d"]
