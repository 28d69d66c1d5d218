"""The property harness (dataflow.testing) on SQLite and on a real PostgreSQL server.

DATAFLOW_PROFILE=thorough runs 2000 examples per backend; the default runs 200 on
SQLite and 100 on PostgreSQL, whose round trips make each example about twice as slow
(the fold under test is the same; the backend's own locking and SQL get 100 runs).
"""

from __future__ import annotations

import os

import pytest

from dataflow import Ledger
from dataflow.testing import run_ledger_machine
from stores import LocalFeatureStore

PROFILE = os.environ.get("DATAFLOW_PROFILE", "normal")


def test_state_machine_on_sqlite(sqlite_url: str) -> None:
    ledger = Ledger.open(sqlite_url, durability="normal")
    try:
        run_ledger_machine(ledger, LocalFeatureStore, profile=PROFILE)
    finally:
        ledger.close()


@pytest.mark.postgres
def test_state_machine_on_postgres(postgres_url: str) -> None:
    ledger = Ledger.open(postgres_url, durability="normal")
    try:
        overrides = {} if PROFILE == "thorough" else {"max_examples": 60}
        run_ledger_machine(ledger, LocalFeatureStore, profile=PROFILE, **overrides)
    finally:
        ledger.close()


def test_profiles_are_documented_sizes() -> None:
    from dataflow.testing import PROFILES, machine_settings

    assert PROFILES == {"normal": 200, "thorough": 2000}
    assert machine_settings("normal").max_examples == 200
    assert machine_settings("thorough").max_examples == 2000
    with pytest.raises(ValueError, match="profile"):
        machine_settings("fast")
