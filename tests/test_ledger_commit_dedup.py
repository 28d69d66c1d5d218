"""Producer.commit's dedup, answered by the commit index in the insert itself, on both backends.

A commit inserts revision 0 of every id and lets the unique commit index leave out
the ids the run holds; only then does it read what they hold. These tests pin the
results that path must give: duplicates across batches, within a batch, against a
regenerated (higher) revision, and a commit that fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import (
    Kind,
    Ledger,
    OperationalError,
    Producer,
    SampleRef,
    Watermarks,
    replay,
)
from dataflow.live import _producer
from dataflow.testing import sample_refs
from stores import LocalFeatureStore


def commits(ledger, run_id) -> list[tuple[str, int, str]]:
    """(sample id, revision, actor) of every commit event, in log order."""
    return [
        (e.sample_id, e.revision, e.actor) for e in ledger.events(run_id) if e.kind == Kind.COMMIT
    ]


def put(store, sample_id: str, value: float = 0.0) -> SampleRef:
    return store.put(sample_id, {"x": torch.full((2,), value)})


def test_duplicates_across_batches_return_none_and_free_their_fresh_features(
    ledger, store, producer, run_id
):
    first = [put(store, s) for s in ("a", "b")]
    assert producer.commit(first) == first
    with LocalFeatureStore() as other:  # a second copy elsewhere: ours must be freed, theirs kept
        again = [put(other, "b"), put(other, "c"), put(other, "a"), put(other, "d")]
        late = Producer(ledger, other, run_id=run_id, producer_id="late")

        assert late.commit(again) == [None, again[1], None, again[3]]
        assert [other.exists(r) for r in again] == [False, True, False, True]
    assert all(store.exists(r) for r in first)
    assert commits(ledger, run_id) == [
        ("a", 0, "producer"),
        ("b", 0, "producer"),
        ("c", 0, "late"),
        ("d", 0, "late"),
    ]
    assert replay(ledger, run_id).committed == {
        "a": first[0],
        "b": first[1],
        "c": again[1],
        "d": again[3],
    }


def test_a_batch_of_only_duplicates_appends_nothing(ledger, store, producer, run_id):
    refs = [put(store, s) for s in ("a", "b")]
    producer.commit(refs)
    head = ledger.head_seq(run_id)

    assert producer.commit(refs) == [None, None]  # a retried commit: the same refs
    assert all(store.exists(r) for r in refs)  # they are the committed ones: kept
    assert ledger.head_seq(run_id) == head


def test_an_id_repeated_in_a_batch_commits_its_newest_put_once(ledger, run_id):
    with LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id=run_id)
        old_a, b, new_a = put(store, "a", 1), put(store, "b"), put(store, "a", 2)

        assert producer.commit([old_a, b, new_a]) == [None, b, new_a]
        assert commits(ledger, run_id) == [("a", 0, "producer"), ("b", 0, "producer")]
        assert torch.equal(
            store.get(replay(ledger, run_id).committed["a"])["x"], torch.full((2,), 2.0)
        )


def test_emit_many_answers_an_id_repeated_in_a_batch_as_commit_does(ledger, run_id):
    with LocalFeatureStore() as store:
        producer = Producer(
            ledger, store, run_id=run_id, backpressure=Watermarks(high_refs=2, low_refs=1)
        )
        first, last = {"x": torch.full((3,), 1.0)}, {"x": torch.full((7,), 2.0)}
        # One id stored once: it counts once at the gate (two would pass the high mark
        # with the item before it), and its last item is the one committed.
        assert producer.emit("before", {"x": torch.zeros(1)}) is not None
        got = producer.emit_many([("a", first), ("a", last)], block=False)
        assert got[0] is None and got[1] is not None and got[1].specs["x"].shape == (7,)
        assert torch.equal(store.get(got[1])["x"], last["x"])
        assert replay(ledger, run_id).committed["a"] == got[1]


def test_an_id_repeated_in_a_batch_and_already_committed_is_one_duplicate(
    ledger, store, producer, run_id
):
    committed = put(store, "a", 1)
    producer.commit([committed])
    with LocalFeatureStore() as elsewhere:
        late = Producer(ledger, elsewhere, run_id=run_id, producer_id="late")
        older, newer, fresh = put(elsewhere, "a", 2), put(elsewhere, "a", 3), put(elsewhere, "z")

        assert late.commit([older, fresh, newer]) == [None, fresh, None]
        assert not elsewhere.exists(older) and not elsewhere.exists(newer)
    assert replay(ledger, run_id).committed["a"] == committed
    assert commits(ledger, run_id) == [("a", 0, "producer"), ("z", 0, "late")]


def test_a_duplicate_of_a_regenerated_sample_is_settled_against_its_newest_revision(
    ledger, store, run_id
):
    # In one shared store each put supersedes the older features: a duplicate
    # whose put made the committed features stale is committed as the next
    # revision. It must see revision 1 (the newest), not the revision 0 its
    # insert collided with, or the live features would never be committed.
    p1, p2, p3 = (Producer(ledger, store, run_id=run_id, producer_id=p) for p in ("p1", "p2", "p3"))
    assert p1.commit([put(store, "a", 1)]) != [None]
    assert p2.commit([put(store, "a", 2)]) == [None]  # committed as revision 1
    assert replay(ledger, run_id).revision("a") == 1
    live = put(store, "a", 3)

    assert p3.commit([live]) == [None]
    state = replay(ledger, run_id)
    assert state.revision("a") == 2
    assert state.committed["a"] == live
    assert commits(ledger, run_id) == [("a", 0, "p1"), ("a", 1, "p2"), ("a", 2, "p3")]
    assert state.verify() == []


def test_a_duplicate_of_a_regenerated_sample_elsewhere_reports_the_newest_revision(
    ledger, store, producer, run_id, monkeypatch
):
    producer.commit([put(store, "a", 1)])
    producer.commit([put(store, "a", 2)])  # superseded in this store: revision 1
    newest = replay(ledger, run_id).committed["a"]
    settled: list[tuple[str, int, SampleRef]] = []
    original = _producer.Producer._settle_duplicate

    def record(self, ours, revision, committed):
        settled.append((ours.sample_id, revision, committed))
        original(self, ours, revision, committed)

    monkeypatch.setattr(_producer.Producer, "_settle_duplicate", record)
    with LocalFeatureStore() as elsewhere:
        ours = put(elsewhere, "a", 3)

        assert Producer(ledger, elsewhere, run_id=run_id, producer_id="p2").commit([ours]) == [None]
        assert settled == [("a", 1, newest)]
        assert not elsewhere.exists(ours)


def test_a_duplicate_that_cannot_be_settled_never_fails_the_commit(
    ledger, store, run_id, monkeypatch, caplog
):
    # "A call that raises committed nothing": settling a duplicate writes to the ledger
    # after the fresh refs are in, so a failure there is logged, not raised.
    Producer(ledger, store, run_id=run_id, producer_id="p1").commit([put(store, "a", 1)])
    ours, fresh = put(store, "a", 2), put(store, "b")  # ours superseded p1's features of a
    late = Producer(ledger, store, run_id=run_id, producer_id="p2")
    real, calls = ledger.write, []

    def write(run: str, what: str, **options: bool):  # the second one (the settling) fails
        calls.append(what)
        if len(calls) == 2:
            raise OperationalError("the ledger went away")
        return real(run, what, **options)

    monkeypatch.setattr(ledger, "write", write)
    with caplog.at_level(logging.WARNING, logger="dataflow"):
        assert late.commit([ours, fresh]) == [None, fresh]
    assert "'a'" in caplog.text and "recording ours failed (the ledger went away)" in caplog.text
    assert commits(ledger, run_id) == [("a", 0, "p1"), ("b", 0, "p2")]


def test_a_commit_that_fails_deletes_every_put_and_commits_nothing(ledger_url, store, run_id):
    with Ledger.open(ledger_url) as holder, Ledger.open(ledger_url, busy_timeout=0.05) as ledger:
        producer = Producer(ledger, store, run_id=run_id)
        committed = put(store, "a")
        producer.commit([committed])
        with LocalFeatureStore() as elsewhere:
            refs = [put(elsewhere, "a"), put(elsewhere, "b")]
            late = Producer(ledger, elsewhere, run_id=run_id, producer_id="late")
            head = ledger.head_seq(run_id)
            with holder.write(run_id, "holding the run's lock"), pytest.raises(OperationalError):
                late.commit(refs)  # its wait for the lock runs out
            assert not any(elsewhere.exists(r) for r in refs)
        assert ledger.head_seq(run_id) == head
        assert store.exists(committed)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(st.sampled_from("abcde"), max_size=6), min_size=1, max_size=5))
def test_commits_agree_with_a_model_of_first_commits(ledger, batches):
    # A model: an id is committed by its first batch, as the last put of it in that
    # batch; every later put of it returns None. A fresh run per example.
    # Each batch puts into a store of its own, so no put supersedes committed features.
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as stores:
        seen: dict[str, SampleRef] = {}
        expected_log: list[str] = []
        for batch in batches:
            store = stores.enter_context(LocalFeatureStore())
            producer = Producer(ledger, store, run_id=run_id)
            refs = [put(store, s) for s in batch]
            last = {s: i for i, s in enumerate(batch)}
            want = [
                ref if s not in seen and last[s] == i else None
                for i, (s, ref) in enumerate(zip(batch, refs, strict=True))
            ]
            for s, i in last.items():
                if s not in seen:
                    seen[s] = refs[i]
                    expected_log.append(s)
            assert producer.commit(refs) == want
        assert [s for s, _, _ in commits(ledger, run_id)] == expected_log
        assert replay(ledger, run_id).committed == seen


@given(ref=sample_refs(), store=st.text(min_size=1, max_size=20), bare=st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_commit_payload_is_the_refs_own_json(ref, store, bare):
    ref = dataclasses.replace(ref, store=store, metadata={} if bare else ref.metadata)
    assert _producer._ref_json(ref) == ref.to_json()
