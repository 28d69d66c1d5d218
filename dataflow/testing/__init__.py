"""Test support that users run on their own set-ups.

* Hypothesis strategies for ids, tensors and refs (:func:`sample_ids`,
  :func:`tensors`, :func:`feature_dicts`, :func:`sample_refs`).
* :func:`run_ledger_machine`: a rule-based state machine that drives producers
  and consumers through crashes, resumes from random checkpoints, duplicate
  emits and stale-epoch writes against your ledger and store, and checks the
  ledger's invariants after every step.
* :class:`PostgresServer`: a throw-away PostgreSQL cluster for tests.
* :class:`Cluster`: machines simulated on one machine (a network namespace per
  :class:`Host`), with silent and loud network cuts, skewed clocks, and
  :class:`Relay` s that delay, stall or reset TCP connections (root only; see
  :func:`cluster_unavailable`).

Needs the ``test`` extra (hypothesis).
"""

from dataflow.testing._cluster import DEFAULT_HOSTS, Cluster, Host
from dataflow.testing._machine import PROFILES, LedgerMachine, machine_settings, run_ledger_machine
from dataflow.testing._netns import ClusterError, cluster_unavailable
from dataflow.testing._postgres import PostgresServer, postgres_url_from_env
from dataflow.testing._relay import Relay
from dataflow.testing._strategies import (
    DTYPES,
    feature_dicts,
    invalid_sample_ids,
    json_values,
    sample_ids,
    sample_refs,
    tensors,
)

__all__ = [
    "Cluster",
    "ClusterError",
    "DEFAULT_HOSTS",
    "DTYPES",
    "Host",
    "LedgerMachine",
    "PROFILES",
    "PostgresServer",
    "Relay",
    "cluster_unavailable",
    "feature_dicts",
    "invalid_sample_ids",
    "json_values",
    "machine_settings",
    "postgres_url_from_env",
    "run_ledger_machine",
    "sample_ids",
    "sample_refs",
    "tensors",
]
