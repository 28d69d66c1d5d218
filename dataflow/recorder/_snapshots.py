"""The snapshots table: snapshot bodies stored and read back as bytes.

What a body means is the model's snapshot codec's business
(:mod:`dataflow.model._snapshot`); here a snapshot is a run, the seq it covers,
the format it was written in, the sha256 of its body, and the body.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from sqlalchemy import Connection, delete, insert, literal_column, select

from dataflow.recorder._clock import SERVER_TS
from dataflow.recorder._schema import snapshots


def write_snapshot(
    conn: Connection, run_id: str, seq: int, body: bytes, digest: str, format_: int, keep: int
) -> bool:
    """Store a snapshot of ``run_id`` at ``seq`` and keep the newest ``keep``; False (and
    nothing written) when the run holds a snapshot at that seq already."""
    mine = snapshots.c.run_id == run_id
    if conn.execute(select(snapshots.c.seq).where(mine, snapshots.c.seq == seq)).first():
        return False
    stamp = SERVER_TS.get(conn.dialect.name)  # the clock of the events (_clock.py)
    ts = time.time() if stamp is None else literal_column(stamp)
    conn.execute(
        insert(snapshots).values(
            run_id=run_id, seq=seq, format=format_, digest=digest, body=body, ts=ts
        )
    )
    kept = (
        conn.execute(
            select(snapshots.c.seq).where(mine).order_by(snapshots.c.seq.desc()).limit(keep)
        )
        .scalars()
        .all()
    )
    conn.execute(delete(snapshots).where(mine, snapshots.c.seq.not_in(kept)))
    return True


def stored_snapshots(
    connect: Callable[[], AbstractContextManager[Connection]],
    run_id: str,
    *,
    format_: int,
    upto_seq: int | None,
) -> Iterator[tuple[int, str, bytes | None]]:
    """(seq, digest, body) of the run's snapshots in ``format_`` at or before ``upto_seq``,
    newest first.

    Each body is read only when its turn comes (``connect()`` gives a connection
    per read): a reader that takes the first good one reads one body.
    """
    stmt = select(snapshots.c.seq, snapshots.c.format, snapshots.c.digest).where(
        snapshots.c.run_id == run_id
    )
    if upto_seq is not None:
        stmt = stmt.where(snapshots.c.seq <= upto_seq)
    with connect() as conn:
        found = conn.execute(stmt.order_by(snapshots.c.seq.desc())).all()
    for seq, stored_format, digest in found:
        if stored_format != format_:
            continue
        with connect() as conn:
            body = conn.execute(
                select(snapshots.c.body).where(snapshots.c.run_id == run_id, snapshots.c.seq == seq)
            ).scalar()
        yield seq, digest, None if body is None else bytes(body)
