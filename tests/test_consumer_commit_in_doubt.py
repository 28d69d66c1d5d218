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


@pytest.fixture
def unreadable(monkeypatch):
    """``unreadable(consumer, reads=2)``: its reads of the ledger after a failed COMMIT (the
    refold and the read-back: two) raise OperationalError, as on a link that just died."""

    def make(consumer, reads: int = 2) -> None:
        view = consumer._view
        real = {name: getattr(view, name) for name in ("catch_up", "refold")}
        left = {"reads": reads}

        def failing(name):
            def read(*args, **kwargs):
                if view.stale and left["reads"] > 0:
                    left["reads"] -= 1
                    raise OperationalError("the ledger is unreachable (injected)")
                return real[name](*args, **kwargs)

            return read

        for name in real:
            monkeypatch.setattr(view, name, failing(name))

    return make


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


def test_an_ack_and_lease_that_landed_unseen_is_settled_by_its_retry(
    ledger, run_id, emit, make_consumer, failing_commits, unreadable
):
    consumer = make_consumer()
    consumer.resume()
    emit("a", "b", "c", "d")
    refs = consumer.lease(2)
    failing_commits(1, landed=True)
    unreadable(consumer)
    with pytest.raises(CommitOutcomeUnknownError):
        consumer.ack_and_lease([(refs, 1)], 2)
    assert [r.sample_id for r in consumer.ack_and_lease([(refs, 1)], 2)] == ["c", "d"]
    assert kinds(ledger, run_id, Kind.ACK) == ["a", "b"]
    assert kinds(ledger, run_id, Kind.LEASE) == ["a", "b", "c", "d"]
    assert replay(ledger, run_id).verify() == []
