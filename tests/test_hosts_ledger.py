"""Faults between producers, ranks and PostgreSQL, each on its own simulated host (#38).

One cluster per module (dataflow.testing.Cluster: a network namespace per host, a
bridge between them) with a PostgreSQL server on host ``pg``; every trial makes its
own database and runs real producer and rank processes on their hosts
(dataflow.testing._host_faults_ledger). The faults are real: a silent cut drops every
frame without FIN or RST, a loud one fails sends at once, a relay on the gateway
holds a reply the server sent after it committed. busy_timeout is 2 s, so the
dead-peer bound D is 2 s and a trial takes seconds.

Each outcome is read back from the ledger and the store: no sample lost or committed
(or trained) twice, no orphaned features, and replay(...).verify() clean.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import Kind, Ledger
from dataflow.testing import Cluster, cluster_unavailable
from dataflow.testing._host_faults_ledger import (
    RUN,
    LedgerFaultOutcome,
    postgres_restart,
    producer_cut_at_random,
    producer_reply_lost,
    rank_cut,
    rank_fenced_after_cut,
)
from tests.conftest import unavailable

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Any]:
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)  # a skip, but a failure under CI=true
    with Cluster(workdir=tmp_path_factory.mktemp("cluster")) as started:
        started.start()
        yield started


@pytest.fixture(scope="module")
def server(cluster) -> Any:
    return cluster.start_postgres()


def assert_clean(outcome: LedgerFaultOutcome) -> None:
    assert outcome.clean, outcome
    assert outcome.lost == outcome.duplicated == outcome.orphans == 0, outcome


# -- a producer cut off mid-commit ----------------------------------------------------------
def test_a_commit_whose_reply_is_lost_and_whose_link_dies_is_settled_from_the_ledger(
    cluster, server
) -> None:
    outcome = producer_reply_lost(cluster, server, after="cut")
    assert_clean(outcome)
    during, retry = outcome.results["during"], outcome.results["retry"]
    # The server committed; the producer could not learn it: it says so, keeps the features.
    assert during["error"] == "CommitOutcomeUnknownError", outcome
    assert "features" in during["message"] and "kept" in during["message"], outcome
    assert retry == {"ok": True, "result": [None], "at": retry["at"]}, outcome  # already in
    assert outcome.results["after"]["result"] == ["s-2"], outcome


def test_a_commit_whose_reply_is_lost_to_a_reset_is_settled_by_the_producers_own_retry(
    cluster, server
) -> None:
    outcome = producer_reply_lost(cluster, server, after="reset")
    assert_clean(outcome)
    assert outcome.results["during"]["result"] == ["s-1"], outcome  # counted as this emit's
    assert outcome.results["after"]["result"] == ["s-2"], outcome


def test_a_commit_whose_reply_is_held_for_less_than_the_timeouts_returns(cluster, server) -> None:
    outcome = producer_reply_lost(cluster, server, after="short")
    assert_clean(outcome)
    assert outcome.seen == (), outcome
    assert outcome.results["during"]["result"] == ["s-1"], outcome


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**16), silent=st.booleans(), long=st.booleans())
def test_emits_cut_off_at_random_moments_are_each_committed_once(
    cluster, server, seed: int, silent: bool, long: bool
) -> None:
    outcome = producer_cut_at_random(cluster, server, seed=seed, silent=silent, long=long)
    assert_clean(outcome)
    assert outcome.results["ok"], outcome  # every failed emit went through once retried
    for error in outcome.seen:
        assert error in ("OperationalError", "CommitOutcomeUnknownError"), outcome


# -- a rank cut off mid-lease and mid-ack ---------------------------------------------------
@pytest.mark.parametrize("during", ["lease", "ack"])
def test_a_rank_cut_off_for_less_than_its_timeouts_does_not_notice(
    cluster, server, during: str
) -> None:
    outcome = rank_cut(cluster, server, during=during, long=False)
    assert_clean(outcome)
    assert outcome.seen == (), outcome
    assert outcome.results["rest"]["stuck"] is None, outcome


@pytest.mark.parametrize("during", ["lease", "ack"])
def test_a_rank_cut_off_for_longer_than_its_timeouts_is_told_and_its_retry_goes_through(
    cluster, server, during: str
) -> None:
    outcome = rank_cut(cluster, server, during=during, long=True)
    assert_clean(outcome)
    during_answer = outcome.results["during"]
    assert during_answer["error"] in ("CommitOutcomeUnknownError", "OperationalError"), outcome
    assert "retry" in during_answer["message"] or "read it back" in during_answer["message"]
    assert "ok" in outcome.results["retry"], outcome
    assert outcome.results["rest"]["stuck"] is None, outcome


@pytest.mark.parametrize("during", ["lease", "ack"])
def test_a_rank_whose_committed_write_lost_its_reply_retries_without_loss_or_a_second_ack(
    cluster, server, during: str
) -> None:
    outcome = rank_cut(cluster, server, during=during, long=True, reply_lost=True)
    assert_clean(outcome)
    assert outcome.results["during"]["error"] == "CommitOutcomeUnknownError", outcome
    assert "ok" in outcome.results["retry"], outcome
    assert outcome.results["rest"]["stuck"] is None, outcome


def test_a_rank_that_comes_back_after_it_was_fenced_writes_nothing(cluster, server) -> None:
    outcome = rank_fenced_after_cut(cluster, server)
    assert_clean(outcome)
    assert outcome.results["ack"]["error"] == "StaleEpochError", outcome
    assert outcome.results["lease"]["error"] == "StaleEpochError", outcome
    assert "stop" in outcome.results["ack"]["message"], outcome


# -- the PostgreSQL host restarted ----------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_run_rides_out_a_restart_of_the_postgres_host(cluster, server, how: str) -> None:
    outcome = postgres_restart(cluster, server, how=how)
    assert_clean(outcome)
    assert outcome.results["producer"]["ok"], outcome
    assert outcome.results["rest"]["stuck"] is None, outcome
    for error in outcome.seen:
        assert error in ("OperationalError", "CommitOutcomeUnknownError"), outcome


def test_the_ledger_of_a_trial_holds_what_its_outcome_says(cluster, server) -> None:
    """The outcome is read from the ledger: one reply-lost trial, checked row by row."""
    outcome = producer_reply_lost(cluster, server, after="cut")
    url = outcome.results["url"]
    with Ledger.open(url) as ledger:
        commits = [e.sample_id for e in ledger.events(RUN) if e.kind == Kind.COMMIT]
    assert sorted(commits) == ["s-0", "s-1", "s-2"]
