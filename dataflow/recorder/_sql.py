"""The ledger's hot SQL, compiled once per kind of database and run as driver SQL.

Building a SQLAlchemy Core statement and its cache key took longer than SQLite
took to run it; the statements the hot paths run (an append, a lease, an ack,
a catch-up read) are compiled once per dialect and run with bound parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    CursorResult,
    bindparam,
    func,
    insert,
    literal_column,
    select,
    union_all,
)

from dataflow.recorder._clock import SERVER_TS, stamped_by_server
from dataflow.recorder._schema import events, producers

_T = TypeVar("_T")

#: Columns of a raw event row, in order: what the fold consumes.
ROW_COLUMNS = (
    events.c.seq,
    events.c.kind,
    events.c.sample_id,
    events.c.revision,
    events.c.epoch,
    events.c.step,
    events.c.actor,
    events.c.payload,
    events.c.ts,
)
#: The columns of an inserted event row, in the order of the rows ``insert_sql`` takes;
#: on PostgreSQL a row starts with its ``seq`` (see :data:`SEQ_SHIFT`) and has no ``ts``
#: (the server stamps it: ``_clock.py``).
INSERT_KEYS = (
    "run_id", "kind", "sample_id", "revision", "epoch", "step", "actor", "payload", "ts",
)  # fmt: skip
#: On PostgreSQL an event's seq is ``(xid << SEQ_SHIFT) | ordinal``: the id of the
#: transaction that appended it, then its place among that transaction's rows
#: (``_postgres.py`` says why).
SEQ_SHIFT = 20
#: The first seq ``Backend.lock_run`` gives a transaction whose lock it has not taken:
#: its first statement takes it (PostgreSQL producers' transactions, ``_pg_append.py``).
LOCK_DEFERRED = -1
#: The seqs below it can no longer change: every transaction with a smaller id has ended
#: (the statement's snapshot; PostgreSQL only).
_HORIZON = literal_column(f"(pg_snapshot_xmin(pg_current_snapshot())::text::bigint << {SEQ_SHIFT})")
#: No transaction with an id at or above it had committed when the statement's snapshot was
#: taken: a row it shows from there up, other than the transaction's own, was written by hand
#: (PostgreSQL only).
_UNCOMMITTED = literal_column(
    f"(pg_snapshot_xmax(pg_current_snapshot())::text::bigint << {SEQ_SHIFT})"
)


def per_dialect(build: Callable[..., _T]) -> Callable[..., _T]:
    """Cache ``build(dialect, *args)`` by the kind of dialect, not by its instance.

    Every engine has a dialect object of its own: keyed by the instance, a process
    that opens many ledgers would keep an entry (and a dialect) per engine it ever
    opened. What the SQL text depends on is the dialect and driver, and how the
    driver takes parameters.
    """
    cache: dict[tuple[Any, ...], _T] = {}

    @functools.wraps(build)
    def cached(dialect: Any, *args: Any) -> _T:
        key = (dialect.name, dialect.driver, dialect.paramstyle, *args)
        found = cache.get(key)
        if found is None:
            found = cache[key] = build(dialect, *args)
        return found

    cached.cache = cache  # type: ignore[attr-defined]
    return cached


@per_dialect
def driver_sql(dialect: Any, statement: str) -> tuple[str, tuple[str, ...] | None, dict[str, Any]]:
    """``_STATEMENTS[statement]`` compiled once for ``dialect``: its SQL text, the order of
    its parameters when the driver takes them by position (None: by name), and the values
    the statement itself binds."""
    compiled = _STATEMENTS[statement]().compile(dialect=dialect)
    order = tuple(compiled.positiontup) if compiled.positional else None  # type: ignore[arg-type]
    return str(compiled), order, dict(compiled.params)


def run_sql(conn: Connection, statement: str, **params: Any) -> CursorResult[Any]:
    """Run the named statement of the hot paths on ``conn`` with ``params``, as driver SQL."""
    sql, order, bound = driver_sql(conn.dialect, statement)
    values = {**bound, **params}
    if order is None:
        return conn.exec_driver_sql(sql, {key: values[key] for key in bound})
    return conn.exec_driver_sql(sql, tuple(values[key] for key in order))


def insert_keys(dialect: Any) -> tuple[str, ...]:
    """The columns of an inserted row for ``dialect``: PostgreSQL's rows name their seq, and
    leave out the ts that its server stamps."""
    keys = INSERT_KEYS[:-1] if stamped_by_server(dialect) else INSERT_KEYS
    return ("seq", *keys) if dialect.name == "postgresql" else keys


@per_dialect
def insert_sql(dialect: Any, skip_held_commits: bool) -> tuple[str, bool]:
    """The INSERT of an event row for ``dialect``, and whether its parameters are positional.

    The row's columns are :func:`insert_keys`. ``skip_held_commits``: a commit whose
    (run, sample, revision) is held already is left out (``ON CONFLICT ... DO
    NOTHING`` on the commit index) instead of failing the transaction. A row left
    out leaves its seq unused; nothing reads seq as contiguous (it is global to the
    ledger, so a run's seqs skip the other runs' events anyway, and a rolled-back
    transaction leaves gaps too): folds, snapshots, ``follow`` and ``--upto`` only
    compare seqs.
    """
    stmt: Any = insert(events)
    if skip_held_commits:
        if dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        stmt = dialect_insert(events).on_conflict_do_nothing(
            index_elements=[events.c.run_id, events.c.sample_id, events.c.revision],
            index_where=events.c.revision.isnot(None),
        )
    if stamped_by_server(dialect):
        stmt = stmt.values(ts=literal_column(SERVER_TS[dialect.name]))
    # inline(): no RETURNING seq on PostgreSQL, which executemany would only discard.
    keys = insert_keys(dialect)
    compiled = stmt.inline().compile(dialect=dialect, column_keys=list(keys))
    if compiled.positional:
        assert tuple(compiled.positiontup) == keys, compiled.positiontup
    return str(compiled), bool(compiled.positional)


def _rows_after() -> Any:
    return (
        select(*ROW_COLUMNS)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq > bindparam("after"))
        .order_by(events.c.seq)
    )


def _rows_after_below() -> Any:
    return _rows_after().where(events.c.seq < bindparam("below"))


def _page_after() -> Any:
    return _rows_after().limit(bindparam("limit"))


def _page_between() -> Any:
    return _page_after().where(events.c.seq <= bindparam("upto"))


def _settled(*, upto: bool = False) -> Callable[[], Any]:
    """PostgreSQL's tail read: up to ``limit`` rows after ``after`` (and up to ``upto``)
    that no transaction still running can add to, in seq order.

    That is every row below the horizon, and the rows a hand set at or above the seqs of
    the transactions not yet committed (no running transaction sorts after those). Each
    part is an index range scan stopped at ``limit`` rows: the seqs between them, of
    transactions that committed while one with a smaller id still runs, are never
    scanned only to be left out, and the sort is of two pages at most. For a reader that
    holds no transaction id (its own rows would count as set by hand).
    """

    def build() -> Any:
        def part(bound: Any) -> Any:
            where = [events.c.run_id == bindparam("run_id"), events.c.seq > bindparam("after")]
            if upto:
                where.append(events.c.seq <= bindparam("upto"))
            stmt = select(*ROW_COLUMNS).where(*where, bound).order_by(events.c.seq)
            return stmt.limit(bindparam("limit"))

        both = union_all(part(events.c.seq < _HORIZON), part(events.c.seq >= _UNCOMMITTED))
        settled = both.subquery("settled")
        return select(*settled.c).order_by(settled.c.seq).limit(bindparam("limit"))

    return build


def _seq_above(last_inserted: Any) -> Callable[[], Any]:
    """The run's highest seq at or above ``last_inserted``."""
    return lambda: (
        select(events.c.seq)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq >= last_inserted)
        .order_by(events.c.seq.desc())
        .limit(1)
    )


def _unseen_rows() -> Any:
    return (
        select(events.c.seq, events.c.kind, events.c.sample_id)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq <= 0)
        .order_by(events.c.seq)
        .limit(bindparam("limit"))
    )


def _producer_epoch() -> Any:
    return select(producers.c.epoch).where(
        producers.c.run_id == bindparam("run_id"),
        producers.c.producer_id == bindparam("producer_id"),
    )


_STATEMENTS: dict[str, Callable[[], Any]] = {
    "rows_after": _rows_after,
    "rows_after_below": _rows_after_below,
    "page_after": _page_after,
    "page_between": _page_between,
    "settled_page_after": _settled(),
    "settled_page_between": _settled(upto=True),
    # SQLite: above the row just inserted (its rowid). PostgreSQL: above the seqs of this
    # transaction (``end``) and of every one committed (concurrent appends above ours are
    # real).
    "seq_above_rowid": _seq_above(literal_column("last_insert_rowid() + 1")),
    "seq_above_given": _seq_above(func.greatest(_UNCOMMITTED, bindparam("end"))),
    "unseen_rows": _unseen_rows,
    "producer_epoch": _producer_epoch,
}
#: The statement that finds a seq above any the ledger gives new events, by dialect name.
SEQ_ABOVE_INSERT = {"sqlite": "seq_above_rowid", "postgresql": "seq_above_given"}


def tail_statement(dialect: Any, statement: str) -> str:
    """The name of ``statement`` (``page_after``, ``page_between``) that a reader outside a
    write transaction runs on ``dialect``: on PostgreSQL the settled rows only (see
    :func:`_settled`); SQLite's single writer commits in seq order, so every row it
    shows is settled."""
    return f"settled_{statement}" if dialect.name == "postgresql" else statement


#: Each run id of the events once, one index probe per run (a skip scan; SQLite and
#: PostgreSQL both read DISTINCT as a scan of every event).
EVENT_RUN_IDS = f"""
WITH RECURSIVE r(run_id) AS (
    SELECT MIN(run_id) FROM {events.name}
    UNION ALL
    SELECT (SELECT MIN(e.run_id) FROM {events.name} e WHERE e.run_id > r.run_id)
    FROM r WHERE r.run_id IS NOT NULL
)
SELECT run_id FROM r WHERE run_id IS NOT NULL
"""
