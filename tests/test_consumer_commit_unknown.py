"""A consumer write whose COMMIT fails leaves the consumer's fold equal to the ledger's.

Inside its transaction a consumer folds what it appended (the resume reads its own
plan, a checkpoint its releases); a COMMIT that then fails either rolled all of it
back or landed it without telling. Either way the consumer's state must agree with
a replay of the ledger afterwards: a fold that kept rolled-back events would skip
the events that later take their sequence numbers (another producer's commits,
never leased by this rank). A lease or an ack whose COMMIT landed unannounced is
settled by reading the ledger: the lease returns its refs, the ack returns.

Real SQLite files and a real PostgreSQL server; the fault is injected at the
driver's commit, as in tests/test_ledger_commit_unknown.py.
"""

from __future__ import annotations

import pytest

from dataflow import CommitOutcomeUnknownError, Kind, OperationalError, replay


def assert_agrees(consumer, ledger, run_id) -> None:
    consumer._catch_up()
    assert consumer.state.snapshot() == replay(ledger, run_id).snapshot()


def kinds(ledger, run_id, kind: Kind) -> list[str | None]:
    """The samples the rows of ``kind`` name, a batch row's each (None: a row of none)."""
    return [sid for e in ledger.events(run_id) if e.kind == kind for sid in e.sample_ids or [None]]


def test_a_lease_rolled_back_leaves_no_phantom_and_later_commits_are_leased(
    ledger, run_id, emit, make_consumer, failing_commits
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    failing_commits(1, landed=False)
    with pytest.raises(CommitOutcomeUnknownError) as got:
        consumer.lease(2)
    assert isinstance(got.value, OperationalError)
    assert kinds(ledger, run_id, Kind.LEASE) == []
    # Another writer's events take the sequence numbers the rolled-back lease had.
    emit("c", "d")
    leased = [r.sample_id for r in consumer.lease(10)]
    assert leased == ["a", "b", "c", "d"]
    assert kinds(ledger, run_id, Kind.LEASE) == leased
    assert_agrees(consumer, ledger, run_id)


def test_a_lease_that_landed_unannounced_returns_its_refs(
    ledger, run_id, emit, make_consumer, failing_commits
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c")
    failing_commits(1, landed=True)
    assert [r.sample_id for r in consumer.lease(2)] == ["a", "b"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b"]
    assert [r.sample_id for r in consumer.lease(2)] == ["c"]
    assert_agrees(consumer, ledger, run_id)


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_an_ack_whose_commit_failed_is_settled_by_the_ledger(
    ledger, run_id, emit, make_consumer, failing_commits, landed
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    refs = consumer.lease(2)
    failing_commits(1, landed=landed)
    if landed:
        consumer.ack(refs, step=1)  # it is in the ledger: the ack returns
    else:
        with pytest.raises(CommitOutcomeUnknownError):
            consumer.ack(refs, step=1)
        assert kinds(ledger, run_id, Kind.ACK) == []
        consumer.ack(refs, step=1)  # still leased: the caller's retry goes through
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]
    assert_agrees(consumer, ledger, run_id)
    assert consumer.lease(2) == []


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_an_ack_and_lease_whose_commit_failed_is_settled_by_the_ledger(
    ledger, run_id, emit, make_consumer, failing_commits, landed
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c", "d")
    refs = consumer.lease(2)
    failing_commits(1, landed=landed)
    if landed:  # both are in the ledger: the call returns the leased refs
        assert [r.sample_id for r in consumer.ack_and_lease([(refs, 1)], 2)] == ["c", "d"]
    else:
        with pytest.raises(CommitOutcomeUnknownError):
            consumer.ack_and_lease([(refs, 1)], 2)
        assert kinds(ledger, run_id, Kind.ACK) == []
        assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b"]
        assert [r.sample_id for r in consumer.ack_and_lease([(refs, 1)], 2)] == ["c", "d"]
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b", "c", "d"]
    assert_agrees(consumer, ledger, run_id)


def test_a_checkpoint_rolled_back_is_not_in_the_fold_and_is_recorded_again(
    ledger, run_id, emit, make_consumer, failing_commits, tmp_path
):
    consumer = make_consumer()
    consumer.resume()
    emit("a")
    consumer.ack(consumer.lease(1), step=1)
    failing_commits(1, landed=False)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.checkpoint(1, tmp_path)
    assert_agrees(consumer, ledger, run_id)
    assert replay(ledger, run_id).checkpoints == []
    consumer.checkpoint(1, tmp_path)
    assert [c.step for c in replay(ledger, run_id).checkpoints] == [1]
    assert_agrees(consumer, ledger, run_id)


def test_a_resume_rolled_back_starts_no_epoch(ledger, run_id, emit, make_consumer, failing_commits):
    emit("a", "b")
    consumer = make_consumer()
    failing_commits(1, landed=False)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.resume()
    assert kinds(ledger, run_id, Kind.RESUME) == []
    consumer.resume()
    assert [r.sample_id for r in consumer.lease(5)] == ["a", "b"]
    assert_agrees(consumer, ledger, run_id)


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
@pytest.mark.parametrize("verb", ["nack", "lost"])
def test_a_nack_or_lost_whose_commit_failed_is_settled_by_the_ledger(
    ledger, run_id, emit, make_consumer, failing_commits, landed, verb
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    refs = consumer.lease(2)

    def settle() -> None:
        if verb == "nack":
            consumer.nack(refs, reason="step failed")
        else:
            consumer.lost(refs, reason="features gone")

    failing_commits(1, landed=landed)
    if not landed:
        with pytest.raises(CommitOutcomeUnknownError):
            settle()
        assert kinds(ledger, run_id, Kind.NACK if verb == "nack" else Kind.LOST) == []
    settle()  # landed: it returns; not landed: still leased, the caller's retry goes through
    assert kinds(ledger, run_id, Kind.NACK if verb == "nack" else Kind.LOST) == ["a", "b"]
    assert_agrees(consumer, ledger, run_id)
    state = replay(ledger, run_id)
    assert set(state.lost if verb == "lost" else state.pending) == {"a", "b"}
