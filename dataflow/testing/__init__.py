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

The strategies and the state machine need the ``test`` extra (hypothesis) and torch,
both imported on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dataflow.testing._cluster import DEFAULT_HOSTS, Cluster, Host
from dataflow.testing._netns import ClusterError, cluster_unavailable
from dataflow.testing._postgres import PostgresServer, postgres_url_from_env
from dataflow.testing._relay import Relay

if TYPE_CHECKING:
    from dataflow.testing._machine import (
        PROFILES,
        LedgerMachine,
        machine_settings,
        run_ledger_machine,
    )
    from dataflow.testing._strategies import (
        DTYPES,
        feature_dicts,
        invalid_sample_ids,
        json_values,
        sample_ids,
        sample_refs,
        tensors,
    )

# Names whose modules import torch and hypothesis: loaded on first use, so that a process
# that only needs the cluster or a PostgresServer (a ledger actor inside a simulated host,
# a chaos trial's PostgreSQL) pays for neither (torch alone costs a second of CPU).
_LAZY = {
    **dict.fromkeys(
        ("LedgerMachine", "PROFILES", "machine_settings", "run_ledger_machine"),
        "dataflow.testing._machine",
    ),
    **dict.fromkeys(
        (
            "DTYPES",
            "feature_dicts",
            "invalid_sample_ids",
            "json_values",
            "sample_ids",
            "sample_refs",
            "tensors",
        ),
        "dataflow.testing._strategies",
    ),
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
