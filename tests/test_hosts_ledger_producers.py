"""A producer cut off from PostgreSQL mid-commit, on its own simulated host (#38).

Whatever the moment and the kind of cut, every sample is committed exactly once,
the features of a landed commit are kept, and nothing is orphaned.

How the trials run (one cluster per module, real processes on their hosts, real
cuts, busy_timeout 2 s): tests/_hosts_ledger.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dataflow import Kind, Ledger
from dataflow.testing._host_faults_ledger import (
    RUN,
    producer_cut_at_random,
    producer_replaced_after_cut,
    producer_reply_lost,
)
from tests._hosts_ledger import assert_clean, started_cluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Any]:
    yield from started_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def server(cluster) -> Any:
    return cluster.start_postgres()


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
    with Ledger.open(outcome.results["url"]) as ledger:  # the ledger itself, row by row
        commits = [e.sample_id for e in ledger.events(RUN) if e.kind == Kind.COMMIT]
    assert sorted(commits) == ["s-0", "s-1", "s-2"]


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


def test_a_producer_replaced_while_cut_off_writes_nothing_once_healed(cluster, server) -> None:
    outcome = producer_replaced_after_cut(cluster, server)
    assert_clean(outcome)  # s-3's features, put by the fenced one, deleted again
    assert outcome.results["during"]["error"] in ("OperationalError", "CommitOutcomeUnknownError")
    assert outcome.results["new"]["result"] == ["s-1", "s-2"], outcome
    for late in ("again", "fresh", "close"):
        assert outcome.results[late]["error"] == "ProducerFencedError", outcome
        assert "another process took the id" in outcome.results[late]["message"], outcome


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(dead_peers=st.floats(0.1, 3.0))
def test_a_commit_whose_reply_is_lost_for_any_time_is_committed_once_with_its_features(
    cluster, server, dead_peers: float
) -> None:
    """The link cut for 0.1 to 3 dead-peer bounds D after the server committed: the held
    reply arrives, or the emit fails and its retry (its own, or emitting again) settles it
    from the ledger; around D the two race, and either way one commit, features kept."""
    outcome = producer_reply_lost(cluster, server, cut_s=2.0 * dead_peers)  # D = 2 s
    assert_clean(outcome)
    last = outcome.results.get("retry", outcome.results["during"])
    assert last["result"] in (["s-1"], [None]), outcome
    assert outcome.results["after"]["result"] == ["s-2"], outcome


# Each kind of cut (silent or loud, shorter or longer than D) once for sure, at spread
# moments and lengths (seed: 0.02-0.52 s in, 0.1-0.35 D or 1.9-2.3 D), and two drawn.
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**16), silent=st.booleans(), long=st.booleans())
@example(seed=65535, silent=True, long=True)
@example(seed=12345, silent=True, long=False)
@example(seed=4242, silent=False, long=True)
@example(seed=1, silent=False, long=False)
def test_emits_cut_off_at_random_moments_are_each_committed_once(
    cluster, server, seed: int, silent: bool, long: bool
) -> None:
    outcome = producer_cut_at_random(cluster, server, seed=seed, silent=silent, long=long)
    assert_clean(outcome)
    assert outcome.results["ok"], outcome  # every failed emit went through once retried
    for error in outcome.seen:
        assert error in ("OperationalError", "CommitOutcomeUnknownError"), outcome
