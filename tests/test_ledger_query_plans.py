"""The hot reads of a SQLite ledger search an index made for them, never the whole run.

Not a timing: the plan SQLite gives the statement the ledger really sends (caught as it
is executed), which says what each read costs at any size of run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from dataflow import Ledger, Producer
from stores import LocalFeatureStore


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    led = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    with LocalFeatureStore() as store:
        producer = Producer(led, store, run_id="r")
        producer.commit([store.put(f"s{i}", {}) for i in range(50)])
    yield led
    led.close()


def _plans(ledger: Ledger, read: Any) -> list[str]:
    """SQLite's plan of each SELECT that ``read()`` sends."""
    sent: list[tuple[str, Any]] = []

    def catch(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            sent.append((statement, parameters))

    engine = ledger._engine
    event.listen(engine, "before_cursor_execute", catch)
    try:
        read()
    finally:
        event.remove(engine, "before_cursor_execute", catch)
    plans = []
    with engine.connect() as conn:
        for statement, parameters in sent:
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            plans.append(" | ".join(str(row[-1]) for row in rows))
    return plans


def test_which_ids_a_run_holds_is_read_through_the_commit_index(ledger: Ledger) -> None:
    # The read every emit makes before it puts: with `seq > 0` in its WHERE, SQLite
    # searched the run's seq index instead, a scan of the whole run per emit.
    plans = _plans(ledger, lambda: ledger.commits("r", [f"s{i}" for i in range(0, 64, 2)]))
    assert plans, "the read sent no SELECT"
    for plan in plans:
        assert "USING INDEX ux_dataflow_events_commit" in plan, plan


def test_a_commit_hidden_behind_a_seq_below_one_is_still_no_commit(ledger: Ledger) -> None:
    # The seq test left the WHERE for Python: a hand-made row at seq -3 stays unseen.
    with ledger._engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE dataflow_events SET seq = -3 WHERE run_id = 'r' AND sample_id = 's7'"
        )
    held = ledger.commits("r", ["s6", "s7"])
    assert set(held) == {"s6"}


@pytest.mark.postgres
def test_on_postgresql_the_held_ids_go_as_one_array_through_the_commit_index(
    postgres_url: str,
) -> None:
    # psycopg parses a statement of more than 50 parameters again on every call: the ids
    # go as one array (any number of them), and the commit index still answers.
    with Ledger.open(postgres_url) as led, LocalFeatureStore() as store:
        producer = Producer(led, store, run_id="r")
        producer.commit([store.put(f"s{i}", {}) for i in range(300)])
        sent: list[tuple[str, Any]] = []

        def catch(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            if statement.lstrip().upper().startswith("SELECT"):
                sent.append((statement, parameters))

        event.listen(led._engine, "before_cursor_execute", catch)
        try:
            held = led.commits("r", [f"s{i}" for i in range(0, 600, 3)])
        finally:
            event.remove(led._engine, "before_cursor_execute", catch)
        assert set(held) == {f"s{i}" for i in range(0, 300, 3)}
        (statement, parameters), *more = sent
        assert not more and "ANY(" in statement and len(parameters) == 3
        with led._engine.connect() as conn:
            # The table is small enough that a scan is cheaper: is the index usable at all?
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            plan = " | ".join(
                r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, parameters)
            )
        assert "ux_dataflow_events_commit" in plan, plan
