"""Seeded lease order (``Consumer(order_seed=...)``): independent of how producers interleave
their commits, and a resume that regenerates puts the samples back at their places.

Real SQLite ledgers; hypothesis draws the interleavings.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import Consumer, Ledger, Producer, replay, seeded_order
from stores import LocalFeatureStore

RUN = "run"
SEED = 7
IDS = [f"s{i:02d}" for i in range(12)]


def _commit_interleaved(led: Ledger, store: LocalFeatureStore, order: list[int]) -> None:
    """Two producers commit IDS[0::2] and IDS[1::2]; ``order`` says who commits next."""
    producers = [Producer(led, store, run_id=RUN, producer_id=f"p{i}") for i in range(2)]
    shares = [iter(IDS[0::2]), iter(IDS[1::2])]
    for who in order:
        sid = next(shares[who])
        producers[who].emit(sid, {"x": torch.tensor([float(IDS.index(sid))])})
    for producer in producers:
        producer.close()


def _lease_all(consumers: list[Consumer], batch: int, *, step: int = 0) -> list[list[str]]:
    """Each rank's lease order, leasing one batch per rank in turn (acks after ``step``)."""
    orders: list[list[str]] = [[] for _ in consumers]
    while not all(c.drained for c in consumers):
        step += 1
        for rank, consumer in enumerate(consumers):
            refs = consumer.lease(batch)
            orders[rank] += [r.sample_id for r in refs]
            if refs:
                consumer.ack(refs, step=step)
    return orders


def _made(directory: Path) -> str:
    """``directory``, made: checkpoint paths must exist."""
    directory.mkdir()
    return str(directory)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


interleavings = st.permutations([0] * 6 + [1] * 6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=interleavings, resume_first=st.booleans())
def test_the_seeded_order_does_not_depend_on_the_interleaving(
    order: list[int], resume_first: bool
) -> None:
    with tempfile.TemporaryDirectory() as d, Ledger.open(f"sqlite:///{d}/ledger.db") as led:
        store = LocalFeatureStore()
        consumers = [
            Consumer(
                led, store, run_id=RUN, consumer_id=f"r{r}", rank=r, world_size=2, order_seed=SEED
            )
            for r in range(2)
        ]
        if resume_first:  # the trainer is up before the dataset is complete
            for c in consumers:
                c.resume()
            assert consumers[0].lease(4) == []  # nothing until every producer closed
        _commit_interleaved(led, store, order)
        if not resume_first:
            for c in consumers:
                c.resume()
        orders = _lease_all(consumers, 2)
        assert replay(led, RUN).verify() == []
    expected = seeded_order(IDS, SEED)
    assert orders == [expected[0::2], expected[1::2]]


def test_without_a_seed_the_order_is_the_commit_order(workdir: Path) -> None:
    interleaving = [1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    shares = [iter(IDS[0::2]), iter(IDS[1::2])]
    committed = [next(shares[who]) for who in interleaving]
    with Ledger.open(f"sqlite:///{workdir}/ledger.db") as led:
        store = LocalFeatureStore()
        _commit_interleaved(led, store, interleaving)
        consumer = Consumer(led, store, run_id=RUN, consumer_id="r0")
        consumer.resume()
        [order] = _lease_all([consumer], 3)
    assert order == committed and committed[:3] == ["s01", "s03", "s00"]


def _trained_in_order(led: Ledger) -> list[str]:
    return [sid for e in led.events(RUN) if e.kind == "ack" for sid in e.sample_ids]


def test_a_resume_that_regenerates_puts_the_samples_back_at_their_places(workdir: Path) -> None:
    with Ledger.open(f"sqlite:///{workdir}/ledger.db") as led:
        store = LocalFeatureStore()
        _commit_interleaved(led, store, [0, 1] * 6)
        first = Consumer(led, store, run_id=RUN, consumer_id="first", order_seed=SEED)
        first.resume()
        for step in range(1, 5):  # 3 per step; checkpoints at 2 and 4 release what they hold
            first.ack(first.lease(3), step=step)
            if step % 2 == 0:
                first.checkpoint(step, _made(workdir / f"ckpt-{step}"))
        uninterrupted = seeded_order(IDS, SEED)
        assert _trained_in_order(led) == uninterrupted

        second = Consumer(led, store, run_id=RUN, consumer_id="second", order_seed=SEED)
        plan = second.resume(2)
        assert sorted(plan.regenerate) == sorted(uninterrupted[6:12])  # released at step 4
        assert second.lease(3) == [] and not second.drained  # waits for the regeneration
        producer = Producer(led, store, run_id=RUN, producer_id="regenerate")
        for sid in reversed(plan.regenerate):  # in any order: the places are the seed's
            producer.regenerate(sid, {"x": torch.tensor([float(IDS.index(sid))])})
        assert second.lease(3) == []  # the regenerating producer has not closed yet
        producer.close()
        for step in range(3, 5):
            second.ack(second.lease(3), step=step)
        assert second.drained
        run = replay(led, RUN)
        assert run.verify() == [] and sorted(run.trained) == sorted(IDS)
        # The lineage from step 2 trained the same samples, in the same order, as before.
        assert _trained_in_order(led)[12:] == uninterrupted[6:12]


def test_a_resume_keeps_each_rank_on_its_own_queue(workdir: Path) -> None:
    with Ledger.open(f"sqlite:///{workdir}/ledger.db") as led:
        store = LocalFeatureStore()
        _commit_interleaved(led, store, [0, 1] * 6)

        def ranks(name: str) -> list[Consumer]:
            return [
                Consumer(
                    led,
                    store,
                    run_id=RUN,
                    consumer_id=f"{name}{r}",
                    rank=r,
                    world_size=2,
                    release_policy="never",
                    order_seed=SEED,
                )
                for r in range(2)
            ]

        first = ranks("a")
        for c in first:
            c.resume()
        first[0].ack(first[0].lease(2), step=1)
        first[1].ack(first[1].lease(1), step=1)  # rank 1 took less: uneven progress
        first[0].checkpoint(1, _made(workdir / "ckpt-1"))
        expected = seeded_order(IDS, SEED)
        second = ranks("b")
        for c in second:
            c.resume()
        orders = _lease_all(second, 2, step=1)
    # Each rank goes on with the rest of the queue it had, not a re-split of what is left.
    assert orders == [expected[0::2][2:], expected[1::2][1:]]


def test_order_seed_bad_input(workdir: Path) -> None:
    with Ledger.open(f"sqlite:///{workdir}/ledger.db") as led:
        store = LocalFeatureStore()
        with pytest.raises(TypeError, match=r"order_seed must be an int, got float 1\.5"):
            Consumer(led, store, run_id=RUN, consumer_id="c", order_seed=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="order_seed must be >= 0, got -1"):
            Consumer(led, store, run_id=RUN, consumer_id="c", order_seed=-1)
