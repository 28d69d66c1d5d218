"""A ZeroMQ stream link between two simulated hosts partitioned and healed (issue #38).

The producer on its host streams with CURVE to a rank's receiver bound on the trainer
host's address; their link is cut silently (frames vanish) or loudly (sends fail at
once), shorter than the stream's heartbeat timeout, longer, or until the producer has
closed. Every committed sample is trained once: what the cut swallowed or the receiver
dropped is taken from the ledger. One cluster serves the module; needs root (network
namespaces): skipped elsewhere, failed under CI=true.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataflow.testing import Cluster, cluster_unavailable
from dataflow.testing._host_faults_net import HEARTBEATS, stream_partition
from tests._host_zygotes import warm_cluster
from tests.conftest import unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)
    hosts = ["producer0", "trainer0"]
    with warm_cluster(hosts, workdir=tmp_path_factory.mktemp("hosts")) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("silent", "cut_s"),
    [(True, 0.5), (False, 3.0), (True, None)],
    ids=["silent-shorter-than-the-heartbeat-timeout", "loud-3s", "silent-until-closed"],
)
def test_a_partitioned_stream_link_heals_and_loses_nothing(
    cluster: Cluster, silent: bool, cut_s: float | None
) -> None:
    outcome = stream_partition(cluster, silent=silent, cut_s=cut_s)
    assert outcome.errors == (), outcome.detail
    assert outcome.facts["exits"] == [0, 0], outcome.detail
    assert outcome.committed == 40
    assert (outcome.lost, outcome.duplicated, outcome.orphans) == (0, 0, 0), outcome.detail
    assert outcome.violations == ()
    if cut_s is None or cut_s > HEARTBEATS["heartbeat_timeout"]:
        # Longer than the heartbeat timeout: the rank saw the producer lost, and went on.
        assert outcome.facts["producer_lost"] >= 1, outcome.detail
