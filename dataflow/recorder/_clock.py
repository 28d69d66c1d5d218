"""Whose clock stamps a ledger's events.

An event's ``ts`` is a wall-clock time, and across machines wall clocks disagree.
On PostgreSQL every row is stamped by the database server, in the INSERT itself
(:data:`SERVER_TS`), so the events of every host of a run share one clock and
``--at``, rates and idle times read one timeline. SQLite serves one machine: its
rows carry that machine's clock, taken by the writer.
"""

from __future__ import annotations

import time

from sqlalchemy import Connection

#: The SQL that stamps a row on the database server, by dialect name (seconds since the
#: epoch, as the ``ts`` columns hold them). clock_timestamp(), not now(): the time of the
#: row, not of its transaction's start, as the writer's clock gave before.
SERVER_TS = {"postgresql": "extract(epoch from clock_timestamp())"}


def stamped_by_server(dialect: object) -> bool:
    """Whether ``dialect``'s INSERT stamps an event's ``ts`` itself (the writer gives none)."""
    return getattr(dialect, "name", None) in SERVER_TS


def read_clock(conn: Connection) -> float:
    """Now on the clock that stamps ``conn``'s ledger: the server's (one round trip), or
    this machine's where the writer stamps its rows (SQLite)."""
    expression = SERVER_TS.get(conn.dialect.name)
    if expression is None:
        return time.time()
    return float(conn.exec_driver_sql(f"SELECT {expression}").scalar_one())
