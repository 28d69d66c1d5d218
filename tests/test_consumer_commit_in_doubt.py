"""A consumer write whose COMMIT failed while the ledger could not be read back either.

Across machines this is a link that dies right after the COMMIT went out: the server
may have committed, and the rank's read-back cannot reach it. The call raises
CommitOutcomeUnknownError; the retry the error asks for must settle it from the
ledger: a lease that landed is handed out by the next lease (not stranded, leased to a
rank that never got the refs), and the same ack made again returns instead of raising
"not leased" (and writes no second ack). tests/test_hosts_ledger_ranks.py does the same
with real cuts on simulated hosts; here the fault is injected at the driver's commit
and at the consumer's read-back, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import pytest

from dataflow import CommitOutcomeUnknownError, Kind, LedgerStateError, OperationalError, replay


def kinds(ledger, run_id, kind: Kind) -> list[str]:
    return [sid for e in ledger.events(run_id) if e.kind == kind for sid in e.sample_ids or ()]


def test_a_lease_that_landed_unseen_is_handed_out_by_the_next_lease(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c")
    failing_commits(1, landed=True)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError) as raised:
        consumer.lease(2)
    # What to do is said with the error (a note: its message is the ledger's).
    assert any("make the same call again" in note for note in raised.value.__notes__)
    assert [r.sample_id for r in consumer.lease(2)] == ["a", "b"]  # the retry gets them
    assert [r.sample_id for r in consumer.lease(2)] == ["c"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b", "c"]  # each leased once
    consumer.ack(["a", "b", "c"], step=1)
    assert replay(ledger, run_id).verify() == []


def test_a_lease_rolled_back_unseen_leases_the_same_samples_again(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c")
    failing_commits(1, landed=False)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.lease(2)
    assert [r.sample_id for r in consumer.lease(2)] == ["a", "b"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b"]
    assert replay(ledger, run_id).verify() == []


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_the_same_ack_made_again_settles_an_ack_whose_outcome_was_unseen(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable, landed
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    refs = consumer.lease(2)
    failing_commits(1, landed=landed)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.ack(refs, step=1)
    consumer.ack(refs, step=1)  # the retry: it returns, landed or not
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]  # one ack each
    state = replay(ledger, run_id)
    assert state.verify() == []
    assert set(state.trained) == {"a", "b"}


def test_an_ack_retried_while_the_ledger_is_still_away_stays_in_doubt_until_it_answers(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    refs = consumer.lease(2)
    failing_commits(1, landed=True)
    unreadable(consumer, reads=3)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.ack(refs, step=1)
    with pytest.raises(OperationalError, match="unreachable"):
        consumer.ack(refs, step=1)  # too early: the ledger still cannot say
    consumer.ack(refs, step=1)  # it answers: the ack had landed
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]
    assert replay(ledger, run_id).verify() == []


def test_only_the_same_ack_is_settled_another_is_checked_as_ever(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b")
    refs = consumer.lease(2)
    failing_commits(1, landed=True)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.ack(refs, step=1)
    with pytest.raises(LedgerStateError, match="not leased"):
        consumer.ack(refs[:1], step=2)  # not the write in doubt: a second ack of 'a'
    with pytest.raises(LedgerStateError, match="not leased"):
        consumer.ack(refs, step=1)  # asked once: the doubt was settled by the call before
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]


def _ack_and_lease_in_doubt(consumer, emit, failing_commits, unreadable, *, landed: bool):
    """Of a, b, c, d: a and b leased, then an ack_and_lease of them and a lease of two whose
    COMMIT failed (after the database committed, or instead) and could not be read back.
    The refs of a and b."""
    consumer.resume()
    emit("a", "b", "c", "d")
    refs = consumer.lease(2)
    failing_commits(1, landed=landed)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.ack_and_lease([(refs, 1)], 2)
    return refs


def _settled_by_the_same_call(ledger, run_id, consumer, refs) -> None:
    """The ack_and_lease of a and b made again: a and b acked once, c and d leased once."""
    again = consumer.ack_and_lease([(refs, 1)], 2)
    assert [r.sample_id for r in again] == ["c", "d"]
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b", "c", "d"]
    consumer.ack(again, step=2)
    assert replay(ledger, run_id).verify() == []


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "rolled-back"])
def test_an_ack_and_lease_in_doubt_is_settled_by_its_retry(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable, landed
):
    consumer = make_consumer()
    refs = _ack_and_lease_in_doubt(consumer, emit, failing_commits, unreadable, landed=landed)
    _settled_by_the_same_call(ledger, run_id, consumer, refs)


@pytest.mark.parametrize("write", ["lease", "ack_and_lease"])
def test_samples_a_rolled_back_lease_left_reclaimed_are_handed_out_once_when_leased_again(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable, write
):
    """A lease in doubt that had rolled back leaves its samples reclaimed (had it landed,
    the next lease would hand them out). Leased afresh by the retry, they are no longer
    reclaimed: the lease after hands out the next samples, not the same ones again."""
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c", "d", "e", "f")
    held = consumer.lease(2)
    failing_commits(1, landed=False)
    unreadable(consumer)
    if write == "lease":
        with pytest.raises(CommitOutcomeUnknownError):
            consumer.lease(2)
        first, second = consumer.lease(2), consumer.lease(2)
    else:
        with pytest.raises(CommitOutcomeUnknownError):
            consumer.ack_and_lease([(held, 1)], 2)
        first = consumer.ack_and_lease([(held, 1)], 2)
        second = consumer.ack_and_lease([(first, 2)], 2)
    assert [r.sample_id for r in first] == ["c", "d"]
    assert [r.sample_id for r in second] == ["e", "f"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b", "c", "d", "e", "f"]


def test_an_ack_and_lease_whose_lease_failed_after_its_acks_is_made_again_as_it_was(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable, monkeypatch
):
    """Settling a write in doubt, ack_and_lease writes the acks (ack_many), then leases; if
    that lease fails, the same call made again finds the acks landed (not "not leased")
    and leases."""
    consumer = make_consumer()
    refs = _ack_and_lease_in_doubt(consumer, emit, failing_commits, unreadable, landed=True)
    real, failures = consumer.lease, [OperationalError("the ledger is unreachable (injected)")]

    def lease(*args, **kwargs):
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(consumer, "lease", lease)
    with pytest.raises(OperationalError, match="injected"):
        consumer.ack_and_lease([(refs, 1)], 2)  # the acks settled, then its lease failed
    _settled_by_the_same_call(ledger, run_id, consumer, refs)


@pytest.mark.parametrize("write", ["nack", "lost"])
def test_the_same_nack_or_lost_report_made_again_settles_one_that_landed_unseen(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable, write
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c")
    refs = consumer.lease(2)
    give_back = (
        (lambda: consumer.nack(refs, reason="a failed step"))
        if write == "nack"
        else (lambda: consumer.lost(refs, reason="features gone"))
    )
    failing_commits(1, landed=True)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        give_back()
    give_back()  # the same call: settled from the ledger, nothing written twice
    kind = Kind.NACK if write == "nack" else Kind.LOST
    assert kinds(ledger, run_id, kind) == ["a", "b"]
    with pytest.raises(LedgerStateError, match="not leased"):
        give_back()  # asked once: the doubt was settled by the call before
