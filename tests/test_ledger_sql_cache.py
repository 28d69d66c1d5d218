"""The ledger's compiled SQL is cached per kind of database, not per opened engine.

Each ``Ledger.open`` makes an engine with a dialect object of its own; a process
that opens many ledgers (a service, a notebook, a test suite) must not keep an
entry, and a dialect, for every engine it ever opened.
"""

from __future__ import annotations

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.recorder._sql import driver_sql, insert_sql
from stores import LocalFeatureStore


def test_opening_many_ledgers_keeps_one_entry_per_statement(tmp_path) -> None:
    store = LocalFeatureStore()
    sizes = []
    for i in range(12):
        with Ledger.open(f"sqlite:///{tmp_path}/ledger-{i}.db") as ledger:
            Producer(ledger, store, run_id="run").emit(f"s{i}", {"x": store_tensor(i)})
            consumer = Consumer(ledger, store, run_id="run", consumer_id="trainer")
            consumer.resume()
            (ref,) = consumer.lease(1)
            consumer.ack([ref], step=1)
            assert replay(ledger, "run").verify() == []
        sizes.append((len(driver_sql.cache), len(insert_sql.cache)))
    assert sizes[-1] == sizes[1], sizes  # the first ledger filled it; the others added none
    store.close()


def store_tensor(i: int):
    import torch

    return torch.full((2,), float(i))
