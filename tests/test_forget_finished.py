"""A consumer whose fold forgets finished samples (``Consumer.forget_finished``) behaves
like one whose fold keeps them: the property harness's state machine, with every consumer
forgetting as soon as a sample finishes, and its live folds checked against a whole
replay restricted to what they keep."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, run_state_machine_as_test

from dataflow import (
    ArgumentTypeError,
    Consumer,
    InvalidArgumentError,
    Ledger,
    Producer,
    RunState,
    replay,
)
from dataflow.model import _fold
from dataflow.model._lineage import IdHashes
from dataflow.streams import MemoryStream
from dataflow.testing import machine_settings
from dataflow.testing._machine import LedgerMachine
from stores import LocalFeatureStore


@pytest.fixture
def forget_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compact at every finished sample (a long run compacts every few thousand)."""
    monkeypatch.setattr(_fold, "_COMPACT_AT", 1)
    monkeypatch.setattr(_fold, "_COMPACT_SHARE", 2**62)


def _kept(observable: dict[str, Any], forgotten: set[str]) -> dict[str, Any]:
    """``observable`` without the samples of ``forgotten``."""
    kept = dict(observable)
    kept["committed"] = {s: r for s, r in kept["committed"].items() if s not in forgotten}
    kept["trained"] = {s: step for s, step in kept["trained"].items() if s not in forgotten}
    kept["released"] = [s for s in kept["released"] if s not in forgotten]
    return kept


class ForgettingMachine(LedgerMachine):
    def _new_consumers(self) -> list[Consumer]:
        consumers = super()._new_consumers()
        for consumer in consumers:
            consumer.forget_finished = True
        return consumers

    @invariant()
    def ledger_agrees_with_the_model(self) -> None:
        # The harness's checks of the ledger; those of the live folds follow, restricted.
        consumers, self.consumers = self.consumers, []
        try:
            super().ledger_agrees_with_the_model()
        finally:
            self.consumers = consumers
        whole = replay(self.ledger, self.run_id)
        if not consumers:
            return
        assert whole.trained == self.trained, "trained set differs from the lineage model"
        leased = {r.sample_id for refs in self.leased.values() for r in refs}
        assert set(whole.leased) == leased
        for consumer in consumers:
            consumer._catch_up()
            live = consumer.state
            assert live.forgetting
            forgotten = set(whole.committed) - set(live.committed)
            assert len(forgotten) == live.forgotten_count
            for sid in forgotten:  # only finished samples are forgotten
                assert sid in whole.trained, sid
                assert sid in whole.released or whole.release_policy == "never", sid
                assert not whole.is_pending(sid) and sid not in whole.leased, sid
                assert sid not in whole.dead and sid not in whole.excluded, sid
                assert sid not in whole.lost and sid not in whole.regenerate, sid
            assert all(live.is_trained(s) for s in whole.trained)
            assert not any(live.is_trained(s) for s in set(whole.committed) - set(whole.trained))
            assert _kept(live.observable(), forgotten) == _kept(whole.observable(), forgotten)
            assert live.verify() == [], live.verify()


@pytest.mark.usefixtures("forget_at_once")
def test_a_forgetting_consumer_behaves_like_one_that_keeps_everything(sqlite_url: str) -> None:
    ledger = Ledger.open(sqlite_url, durability="normal")
    try:
        machine = type(
            "ForgettingRun",
            (ForgettingMachine,),
            {"ledger": ledger, "make_store": staticmethod(LocalFeatureStore)},
        )
        run_state_machine_as_test(machine, settings=machine_settings("normal", max_examples=60))
    finally:
        ledger.close()


@pytest.mark.postgres
@pytest.mark.usefixtures("forget_at_once")
def test_a_forgetting_consumer_on_postgres(postgres_url: str) -> None:
    # PostgreSQL's own part: a whole refold reads below the horizon of running writes,
    # and the transaction's own rows come after it (RunView.catch_up_in).
    ledger = Ledger.open(postgres_url, durability="normal")
    try:
        machine = type(
            "ForgettingPgRun",
            (ForgettingMachine,),
            {"ledger": ledger, "make_store": staticmethod(LocalFeatureStore)},
        )
        run_state_machine_as_test(machine, settings=machine_settings("normal", max_examples=15))
    finally:
        ledger.close()


@given(st.lists(st.text(max_size=12), max_size=300), st.lists(st.text(max_size=12), max_size=50))
@settings(max_examples=200, deadline=None)
def test_id_hashes_hold_every_id_added(added: list[str], others: list[str]) -> None:
    table = IdHashes()
    for sid in added:
        table.add(sid)
    assert all(sid in table for sid in added)
    assert len(table) == len(set(added))  # 64-bit hashes of a few hundred ids: no collision
    assert not any(sid in table for sid in set(others) - set(added))


def _run_to_the_end(ledger: Ledger, samples: int, *, policy: str, ckpts: Path) -> Consumer:
    with LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="r", producer_id="p")
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c", release_policy=policy)
        consumer.forget_finished = True
        consumer.resume()
        refs = [store.put(f"s{i:04d}", {"x": torch.full((2,), float(i))}) for i in range(samples)]
        producer.commit(refs)
        producer.close()
        step = 0
        while batch := consumer.lease(3, timeout=0):
            step += 1
            consumer.ack(batch, step=step)
            if step % 5 == 0:
                (ckpts / str(step)).mkdir()
                consumer.record_checkpoint(step, ckpts / str(step))
        return consumer


@pytest.mark.usefixtures("forget_at_once")
@pytest.mark.parametrize("policy", ["on_ack", "on_checkpoint", "never"])
def test_a_finished_run_keeps_next_to_nothing_and_resumes_exactly(
    sqlite_url: str, policy: str, tmp_path: Path
) -> None:
    ledger = Ledger.open(sqlite_url)
    try:
        consumer = _run_to_the_end(ledger, 60, policy=policy, ckpts=tmp_path)
        state = consumer.state
        assert state.forgotten_count >= 50 and len(state.committed) <= 10
        assert all(state.is_trained(f"s{i:04d}") for i in range(60))
        assert not state.is_trained("never-committed")
        # A resume from a checkpoint in the same process: the fold takes it whole.
        plan = consumer.resume(10)
        whole = replay(ledger, "r")
        assert dataclasses.astuple(plan) == dataclasses.astuple(whole.plans[plan.epoch].for_rank(0))
        assert plan.trained == whole.plans[plan.epoch].trained
        assert consumer.state.forgetting
        assert consumer.state.verify() == [] and whole.verify() == []
    finally:
        ledger.close()


def test_forget_finished_takes_a_bool(sqlite_url: str) -> None:
    with Ledger.open(sqlite_url) as ledger, LocalFeatureStore() as store:
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c")
        with pytest.raises(ArgumentTypeError, match="forget_finished must be a bool"):
            consumer.forget_finished = 1  # type: ignore[assignment]
        assert consumer.forget_finished is False


def _stream_run(ledger: Ledger, run_id: str, ops: list[tuple[str, int]], *, forget: bool) -> list:
    """Lease and ack, resending refs through the stream between leases as ``ops`` say; the
    ids of each lease, in order."""
    stream = MemoryStream(window=4096, expected_producers=1, idle_timeout=30)
    with LocalFeatureStore() as store:
        consumer = Consumer(
            ledger,
            store,
            run_id=run_id,
            consumer_id="c",
            stream=stream.receiver(0),
            release_policy="on_ack",
        )
        consumer.forget_finished = forget
        consumer.resume()
        sender = stream.sender("p")
        producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=sender)
        sent = [
            r for r in producer.emit_many([(f"s{i:02d}", {"x": torch.ones(1)}) for i in range(24)])
        ]
        leases, step = [], 0
        for op, n in ops:
            if op == "resend":
                sender.send_many(sent[n::5])  # finished, leased and pending ones alike
                continue
            batch = consumer.lease(n + 1, timeout=0)
            leases.append([r.sample_id for r in batch])
            if batch:
                step += 1
                consumer.ack(batch, step=step)
        producer.close()
        while batch := consumer.lease(8, timeout=5):
            leases.append([r.sample_id for r in batch])
            step += 1
            consumer.ack(batch, step=step)
        assert consumer.state.verify() == []
        assert consumer.state.forgotten_count == (24 if forget else 0)
        consumer.close()
    return leases


@given(st.lists(st.tuples(st.sampled_from(["lease", "lease", "resend"]), st.integers(0, 4))))
@settings(max_examples=25, deadline=None)
def test_resent_refs_are_handed_out_as_without_forgetting(ops: list[tuple[str, int]]) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch.object(_fold, "_COMPACT_AT", 1),
        mock.patch.object(_fold, "_COMPACT_SHARE", 2**62),
        Ledger.open(f"sqlite:///{tmp}/forgets.db") as ledger,
        Ledger.open(f"sqlite:///{tmp}/keeps.db") as other,
    ):
        forgetting = _stream_run(ledger, "r", ops, forget=True)
        keeping = _stream_run(other, "r", ops, forget=False)
        assert forgetting == keeping
        handed = [sid for batch in forgetting for sid in batch]
        assert sorted(handed) == [f"s{i:02d}" for i in range(24)]  # each once: none twice
        assert replay(ledger, "r").verify() == []


def test_a_fold_without_its_ledger_cannot_forget() -> None:
    with pytest.raises(InvalidArgumentError, match="has no ref_source, so it cannot forget"):
        RunState("r").forget_finished()
