"""Ranks cut off from PostgreSQL mid-lease and mid-ack, and the PostgreSQL host
restarted mid-run, each component on its own simulated host (#38).

A rank sees either nothing (a cut shorter than its timeouts) or an error that says
what to do, and its retry goes through; nothing is lost or trained twice; a rank
fenced off while it was away writes nothing when it comes back.

How the trials run (one cluster per module, real processes on their hosts, real
cuts, busy_timeout 2 s): tests/_hosts_ledger.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dataflow.testing._host_faults_ledger import (
    postgres_restart,
    rank_cut,
    rank_cut_at_random,
    rank_fenced_after_cut,
)
from tests._hosts_ledger import assert_clean, started_cluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Any]:
    yield from started_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def server(cluster) -> Any:
    return cluster.start_postgres()


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
    assert any("make the same call again" in n for n in outcome.results["during"]["notes"])
    assert "ok" in outcome.results["retry"], outcome
    assert outcome.results["rest"]["stuck"] is None, outcome


# Each kind of cut (silent or loud, shorter or longer than D) once for sure, at spread
# moments and lengths (seed: 0.02-0.52 s in, 0.1-0.35 D or 1.9-2.3 D), and one drawn.
@settings(
    max_examples=1,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**16), silent=st.booleans(), long=st.booleans())
@example(seed=65535, silent=True, long=True)
@example(seed=12345, silent=True, long=False)
@example(seed=4242, silent=False, long=True)
@example(seed=1, silent=False, long=False)
def test_a_rank_cut_off_at_random_moments_trains_every_sample_once(
    cluster, server, seed: int, silent: bool, long: bool
) -> None:
    outcome = rank_cut_at_random(cluster, server, seed=seed, silent=silent, long=long)
    assert_clean(outcome)  # every sample trained, none twice
    assert outcome.results["ok"], outcome  # every failed call went through, made again
    for error in outcome.seen:
        assert error in ("OperationalError", "CommitOutcomeUnknownError"), outcome


def test_a_rank_that_comes_back_after_it_was_fenced_writes_nothing(cluster, server) -> None:
    outcome = rank_fenced_after_cut(cluster, server)
    assert_clean(outcome)
    assert outcome.results["ack"]["error"] == "StaleEpochError", outcome
    assert outcome.results["lease"]["error"] == "StaleEpochError", outcome
    assert "stop" in outcome.results["ack"]["message"], outcome


# -- the PostgreSQL host restarted ----------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill", "reboot"])
def test_a_run_rides_out_a_restart_of_the_postgres_host(cluster, server, how: str) -> None:
    outcome = postgres_restart(cluster, server, how=how)
    assert_clean(outcome)
    assert outcome.results["producer"]["ok"], outcome  # each failed call went through, retried
    assert outcome.results["rank"]["ok"], outcome
    assert "ok" in outcome.results["close"], outcome
    for error in outcome.seen:
        assert error in ("OperationalError", "CommitOutcomeUnknownError"), outcome
