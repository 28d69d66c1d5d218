"""A whole run with 100 ms (+/- 20 ms) on every link, and stalls and resets (issue #38).

A producer on its host streams with CURVE to two gloo ranks on theirs; all three reach
PostgreSQL on its host, the producer each rank, and all of them the Mooncake master's
RPC and metadata ports on its host, through relays that delay every chunk 100 ms +/-
20 ms one way and that stall (0.2-1 s) or reset at seeded random moments (gloo and
Mooncake's transfers between peers go direct: a relay cannot carry them). The run
finishes: nothing lost or trained twice, verify() clean, no orphan after `dataflow gc`.
Needs root (network namespaces), PostgreSQL and Mooncake: skipped elsewhere, failed
under CI=true.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataflow.testing import Cluster, cluster_unavailable
from dataflow.testing._host_faults_services import latency_run
from dataflow.testing._postgres import find_bin_dir
from tests._host_zygotes import warm_cluster
from tests.conftest import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture(scope="module")
def cluster(mooncake_installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)
    try:
        find_bin_dir()
    except RuntimeError as exc:
        unavailable(str(exc))
    hosts = ["pg", "master", "producer0", "trainer0", "trainer1"]
    with warm_cluster(hosts, workdir=tmp_path_factory.mktemp("hosts")) as cluster:
        yield cluster


@pytest.mark.parametrize("seed", [0])
def test_a_run_with_latency_stalls_and_resets_on_every_link_loses_nothing(
    cluster: Cluster, seed: int
) -> None:
    outcome = latency_run(cluster, seed=seed, master_host="master")
    assert outcome.facts["exits"] == [0, 0, 0], outcome.detail
    assert outcome.facts["injected"], outcome.detail  # the faults came during the run
    assert outcome.committed == 16
    assert (outcome.lost, outcome.duplicated, outcome.orphans) == (0, 0, 0), outcome.detail
    assert outcome.violations == ()
