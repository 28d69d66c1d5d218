"""A reproducible order with a stream (``Consumer(order_seed=..., stream=..., producers=...)``),
in process: producer threads racing with random timing, on a real SQLite ledger.

The SIGKILLed multi-process version is tests/test_seeded_stream_processes.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from dataflow import (
    Consumer,
    InvalidArgumentError,
    Ledger,
    LedgerStateError,
    Producer,
    replay,
)
from dataflow.live._seeded_stream import ProducerSlots, round_order
from dataflow.streams import MemoryStream
from stores import LocalFeatureStore

PRODUCERS = ("p0", "p1")


def _produce(ledger, store, stream, name: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    producer = Producer(ledger, store, run_id="r", producer_id=name, stream=stream.sender(name))
    for k in range(count):
        time.sleep(rng.uniform(0, 0.004))  # racing: the arrival order differs run to run
        producer.emit(f"{name}-{k:02d}", {"x": torch.full((2,), float(k))})
    producer.close()


def _run(tmp_path, name: str, timing: int, counts=(10, 10), batch: int = 3) -> list[list[str]]:
    """Two producer threads and two ranks; each rank's batches, in lease order."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / name}.db")
    store = LocalFeatureStore()
    stream = MemoryStream(ranks=2, window=256, expected_producers=2)
    ranks = [
        Consumer(
            ledger,
            store,
            run_id="r",
            consumer_id=f"rank{r}",
            rank=r,
            world_size=2,
            stream=stream.receiver(r),
            order_seed=5,
            producers=PRODUCERS,
            release_policy="never",
        )
        for r in range(2)
    ]
    for consumer in ranks:
        consumer.resume(None)
    threads = [
        threading.Thread(target=_produce, args=(ledger, store, stream, p, n, timing * 7 + i))
        for i, (p, n) in enumerate(zip(PRODUCERS, counts, strict=True))
    ]
    for thread in threads:
        thread.start()
    batches: list[list[str]] = [[], []]
    step = 0
    while not all(c.drained for c in ranks):
        step += 1
        for r, consumer in enumerate(ranks):
            got = [ref.sample_id for ref in consumer.lease(batch, timeout=10)]
            if got:
                batches[r].append(got)
                consumer.ack(got, step=step)
        assert step < 100
    for thread in threads:
        thread.join(30)
    assert replay(ledger, "r").verify() == []
    ledger.close()
    return batches


def test_the_order_is_the_same_whatever_the_producers_timing(tmp_path) -> None:
    first = _run(tmp_path, "a", timing=1)
    second = _run(tmp_path, "b", timing=2)
    assert first == second
    flat = [s for rank in first for batch in rank for s in batch]
    assert sorted(flat) == sorted(f"{p}-{k:02d}" for p in PRODUCERS for k in range(10))
    # Full batches until the end of each rank's share.
    for rank in first:
        assert all(len(b) == 3 for b in rank[:-1])


def test_a_producer_that_makes_fewer_samples_leaves_its_slots_empty(tmp_path) -> None:
    batches = _run(tmp_path, "short", timing=3, counts=(10, 4))
    flat = [s for rank in batches for batch in rank for s in batch]
    assert len(flat) == 14 and len(set(flat)) == 14


def test_the_slots_follow_each_producers_sequence_round_by_round() -> None:
    slots = ProducerSlots(PRODUCERS, seed=5, rank=0, world_size=2)
    owners = [slots.owner(i) for i in range(6)]
    assert [k for _, k in owners] == [0, 0, 1, 1, 2, 2]
    for k in range(3):
        assert {owners[2 * k][0], owners[2 * k + 1][0]} == set(PRODUCERS)
        assert tuple(p for p, _ in owners[2 * k : 2 * k + 2]) == round_order(PRODUCERS, 5, k)
    orders = {round_order(PRODUCERS, 5, k) for k in range(20)}
    assert len(orders) == 2  # the seed shuffles each round


def _ready(tmp_path, **options):
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    store = LocalFeatureStore()
    stream = MemoryStream(window=64, expected_producers=2)
    consumer = Consumer(ledger, store, run_id="r", consumer_id="t", stream=stream.receiver(),
                        order_seed=1, **options)  # fmt: skip
    return ledger, store, stream, consumer


def test_a_rank_waits_for_the_producer_whose_turn_it_is(tmp_path) -> None:
    ledger, store, stream, consumer = _ready(tmp_path, producers=PRODUCERS)
    consumer.resume(None)
    first = round_order(PRODUCERS, 1, 0)[0]
    other = next(p for p in PRODUCERS if p != first)
    late = Producer(ledger, store, run_id="r", producer_id=other, stream=stream.sender(other))
    late.emit_many((f"{other}-{k}", {"x": torch.zeros(1)}) for k in range(3))
    assert consumer.lease(1, timeout=0.2) == []  # the first slot is `first`'s
    early = Producer(ledger, store, run_id="r", producer_id=first, stream=stream.sender(first))
    early.emit(f"{first}-0", {"x": torch.zeros(1)})
    assert [r.sample_id for r in consumer.lease(1, timeout=5)] == [f"{first}-0"]
    assert consumer.lease(2, timeout=0.2) == []  # all or nothing: `first`'s turn again
    early.close()
    late.close()
    got = [r.sample_id for r in consumer.lease(10, timeout=5)]
    assert got == [f"{other}-0", f"{other}-1", f"{other}-2"]


def test_order_seed_with_a_stream_needs_the_producers_named(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="producers="):
        _ready(tmp_path)


def test_a_commit_of_a_producer_not_named_is_refused_at_the_lease(tmp_path) -> None:
    ledger, store, _stream, consumer = _ready(tmp_path, producers=PRODUCERS)
    consumer.resume(None)
    Producer(ledger, store, run_id="r", producer_id="stranger").emit("x", {"x": torch.zeros(1)})
    with pytest.raises(LedgerStateError, match="stranger"):
        consumer.lease(1, timeout=0)


def test_a_resume_from_an_older_checkpoint_continues_the_same_sequence(tmp_path) -> None:
    ledger, store, stream, consumer = _ready(tmp_path, producers=PRODUCERS, release_policy="never")
    consumer.resume(None)
    for name in PRODUCERS:
        producer = Producer(ledger, store, run_id="r", producer_id=name, stream=stream.sender(name))
        producer.emit_many((f"{name}-{k}", {"x": torch.zeros(1)}) for k in range(4))
        producer.close()
    straight = []
    for step in range(1, 5):
        got = [r.sample_id for r in consumer.lease(2, timeout=5)]
        straight.append(got)
        consumer.ack(got, step=step)
        if step == 1:
            consumer.record_checkpoint(1, "s3://bucket/1")
    consumer.resume(1)
    again = [straight[0]]
    for step in range(2, 5):
        got = [r.sample_id for r in consumer.lease(2, timeout=5)]
        again.append(got)
        consumer.ack(got, step=step)
    assert again == straight
    assert consumer.drained and consumer.remaining() == 0


def test_a_seeded_stream_checkpointed_before_its_producers_closed_resumes(tmp_path) -> None:
    # The set-up check compared the dataset's size at the checkpoint (what was committed
    # then, while the producers still committed) with its size at the resume.
    from training import CheckpointConfig, CheckpointManager, LoaderConfig, Trainer, TrainerConfig

    led = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    store = LocalFeatureStore()
    # A short send timeout: the refs the stopped first trainer's receiver holds are never
    # credited back; the seeded order leases from the ledger whatever the stream carries.
    stream = MemoryStream(window=64, expected_producers=1, send_timeout=0.5)
    producer = Producer(led, store, run_id="r", producer_id="p0", stream=stream.sender("p0"))
    producer.emit_many((f"s{i}", {"x": torch.zeros(1)}) for i in range(8))

    def trainer(consumer_id: str, max_steps: int | None) -> Trainer:
        consumer = Consumer(led, store, run_id="r", consumer_id=consumer_id,
                            stream=stream.receiver(), order_seed=3, producers=["p0"])  # fmt: skip
        return Trainer(
            consumer,
            step_fn=lambda batch: None,
            state_fn=lambda: {"w": torch.zeros(1)},
            checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
            config=TrainerConfig(max_steps=max_steps, checkpoint_every=1),
            loader_config=LoaderConfig(batch_size=4),
        )

    first = trainer("first", max_steps=1)
    first.run()  # one step, checkpointed with 8 of the samples committed
    producer.emit_many((f"s{i}", {"x": torch.zeros(1)}) for i in range(8, 12))
    producer.close()
    second = trainer("second", max_steps=None)
    second.resume()  # the checkpoint at step 1: 12 samples committed now
    assert second.step == 1
    assert second.run() == 3
    assert set(replay(led, "r").trained) == {f"s{i}" for i in range(12)}
    store.close()
    led.close()
