"""Observers of appends: the recorder tells subscribers of each committed append and
knows nothing of who they are (metrics subscribe; the ledger never imports them)."""

from __future__ import annotations

import grimp
import pytest

from dataflow import Ledger, StaleEpochError
from dataflow.model._events import Kind
from dataflow.recorder import _observers
from dataflow.recorder._write import NewEvent


def test_a_subscriber_hears_each_committed_append_once(sqlite_url: str) -> None:
    heard: list[tuple[str, str, str, float]] = []

    def observer(url: str, run_id: str, what: str, seconds: float) -> None:
        heard.append((url, run_id, what, seconds))

    with Ledger.open(sqlite_url) as ledger:
        _observers.subscribe(observer)
        _observers.subscribe(observer)  # once, however often subscribed
        try:
            with ledger.write("r", "resume") as tx:
                tx.append([NewEvent(Kind.RESUME, "c", epoch=1)])
                tx.set_epoch(1)
            with pytest.raises(StaleEpochError), ledger.write("r", "ack") as tx:
                tx.check_epoch(0, "c")  # refused: rolled back, so not heard
        finally:
            _observers.unsubscribe(observer)
        with ledger.write("r", "nack") as tx:
            tx.append([NewEvent(Kind.NACK, "c", epoch=1)])
    assert [(u, r, w) for u, r, w, _ in heard] == [(sqlite_url, "r", "resume")]
    assert heard[0][3] > 0
    assert observer not in _observers.observers
    _observers.unsubscribe(observer)  # not subscribed: nothing happens


def test_the_recorder_imports_neither_the_fold_nor_the_live_run() -> None:
    graph = grimp.build_graph("dataflow", include_external_packages=False)
    recorder = {m for m in graph.modules if m.startswith("dataflow.recorder")}
    above = [
        (module, imported)
        for module in recorder
        for imported in graph.find_modules_directly_imported_by(module)
        if imported == "dataflow.model._fold"
        or not imported.startswith(("dataflow.recorder", "dataflow.model", "dataflow.interfaces"))
    ]
    assert above == []
