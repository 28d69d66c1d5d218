"""The property harness (dataflow.testing) on SQLite and on a real PostgreSQL server.

DATAFLOW_PROFILE=thorough runs 2000 examples per backend; the default runs 200 on
SQLite and 40 on PostgreSQL, whose round trips make each example about twice as slow.
The fold under test is the same on both and gets its 200 runs on SQLite; what is
PostgreSQL's own (its locking and SQL) is exercised by every step of every example,
and 40 examples of up to 40 steps each cover it.
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
        # 40, not 200: see the module docstring (the fold's own runs are on SQLite).
        overrides = {} if PROFILE == "thorough" else {"max_examples": 40}
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
