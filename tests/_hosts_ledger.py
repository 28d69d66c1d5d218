"""The cluster the ledger fault tests share (one per module): six hosts and a PostgreSQL
server on host ``pg``; and what every outcome of theirs must show.

One cluster per module (dataflow.testing.Cluster: a network namespace per host, a
bridge between them) with a PostgreSQL server on host ``pg``; every trial makes its
own database and runs real producer and rank processes on their hosts
(dataflow.testing._host_faults_ledger). The faults are real: a silent cut drops every
frame without FIN or RST, a loud one fails sends at once, a relay on the gateway
holds a reply the server sent after it committed. busy_timeout is 2 s, so the
dead-peer bound D is 2 s and a trial takes seconds. Each outcome is read back from
the ledger and the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dataflow.testing import cluster_unavailable
from dataflow.testing._host_faults_ledger import LedgerFaultOutcome
from tests._host_zygotes import warm_cluster
from tests.conftest import unavailable


def started_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """For a module's ``cluster`` fixture: a started Cluster, stopped after the module.
    Skipped without the privileges for network namespaces, failed so under CI=true."""
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)
    # The actors fork from a warm interpreter on their host: not 1.4 s of CPU each.
    with warm_cluster(workdir=tmp_path_factory.mktemp("cluster")) as started:
        yield started


def assert_clean(outcome: LedgerFaultOutcome) -> None:
    """Nothing lost, committed or trained twice, or orphaned; replay(...).verify() clean."""
    assert outcome.lost == outcome.duplicated == outcome.orphans == 0, outcome
    assert outcome.problems == (), outcome
