"""Reads of a run's commits and releases on an open connection.

Shared by the ledger's public reads and the write transaction, which reads the
run's exact state under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, select

from dataflow.model._events import Kind, load_payload
from dataflow.recorder._schema import events

#: Ids per ``IN (...)`` list: under SQLite's default limit of bound parameters.
CHUNK = 900


def newest_commits(
    conn: Connection, run_id: str, sample_ids: Sequence[str]
) -> dict[str, tuple[int, str]]:
    """(newest revision, its ref JSON) for each of ``sample_ids`` committed in the run."""
    found: dict[str, tuple[int, str]] = {}
    for start in range(0, len(sample_ids), CHUNK):
        chunk = list(dict.fromkeys(sample_ids[start : start + CHUNK]))
        stmt = select(events.c.sample_id, events.c.revision, events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind == Kind.COMMIT,
            events.c.revision.isnot(None),  # lets the planner use the partial commit index
            events.c.sample_id.in_(chunk),
            events.c.seq > 0,  # what no fold reads is no commit (see refuse_unseen_commits)
        )
        for sample_id, revision, payload in conn.execute(stmt):
            if sample_id not in found or revision > found[sample_id][0]:
                found[sample_id] = (revision, payload)
    return found


def commit_payloads(conn: Connection, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
    """The ref JSON of exactly ``revisions[sample_id]`` for each id (the commit index's key)."""
    found: dict[str, str] = {}
    ids = list(revisions)
    for start in range(0, len(ids), CHUNK):
        stmt = select(events.c.sample_id, events.c.revision, events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind == Kind.COMMIT,
            events.c.revision.isnot(None),
            events.c.sample_id.in_(ids[start : start + CHUNK]),
        )
        for sample_id, revision, payload in conn.execute(stmt):
            if revisions[sample_id] == revision:
                found[sample_id] = payload
    return found


def released_revision(conn: Connection, run_id: str, sample_id: str) -> int | None:
    """Highest revision whose features are gone: released, or found lost by a consumer."""
    rows = conn.execute(
        select(events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind.in_((Kind.RELEASE, Kind.LOST)),
            events.c.sample_id == sample_id,
        )
    ).all()
    revisions = [load_payload(p).get("revision", 0) for (p,) in rows]
    return max(revisions) if revisions else None
