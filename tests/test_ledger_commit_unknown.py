"""A failed COMMIT may have landed: Producer.commit never deletes features it may have committed.

The database is real (a SQLite file, a throw-away PostgreSQL server); the fault is
injected at the driver's commit, the one place where a lost connection leaves the
outcome unknown: either after the database committed (it landed, the client got an
error anyway) or before (nothing landed).
"""

from __future__ import annotations

import pytest
import torch

from dataflow import (
    CommitOutcomeUnknownError,
    Kind,
    Ledger,
    OperationalError,
    Producer,
    SampleRef,
    replay,
)


def commits(ledger, run_id) -> list[tuple[str, int]]:
    return [(e.sample_id, e.revision) for e in ledger.events(run_id) if e.kind == Kind.COMMIT]


def put(store, *sample_ids: str) -> list[SampleRef]:
    return [store.put(s, {"x": torch.full((3,), float(i))}) for i, s in enumerate(sample_ids)]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_one_failed_commit_is_retried_and_the_refs_are_committed_once(
    ledger, store, producer, run_id, failing_commits, landed, caplog
):
    refs = put(store, "a", "b", "c")
    failing_commits(1, landed=landed)
    assert producer.commit(refs) == refs
    assert commits(ledger, run_id) == [("a", 0), ("b", 0), ("c", 0)]
    for ref in refs:
        assert torch.equal(store.get(ref)["x"], torch.full((3,), float(refs.index(ref))))
    assert "committing 3 refs once more" in caplog.text
    assert replay(ledger, run_id).committed == {r.sample_id: r for r in refs}


def test_a_retry_that_finds_some_ids_held_by_others_settles_only_those(
    ledger, store, producer, run_id, failing_commits
):
    (theirs,) = put(store, "held")
    assert producer.commit([theirs]) == [theirs]
    other = put(store, "new")
    failing_commits(1, landed=True)
    # "held" was committed before this call: a duplicate (None), "new" this call's own.
    assert producer.commit([*other, theirs]) == [*other, None]
    assert commits(ledger, run_id) == [("held", 0), ("new", 0)]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_when_the_retry_fails_too_the_features_stay_and_a_later_commit_settles(
    ledger, store, producer, run_id, failing_commits, landed
):
    refs = put(store, "a", "b")
    failing_commits(2, landed=landed)
    with pytest.raises(CommitOutcomeUnknownError, match="features of the 2 refs are kept") as got:
        producer.commit(refs)
    assert isinstance(got.value, OperationalError)
    for ref in refs:  # committed or not, nothing was deleted
        assert store.exists(ref)
    assert commits(ledger, run_id) == ([("a", 0), ("b", 0)] if landed else [])
    # Once the ledger answers, the same refs again: None for those already in.
    assert producer.commit(refs) == ([None, None] if landed else refs)
    assert commits(ledger, run_id) == [("a", 0), ("b", 0)]
    for ref in refs:
        assert store.exists(ref)
    assert replay(ledger, run_id).committed == {r.sample_id: r for r in refs}


def test_an_emit_whose_commit_stays_unknown_is_answered_by_the_ledger_on_the_next_emit(
    ledger, store, producer, run_id, failing_commits
):
    x = torch.arange(4.0)
    failing_commits(2, landed=True)
    with pytest.raises(CommitOutcomeUnknownError):
        producer.emit("s", {"x": x})
    assert producer.emit("s", {"x": x}) is None  # it had landed: not put or committed again
    (committed,) = replay(ledger, run_id).committed.values()
    assert torch.equal(store.get(committed)["x"], x)
    assert commits(ledger, run_id) == [("s", 0)]


def test_ledger_write_calls_a_failed_commit_unknown_and_a_failed_body_not(
    ledger, run_id, failing_commits
):
    failing_commits(1, landed=False)
    with (
        pytest.raises(CommitOutcomeUnknownError, match="while committing"),
        ledger.write(run_id, "test"),
    ):
        pass
    with pytest.raises(OperationalError) as got, ledger.write(run_id, "test"):
        raise OperationalError("the body failed")
    assert not isinstance(got.value, CommitOutcomeUnknownError)


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_a_retry_that_fails_keeps_the_features_an_unknown_commit_may_have_committed(
    ledger_url, store, run_id, monkeypatch, landed
):
    # The documented recovery from CommitOutcomeUnknownError is to commit the same refs
    # again; that retry failing in its turn (the ledger still busy) must not delete the
    # features of refs the first call did commit.
    with (
        Ledger.open(ledger_url) as holder,
        Ledger.open(ledger_url, busy_timeout=0.05) as ledger,
    ):
        producer = Producer(ledger, store, run_id=run_id)
        dialect = ledger._engine.dialect
        real, left = type(dialect).do_commit, [2]

        def do_commit(dbapi_connection) -> None:
            if left[0] <= 0:
                return real(dialect, dbapi_connection)
            left[0] -= 1
            if landed:
                real(dialect, dbapi_connection)
            raise dialect.dbapi.OperationalError("server closed the connection unexpectedly")

        monkeypatch.setattr(dialect, "do_commit", do_commit)
        refs = put(store, "a", "b")
        with pytest.raises(CommitOutcomeUnknownError):
            producer.commit(refs)
        fresh = put(store, "c")
        with holder.write(run_id, "holding the run's lock"), pytest.raises(OperationalError):
            producer.commit([*refs, *fresh])  # the retry: its wait for the lock runs out
        # What the ledger holds keeps its features; what it does not is deleted.
        assert [store.exists(r) for r in refs] == [landed, landed]
        assert not store.exists(fresh[0])
        assert commits(ledger, run_id) == ([("a", 0), ("b", 0)] if landed else [])
        if landed:
            assert producer.commit(refs) == [None, None]  # once it answers: already in
            assert replay(ledger, run_id).committed == {r.sample_id: r for r in refs}
            assert all(store.get(r)["x"].shape == (3,) for r in refs)
