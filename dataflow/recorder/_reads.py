"""Reads of a run's commits and releases on an open connection.

Shared by the ledger's public reads and the write transaction, which reads the
run's exact state under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, CursorResult, bindparam, select

from dataflow.model._events import Kind, row_revisions, row_samples
from dataflow.recorder._schema import events
from dataflow.recorder._sql import per_dialect

#: Ids per ``IN (...)`` list: under SQLite's default limit of bound parameters.
CHUNK = 900
#: The lengths of the compiled ``IN (...)`` lists: a chunk is padded to the next one
#: with its last id (a repeated id changes no answer), so a few statements (each
#: compiled when first used) serve every size.
_SIZES = (*(1 << power for power in range(10) if 1 << power < CHUNK), CHUNK)


@per_dialect
def _commits_sql(dialect: Any, size: int) -> tuple[str, bool]:
    """The read of the commits of ``size`` ids of a run, compiled once per dialect: its
    SQL text, and whether the driver takes its parameters by position (then ``run_id``,
    ``kind``, the ids), else by name (``run_id``, ``kind``, ``id0`` .. ``id{size-1}``).

    Built with SQLAlchemy on every call, the statement (its ``IN`` list coerced and
    expanded id by id) cost 2-3 times what SQLite took to run it: every emit reads it.
    """
    stmt = select(events.c.seq, events.c.sample_id, events.c.revision, events.c.payload).where(
        events.c.run_id == bindparam("run_id"),
        events.c.kind == bindparam("kind"),
        events.c.revision.isnot(None),  # lets the planner use the partial commit index
        events.c.sample_id.in_([bindparam(f"id{i}") for i in range(size)]),
    )
    compiled = stmt.compile(dialect=dialect)
    if compiled.positional:
        order = tuple(compiled.positiontup)  # type: ignore[arg-type]
        assert order == ("run_id", "kind", *(f"id{i}" for i in range(size))), order
    return str(compiled), bool(compiled.positional)


#: The same read on psycopg: the ids as one array, sent in binary. psycopg parses a
#: statement of more than 50 parameters again on every call (it caches none of those),
#: and its text-format array dumper escapes each element with a regular expression.
_PG_COMMITS = (
    f"SELECT seq, sample_id, revision, payload FROM {events.name} "
    "WHERE run_id = %(run_id)s AND kind = %(kind)s AND revision IS NOT NULL "
    "AND sample_id = ANY(%(ids)b::text[])"
)


def _commit_rows(conn: Connection, run_id: str, ids: list[str]) -> CursorResult[Any]:
    """(seq, sample id, revision, payload) of every commit row of ``ids`` (at most CHUNK,
    at least one) in the run."""
    if conn.dialect.driver == "psycopg":
        return conn.exec_driver_sql(
            _PG_COMMITS, {"run_id": run_id, "kind": Kind.COMMIT, "ids": ids}
        )
    size = next(size for size in _SIZES if size >= len(ids))
    sql, positional = _commits_sql(conn.dialect, size)
    padded = ids + [ids[-1]] * (size - len(ids))
    if positional:
        return conn.exec_driver_sql(sql, (run_id, Kind.COMMIT, *padded))
    params: dict[str, Any] = {f"id{i}": sid for i, sid in enumerate(padded)}
    params.update(run_id=run_id, kind=Kind.COMMIT)
    return conn.exec_driver_sql(sql, params)


def newest_commits(
    conn: Connection, run_id: str, sample_ids: Sequence[str]
) -> dict[str, tuple[int, str]]:
    """(newest revision, its ref JSON) for each of ``sample_ids`` committed in the run."""
    found: dict[str, tuple[int, str]] = {}
    for start in range(0, len(sample_ids), CHUNK):
        chunk = list(dict.fromkeys(sample_ids[start : start + CHUNK]))
        for seq, sample_id, revision, payload in _commit_rows(conn, run_id, chunk).cursor:
            # What no fold reads is no commit (see refuse_unseen_commits). Tested here, not
            # in the WHERE: with `seq > 0` there SQLite searched the run's seq index, a scan
            # of the whole run for every emit (2.3 ms at 20,000 events, against 26 us).
            if seq <= 0:
                continue
            if sample_id not in found or revision > found[sample_id][0]:
                found[sample_id] = (revision, payload)
    return found


def commit_payloads(conn: Connection, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
    """The ref JSON of exactly ``revisions[sample_id]`` for each id (the commit index's key)."""
    found: dict[str, str] = {}
    ids = list(revisions)
    for start in range(0, len(ids), CHUNK):
        for _, sample_id, revision, payload in _commit_rows(
            conn, run_id, ids[start : start + CHUNK]
        ).cursor:
            if revisions[sample_id] == revision:
                found[sample_id] = payload
    return found


def released_revision(conn: Connection, run_id: str, sample_id: str) -> int | None:
    """Highest revision whose features are gone: released, or found lost by a consumer.

    Batch release rows (no sample id) are found by their payload naming the id (a sample
    id is written into JSON as it is), then read exactly.
    """
    rows = conn.execute(
        select(events.c.kind, events.c.sample_id, events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind.in_((Kind.RELEASE, Kind.LOST)),
            (events.c.sample_id == sample_id)
            | (
                events.c.sample_id.is_(None)
                & events.c.payload.contains(f'"{sample_id}"', autoescape=True)
            ),
        )
    ).all()
    named = (row_revisions(kind, sid, payload).get(sample_id) for kind, sid, payload in rows)
    revisions = [revision for revision in named if revision is not None]
    return max(revisions) if revisions else None


def batch_sample_counts(conn: Connection, run_id: str, upto_seq: int | None) -> dict[str, int]:
    """Per kind, the samples its batch rows (``seq <= upto_seq``) name beyond one a row:
    what turns a count of a run's rows by kind into a count of the samples they name."""
    query = select(events.c.kind, events.c.payload).where(
        events.c.run_id == run_id,
        events.c.sample_id.is_(None),
        events.c.kind.in_(sorted(Kind.BATCHED)),
    )
    if upto_seq is not None:
        query = query.where(events.c.seq <= upto_seq)
    extra: dict[str, int] = {}
    for kind, payload in conn.execute(query):
        extra[kind] = extra.get(kind, 0) + max(len(row_samples(kind, None, payload)), 1) - 1
    return extra
