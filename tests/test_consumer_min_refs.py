"""``Consumer.lease(min_refs=...)``: from a stream that trickles, one lease of the refs a
caller waits for, not one lease row per trickle; and the one ACK row of ``ack_many``'s
several steps, as the readers of the log see it.

Real SQLite files; the stream is the in-process MemoryStream, fed from another thread by a
producer with its own ledger connection.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, DataflowError, Kind, Ledger, Producer, replay
from dataflow.streams import MemoryStream
from dataflow.tools import final_lineage
from dataflow.tools._samples import sample_history
from dataflow.tools._time_travel import seq_at_step
from stores import LocalFeatureStore

RUN = "run"


def _rig(tmp_path: Path, window: int = 16):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store = LocalFeatureStore()
    stream = MemoryStream(window=window, expected_producers=1)
    consumer = Consumer(
        Ledger.open(url), store, run_id=RUN, consumer_id="trainer", stream=stream.receiver()
    )
    consumer.resume()
    producer = Producer(
        Ledger.open(url), store, run_id=RUN, producer_id="p", stream=stream.sender("p")
    )
    return consumer, producer


def _leases(consumer: Consumer) -> list[list[str]]:
    return [e.sample_ids for e in consumer.ledger.events(RUN) if e.kind == Kind.LEASE]


def _trickle(consumer: Consumer, producer: Producer, ids: list[str], *, close: bool) -> None:
    """Emit ``ids`` one at a time, each once the lease took the one before off the stream:
    each comes alone, as from a producer slower than the trainer."""
    for n, sample_id in enumerate(ids):
        producer.emit(sample_id, {"x": torch.tensor(1.0)})
        deadline = time.monotonic() + 60
        while consumer.stream.stats().delivered <= n and time.monotonic() < deadline:
            time.sleep(0.001)
    if close:
        producer.close()


@pytest.mark.parametrize("close", [False, True])
def test_a_lease_with_min_refs_waits_for_them_and_writes_one_lease_row(
    tmp_path: Path, close: bool
) -> None:
    consumer, producer = _rig(tmp_path)
    ids = [f"s{i}" for i in range(6)]
    feeder = threading.Thread(
        target=_trickle, args=(consumer, producer, ids), kwargs={"close": close}
    )
    feeder.start()
    try:
        refs = consumer.lease(8 if close else 6, timeout=60, min_refs=8 if close else 6)
    finally:
        feeder.join(60)
    # All six in one lease: with close, the stream's end stops the wait short of 8.
    assert [r.sample_id for r in refs] == ids
    assert _leases(consumer) == [ids]
    assert replay(consumer.ledger, RUN).leased == dict.fromkeys(ids, "trainer")


def test_a_lease_with_min_refs_takes_what_came_once_its_timeout_passed(tmp_path: Path) -> None:
    consumer, producer = _rig(tmp_path)
    for sample_id in ("a", "b"):
        producer.emit(sample_id, {"x": torch.tensor(1.0)})
    refs = consumer.lease(4, timeout=0.05, min_refs=4)
    assert [r.sample_id for r in refs] == ["a", "b"]
    assert _leases(consumer) == [["a", "b"]]
    assert consumer.lease(4, timeout=0, min_refs=4) == []  # nothing more: no row
    assert _leases(consumer) == [["a", "b"]]


def test_min_refs_one_is_the_lease_of_what_is_there(tmp_path: Path) -> None:
    consumer, producer = _rig(tmp_path)
    producer.emit("a", {"x": torch.tensor(1.0)})
    assert [r.sample_id for r in consumer.lease(4, timeout=0)] == ["a"]


@pytest.mark.parametrize(
    ("min_refs", "match"),
    [
        (0, "min_refs"),
        (-1, "min_refs"),
        (5, "min_refs=5 is more than max_refs=4"),
        (True, "min_refs"),
        ("2", "min_refs"),
    ],
)
def test_bad_min_refs_are_refused_and_nothing_is_leased(
    tmp_path: Path, min_refs: object, match: str
) -> None:
    consumer, producer = _rig(tmp_path)
    producer.emit("a", {"x": torch.tensor(1.0)})
    with pytest.raises(DataflowError, match=match):
        consumer.lease(4, timeout=0, min_refs=min_refs)  # type: ignore[arg-type]
    assert _leases(consumer) == []
    assert consumer.stream.stats().delivered == 0  # still on the stream
    assert [r.sample_id for r in consumer.lease(4, timeout=0)] == ["a"]


def test_the_acks_of_several_steps_are_one_row_that_readers_give_each_sample_its_step(
    tmp_path: Path,
) -> None:
    consumer, producer = _rig(tmp_path)
    for sample_id in ("a", "b", "c", "d"):
        producer.emit(sample_id, {"x": torch.tensor(1.0)})
    refs = consumer.lease(4, timeout=60, min_refs=4)
    consumer.ack_many([(refs[:2], 1), (refs[2:3], 2), (refs[3:], 3)])
    producer.close()
    ledger = consumer.ledger
    (ack,) = [e for e in ledger.events(RUN) if e.kind == Kind.ACK]
    assert ack.step == 3 and ack.payload["steps"] == [1, 1, 2, 3]
    assert ack.sample_steps == [1, 1, 2, 3]
    state = replay(ledger, RUN)
    assert state.trained == {"a": 1, "b": 1, "c": 2, "d": 3} and state.verify() == []
    assert [t[0] for t in final_lineage(ledger, RUN).trainings] == [1, 1, 2, 3]
    (event,) = [e for e in sample_history(ledger, RUN, "c")["events"] if e["kind"] == Kind.ACK]
    assert event["step"] == 2 and event["detail"] == "trained into step 2"
    # Time travel reads the row at its highest step (the step column).
    assert seq_at_step(ledger, RUN, 3) == ack.seq
