"""SQLite specifics of the ledger: WAL, fsync level, and writers that lock up front."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, select
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.engine import make_url

from dataflow._db import WRITE_OPTION, Backend
from dataflow._schema import runs


def _enable_wal(cur: Any, timeout_s: float) -> None:
    # Switching a fresh file to WAL needs an exclusive lock and SQLite does
    # not run the busy handler for it: processes opening a new ledger at the
    # same moment get "database is locked" at once. Retry within the timeout.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class SQLiteBackend(Backend):
    name = "sqlite"

    def create_engine(self, url: str, *, durability: str, busy_timeout_s: float) -> Engine:
        database = make_url(url).database
        if database in (None, "", ":memory:"):
            raise ValueError(
                f"ledger URL {url!r} is an in-memory SQLite database, which no other "
                "connection or process can see; use a file: sqlite:///PATH/ledger.db"
            )
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s})
        synchronous = "FULL" if durability == "full" else "NORMAL"

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Take transaction control from pysqlite: it would BEGIN lazily and
            # DEFERRED, and two deferred writers that both read first deadlock
            # on the lock upgrade (SQLITE_BUSY, no busy-wait).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            _enable_wal(cur, busy_timeout_s)
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            write = conn.get_execution_options().get(WRITE_OPTION, False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def lock_run(self, conn: Connection, run_id: str) -> int:
        # BEGIN IMMEDIATE already holds the database's single write lock.
        conn.execute(insert(runs).values(run_id=run_id, epoch=0).on_conflict_do_nothing())
        return conn.execute(select(runs.c.epoch).where(runs.c.run_id == run_id)).scalar_one()
