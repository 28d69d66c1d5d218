"""Appending to a run: the write transaction, its fencing checks, and the event rows it inserts.

A :class:`WriteTransaction` holds its run's write lock (``Ledger.write`` opens it):
everything it reads is the run's exact state, and every check it makes (consumer
epochs, producer epochs, commits already held) is made by the database inside
the transaction that appends, never from memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, inspect, select, update

from dataflow.model._errors import (
    CorruptLedgerError,
    ProducerFencedError,
    SchemaVersionError,
    StaleEpochError,
)
from dataflow.model._events import Kind, check_payload
from dataflow.recorder._reads import CHUNK, newest_commits, released_revision
from dataflow.recorder._schema import events, producers
from dataflow.recorder._schema import runs as runs_table
from dataflow.recorder._sql import INSERT_KEYS, SEQ_ABOVE_INSERT, insert_sql, run_sql


@dataclass
class NewEvent:
    """An event about to be appended (the ledger assigns seq and ts)."""

    kind: str
    actor: str
    sample_id: str | None = None
    epoch: int = 0
    step: int | None = None
    payload: str | None = None
    revision: int | None = None

    def __post_init__(self) -> None:
        check_payload(self.kind, self.payload)  # InvalidArgumentError: not the kind's type


def refuse_unseen_commits(conn: Connection, run_id: str, sample_ids: Sequence[str]) -> None:
    """CorruptLedgerError when a row no fold reads (a seq <= 0, or a revision on an event
    that is no commit) holds the commit index for one of ``sample_ids``: skipping those
    commits would leave the samples untrained while the producer is told they were."""
    for start in range(0, len(sample_ids), CHUNK):
        found = conn.execute(
            select(events.c.seq, events.c.kind, events.c.sample_id)
            .where(
                events.c.run_id == run_id,
                events.c.revision.isnot(None),
                events.c.sample_id.in_(sample_ids[start : start + CHUNK]),
                (events.c.seq <= 0) | (events.c.kind != Kind.COMMIT),
            )
            .limit(1)
        ).first()
        if found is not None:
            seq, kind, sample_id = found
            raise CorruptLedgerError(
                f"the commit of {sample_id!r} in run {run_id!r} is blocked by a {kind} row with "
                f"seq {seq} that no replay reads (a hand-edited or damaged row): nothing was "
                "committed. Delete that row or restore the ledger from a backup, then emit again"
            )


class WriteTransaction:
    """One append transaction on one run, holding the run's write lock.

    Everything read inside it is the run's exact state: no other writer of
    the run can append until it ends. Used by Producer and Consumer; the
    public surface of the ledger is read-only.
    """

    def __init__(self, conn: Connection, run_id: str, epoch: int) -> None:
        self.conn = conn
        self.run_id = run_id
        #: The run's current consumer epoch, as locked.
        self.epoch = epoch
        #: Whether this transaction inserted events (a reader of them inside it holds
        #: events that are not the ledger's if it then does not commit).
        self.appended = False

    def check_epoch(self, epoch: int, actor: str) -> None:
        """Fencing: refuse a consumer write from an epoch that is not the run's current one."""
        if epoch != self.epoch:
            raise StaleEpochError(
                f"{actor!r} writes to run {self.run_id!r} with epoch {epoch}, but the run is at "
                f"epoch {self.epoch}: a newer consumer resumed; this one must stop "
                "(or call resume() to join the current epoch)"
            )

    def claim_producer(self, producer_id: str, payload: str | None) -> int:
        """Take ``producer_id`` for a new producer epoch, fencing its holder; the epoch.

        Appends the CLAIM event (``payload``: who claims, and its store).
        """
        if not inspect(self.conn).has_table(producers.name):
            raise SchemaVersionError(
                f"this ledger predates producer epochs (no {producers.name} table) and was "
                "opened with create=False, which changes no schema: open it with "
                "Ledger.open(url) to migrate it before a Producer writes to it"
            )
        held = self._producer_epoch(producer_id)
        epoch = (held or 0) + 1
        if held is None:
            self.conn.execute(
                insert(producers).values(run_id=self.run_id, producer_id=producer_id, epoch=epoch)
            )
        else:
            self.conn.execute(
                update(producers)
                .where(producers.c.run_id == self.run_id, producers.c.producer_id == producer_id)
                .values(epoch=epoch)
            )
        self.append([NewEvent(Kind.CLAIM, producer_id, epoch=epoch, payload=payload)])
        return epoch

    def check_producer(self, producer_id: str, epoch: int) -> None:
        """Fencing: refuse a producer write from an epoch that no longer holds its id."""
        held = self._producer_epoch(producer_id)
        if held != epoch:
            now = "no epoch (its claim is gone)" if held is None else f"epoch {held}"
            raise ProducerFencedError(
                f"producer {producer_id!r} of run {self.run_id!r} writes with producer epoch "
                f"{epoch}, but the id is held by {now}: another process took the id "
                "(a restarted producer claims it). Nothing was written; this process must "
                "stop producing as that id"
            )

    def _producer_epoch(self, producer_id: str) -> int | None:
        # The driver's cursor, not Result.scalar(): this read is in every commit.
        row = run_sql(
            self.conn, "producer_epoch", run_id=self.run_id, producer_id=producer_id
        ).cursor.fetchone()
        return None if row is None else row[0]

    def set_epoch(self, epoch: int) -> None:
        self.conn.execute(
            update(runs_table).where(runs_table.c.run_id == self.run_id).values(epoch=epoch)
        )
        self.epoch = epoch

    def rows_after(self, seq: int) -> list[Any]:
        return run_sql(self.conn, "rows_after", run_id=self.run_id, after=seq).fetchall()

    def commits(self, sample_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """(newest revision, its ref JSON) per committed id among ``sample_ids``."""
        return newest_commits(self.conn, self.run_id, sample_ids)

    def released_revision(self, sample_id: str) -> int | None:
        """Highest revision of ``sample_id`` whose features were released, if any."""
        return released_revision(self.conn, self.run_id, sample_id)

    def append(self, new_events: Iterable[NewEvent]) -> None:
        now = time.time()
        run_id = self.run_id
        rows = [
            (run_id, e.kind, e.sample_id, e.revision, e.epoch, e.step, e.actor, e.payload, now)
            for e in new_events
        ]
        if rows:
            self._insert(rows, skip_held_commits=False)

    def append_first_commits(
        self, actor: str, payloads: Mapping[str, str], *, epoch: int = 0
    ) -> dict[str, tuple[int, str]]:
        """Commit revision 0 of each ``sample_id: ref JSON`` that the run does not hold yet.

        ``epoch``: the committing producer's epoch, recorded on each commit.

        Returns (newest revision, its ref JSON) of every id the run held, for
        which nothing was appended. One statement when it held none, the
        common case: the commit index itself answers, with no read first.
        """
        run_id, kind, now = self.run_id, Kind.COMMIT, time.time()
        rows = [(run_id, kind, sid, 0, epoch, None, actor, p, now) for sid, p in payloads.items()]
        if not rows:
            return {}
        inserted = self._insert(rows, skip_held_commits=True)
        if inserted == len(rows):
            return {}
        # Under the run's lock nobody else appends to the run, and seq grows
        # with every insert (SQLite's rowid, PostgreSQL's sequence), so the
        # run's newest `inserted` events are exactly the ones just inserted.
        ours = set(
            self.conn.execute(
                select(events.c.sample_id)
                .where(events.c.run_id == run_id)
                .order_by(events.c.seq.desc())
                .limit(inserted)
            ).scalars()
        )
        held = [s for s in payloads if s not in ours]
        refuse_unseen_commits(self.conn, run_id, held)
        return newest_commits(self.conn, run_id, held)

    def _insert(self, rows: list[tuple[Any, ...]], *, skip_held_commits: bool) -> int:
        """Insert ``rows``; the number inserted (short when commits were skipped)."""
        sql, positional = insert_sql(self.conn.dialect, skip_held_commits)
        params: list[Any] = rows
        if not positional:
            params = [dict(zip(INSERT_KEYS, row, strict=True)) for row in rows]
        # The driver's executemany, not insert(events): SQLAlchemy's per-row
        # parameter processing costs as much as SQLite's own insert.
        self.appended = True
        inserted = self.conn.exec_driver_sql(sql, params).rowcount
        if inserted < 0:
            raise AssertionError(f"the {self.conn.dialect.name} driver did not count inserted rows")
        if inserted:  # else the connection's last insert is an older transaction's
            self._refuse_seqs_above_insert()
        return inserted

    def _refuse_seqs_above_insert(self) -> None:
        """CorruptLedgerError (the transaction rolls back) when the run holds an event with a
        seq above the one just given: a hand-edited seq (SQLite gives random rowids once one
        is 2**63-1; PostgreSQL's sequence ignores the table). Every fold stops at the run's
        highest seq, so what was just appended would never be read by a live one."""
        above = run_sql(self.conn, SEQ_ABOVE_INSERT[self.conn.dialect.name], run_id=self.run_id)
        seq = above.scalar()
        if seq is not None:
            raise CorruptLedgerError(
                f"run {self.run_id!r} holds an event with seq {seq}, above the seq the ledger "
                "gives new events: what is appended would sort before it, where no live fold "
                "reads it (a hand-edited or damaged row). Nothing was written; restore the "
                "ledger from a backup, or delete or renumber that row"
            )
