"""The property harness with every built-in store: the ledger's invariants hold
with real shared-directory files and with a real Mooncake master."""

from __future__ import annotations

import itertools
import uuid

from dataflow import Ledger
from dataflow.testing import run_ledger_machine
from stores import MooncakeFeatureStore, SharedDirFeatureStore


def test_state_machine_with_shared_dir_store(sqlite_url, tmp_path) -> None:
    counter = itertools.count()
    ledger = Ledger.open(sqlite_url, durability="normal")
    try:
        run_ledger_machine(
            ledger,
            lambda: SharedDirFeatureStore(tmp_path / f"store-{next(counter)}"),
            # The suite's time: the ledger's own property tests run 200; here each example
            # makes a store of real files, and 25 of up to 40 steps each exercise its puts,
            # gets, deletes and releases.
            max_examples=25,
            check_snapshots=False,  # the ledger's own property tests check snapshots
        )
    finally:
        ledger.close()


def test_state_machine_with_mooncake_store(sqlite_url, mooncake_master) -> None:
    def make_store() -> MooncakeFeatureStore:
        return MooncakeFeatureStore(
            mooncake_master.master_address,
            metadata=mooncake_master.metadata_url,
            admin=mooncake_master.admin_address,  # stats() and scan() list the master's keys
            namespace=f"prop-{uuid.uuid4().hex[:12]}",
        )

    # Stores of one cluster share the process's client; without a store open between
    # examples, each example's close tears the client down (about 2 s) and the next sets
    # it up again. Each example still gets a store, and a namespace, of its own.
    anchor = make_store()
    ledger = Ledger.open(sqlite_url, durability="normal")
    try:
        # The suite's time: 40 examples of up to 40 steps each exercise its puts, gets
        # and deletes (about 0.3 s an example against the real master).
        run_ledger_machine(ledger, make_store, max_examples=40, check_snapshots=False)
    finally:
        ledger.close()
        anchor.close()
