"""Appending to a run: the write transaction, its fencing checks, and the event rows it inserts.

A :class:`WriteTransaction` holds its run's lock (``Ledger.write`` opens it), alone
or (``shared``, producers' commits on PostgreSQL) beside other producers: every
check it makes (consumer epochs, producer epochs, commits already held) is made
by the database inside the transaction that appends, never from memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, inspect, select, update

from dataflow.model._errors import (
    CorruptLedgerError,
    InvalidArgumentError,
    ProducerFencedError,
    SchemaVersionError,
    StaleEpochError,
)
from dataflow.model._events import Kind, check_payload
from dataflow.recorder import _pg_append
from dataflow.recorder._clock import stamped_by_server
from dataflow.recorder._reads import CHUNK, newest_commits, released_revision
from dataflow.recorder._schema import events, producers
from dataflow.recorder._schema import runs as runs_table
from dataflow.recorder._sql import (
    LOCK_DEFERRED,
    SEQ_ABOVE_INSERT,
    SEQ_SHIFT,
    insert_keys,
    insert_sql,
    run_sql,
)


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
    """One append transaction on one run, holding the run's lock.

    Held alone (the default), everything read inside it is the run's exact
    state: no other writer of the run can append until it ends; a consumer write
    (``consumers``, see ``_postgres.py``) reads the exact state below its own rows
    while producers append above them. Held
    ``shared`` (producers' commits and closes, see ``Ledger.write``), other
    producers append beside it: it reads no tail, and its checks read what the
    database holds (the commit index, the producer's epoch). Used by Producer and
    Consumer; the public surface of the ledger is read-only.

    A shared transaction on PostgreSQL takes the run's lock with its first statement
    (``first_seq`` is ``LOCK_DEFERRED``, ``_pg_append.py``): a producer check waits
    for it, and a commit of first revisions is then one statement, lock, check and
    insert together.
    """

    def __init__(
        self,
        conn: Connection,
        run_id: str,
        epoch: int,
        *,
        first_seq: int | None = None,
        shared: bool = False,
    ) -> None:
        self.conn = conn
        self.run_id = run_id
        #: The run's current consumer epoch, as locked (not read in a shared transaction,
        #: whose writers, the producers, are not fenced by it).
        self.epoch = epoch
        self.shared = shared
        #: Whether this transaction inserted events (a reader of them inside it holds
        #: events that are not the ledger's if it then does not commit).
        self.appended = False
        #: The run's lock is still to be taken (by the next statement, see the class).
        self._lock_deferred = first_seq == LOCK_DEFERRED
        #: The (producer id, epoch) a deferred lock's statement checks.
        self._fence: tuple[str, int] | None = None
        # PostgreSQL: the seq of the next row inserted, and the end of this transaction's
        # range (see _postgres.py). None: the database gives seqs (SQLite's rowids).
        self._next_seq: int | None = None
        self._end_seq: int | None = None
        if not self._lock_deferred:
            self._set_first_seq(first_seq)

    def _set_first_seq(self, first_seq: int | None) -> None:
        self._next_seq = first_seq
        self._end_seq = None if first_seq is None else first_seq + (1 << SEQ_SHIFT)

    def _lock(self) -> None:
        """Take a deferred lock (with the producer check it carries), if not taken yet."""
        if not self._lock_deferred:
            return
        producer = None if self._fence is None else self._fence[0]
        first, _, held = _pg_append.lock_run(
            self.conn, self.run_id, mode=_pg_append.SHARED, producer=producer
        )
        self._lock_deferred = False
        self._set_first_seq(first)
        self._check_fence(held)

    def _check_fence(self, held: int | None) -> None:
        """ProducerFencedError when the producer checked holds ``held``, not its epoch."""
        if self._fence is None:
            return
        producer_id, epoch = self._fence
        self._fence = None
        if held != epoch:
            now = "no epoch (its claim is gone)" if held is None else f"epoch {held}"
            raise ProducerFencedError(
                f"producer {producer_id!r} of run {self.run_id!r} writes with producer epoch "
                f"{epoch}, but the id is held by {now}: another process took the id "
                "(a restarted producer claims it). Nothing was written; this process must "
                "stop producing as that id"
            )

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
        self._lock()
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
        """Fencing: refuse a producer write from an epoch that no longer holds its id.

        In a transaction whose lock is deferred, the statement that takes the lock
        makes the check (nothing is written before it): call this before writing.
        """
        self._fence = (producer_id, epoch)
        if not self._lock_deferred:
            self._check_fence(self._producer_epoch(producer_id))

    def _producer_epoch(self, producer_id: str) -> int | None:
        # The driver's cursor, not Result.scalar(): this read is in every commit.
        row = run_sql(
            self.conn, "producer_epoch", run_id=self.run_id, producer_id=producer_id
        ).cursor.fetchone()
        return None if row is None else row[0]

    def set_epoch(self, epoch: int) -> None:
        self._lock()
        self.conn.execute(
            update(runs_table).where(runs_table.c.run_id == self.run_id).values(epoch=epoch)
        )
        self.epoch = epoch

    def rows_after(self, seq: int) -> list[Any]:
        """The run's rows after ``seq``, in seq order: the run's exact tail (what a consumer
        decides from), up to this transaction's own rows. Only in a transaction that
        holds the run's lock alone or as a consumer write (``_postgres.py``): beside
        producers only, a row could still appear below one read."""
        if self.shared:
            raise AssertionError("a shared write transaction cannot read the run's exact tail")
        self._lock()
        # Plain driver tuples, not Rows (as Ledger.rows): a consumer that fell behind
        # producers reads tens of thousands here, and a Row costs more than its fold.
        if self._end_seq is None:  # SQLite: nobody else writes
            return run_sql(self.conn, "rows_after", run_id=self.run_id, after=seq).cursor.fetchall()
        # PostgreSQL: only below the end of this transaction's seqs. Beside a consumer
        # write, producers that started after it commit above them; read now, they would
        # move the fold past the rows this transaction appends.
        below = self._end_seq
        return run_sql(
            self.conn, "rows_after_below", run_id=self.run_id, after=seq, below=below
        ).cursor.fetchall()

    def commits(self, sample_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """(newest revision, its ref JSON) per committed id among ``sample_ids``."""
        self._lock()
        return newest_commits(self.conn, self.run_id, sample_ids)

    def released_revision(self, sample_id: str) -> int | None:
        """Highest revision of ``sample_id`` whose features were released, if any."""
        self._lock()
        return released_revision(self.conn, self.run_id, sample_id)

    def append(self, new_events: Iterable[NewEvent]) -> None:
        now = self._stamp()
        run_id = self.run_id
        rows = [
            (run_id, e.kind, e.sample_id, e.revision, e.epoch, e.step, e.actor, e.payload, *now)
            for e in new_events
        ]
        self._lock()  # even with no rows: a producer check still waiting is made
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
        run_id, kind = self.run_id, Kind.COMMIT
        if not payloads:
            self._lock()  # a producer check still waiting is made: a fenced one is told
            return {}
        if self._lock_deferred:
            first, inserted = self._commit_with_lock(actor, payloads, epoch=epoch)
        else:
            first, now = self._next_seq, self._stamp()
            rows = [(run_id, kind, s, 0, epoch, None, actor, p, *now) for s, p in payloads.items()]
            inserted = self._insert(rows, skip_held_commits=True)
        if inserted == len(payloads):
            return {}
        if first is None:
            # SQLite: nobody else appends to the run meanwhile, and rowids grow with
            # every insert, so the run's newest `inserted` events are the ones just inserted.
            mine = select(events.c.sample_id).where(events.c.run_id == run_id)
            mine = mine.order_by(events.c.seq.desc()).limit(inserted)
        else:  # the seqs this insert gave (other producers append beside it)
            mine = select(events.c.sample_id).where(
                events.c.run_id == run_id, events.c.seq >= first, events.c.seq < self._next_seq
            )
        ours = set(self.conn.execute(mine).scalars())
        held = [s for s in payloads if s not in ours]
        refuse_unseen_commits(self.conn, run_id, held)
        return newest_commits(self.conn, run_id, held)

    def _commit_with_lock(
        self, actor: str, payloads: Mapping[str, str], *, epoch: int
    ) -> tuple[int, int]:
        """``append_first_commits`` as the transaction's first statement, the deferred
        lock and producer check with it (``_pg_append.commit_first_revisions``): the
        first seq of its rows, and how many were inserted."""
        self._check_room(len(payloads))
        fence, self._fence = self._fence, None
        first, held, inserted, above = _pg_append.commit_first_revisions(
            self.conn,
            self.run_id,
            producer=fence,
            actor=actor,
            epoch=epoch,
            sample_ids=list(payloads),
            payloads=list(payloads.values()),
        )
        self._lock_deferred = False
        self._set_first_seq(first)
        self._fence = fence
        self._check_fence(held)
        assert self._next_seq is not None
        self._next_seq += len(payloads)
        self.appended = True
        if above is not None:
            self._refuse_seq_above(above)
        return first, inserted

    def _stamp(self) -> tuple[float, ...]:
        """The ``ts`` a row carries: this machine's time, or none where the database
        server stamps it (PostgreSQL, ``_clock.py``)."""
        return () if stamped_by_server(self.conn.dialect) else (time.time(),)

    def _insert(self, rows: list[tuple[Any, ...]], *, skip_held_commits: bool) -> int:
        """Insert ``rows``; the number inserted (short when commits were skipped)."""
        dialect = self.conn.dialect
        sql, positional = insert_sql(dialect, skip_held_commits)
        if self._next_seq is not None:
            rows = self._numbered(rows, by_sample=skip_held_commits)
        params: list[Any] = rows
        if not positional:
            keys = insert_keys(dialect)
            params = [dict(zip(keys, row, strict=True)) for row in rows]
        # The driver's executemany, not insert(events): SQLAlchemy's per-row
        # parameter processing costs as much as SQLite's own insert.
        self.appended = True
        inserted = self.conn.exec_driver_sql(sql, params).rowcount
        if inserted < 0:
            raise AssertionError(f"the {self.conn.dialect.name} driver did not count inserted rows")
        if inserted:  # else the connection's last insert is an older transaction's
            self._refuse_seqs_above_insert()
        return inserted

    def _numbered(self, rows: list[tuple[Any, ...]], *, by_sample: bool) -> list[tuple[Any, ...]]:
        """``rows``, each led by its seq: the transaction's next ones, in the given order.

        ``by_sample``: inserted in sample-id order (their seqs stay in the given
        order). Two producers committing overlapping ids then meet in the commit
        index in one order, each waiting for the other's commit at most one way:
        never in a cycle (a deadlock that PostgreSQL would end by failing one).
        """
        first = self._next_seq
        assert first is not None
        self._check_room(len(rows))
        self._next_seq = first + len(rows)
        numbered = [(first + i, *row) for i, row in enumerate(rows)]
        if by_sample:
            numbered.sort(key=lambda row: row[3])  # (seq, run_id, kind, sample_id, ...)
        return numbered

    def _check_room(self, count: int) -> None:
        """InvalidArgumentError when ``count`` more rows overflow the transaction's seqs."""
        appended = 0
        if self._next_seq is not None and self._end_seq is not None:
            appended = self._next_seq - (self._end_seq - (1 << SEQ_SHIFT))
        if appended + count > 1 << SEQ_SHIFT:
            raise InvalidArgumentError(
                f"one transaction appends at most {1 << SEQ_SHIFT} events to a PostgreSQL "
                f"ledger, and this one would append {appended + count}. Nothing was written: "
                "commit in smaller batches"
            )

    def _refuse_seqs_above_insert(self) -> None:
        """CorruptLedgerError (the transaction rolls back) when the run holds an event with a
        seq above the ones the ledger gives: a hand-edited seq (SQLite gives random rowids
        once one is 2**63-1; on PostgreSQL, above the seqs of this transaction and of every
        one committed; concurrent producers' seqs above ours are real). Every fold stops at the
        run's highest seq, so what was just appended would never be read by a live one."""
        statement = SEQ_ABOVE_INSERT[self.conn.dialect.name]
        above = run_sql(self.conn, statement, run_id=self.run_id, end=self._end_seq)
        seq = above.scalar()
        if seq is not None:
            self._refuse_seq_above(seq)

    def _refuse_seq_above(self, seq: int) -> None:
        """CorruptLedgerError: the run holds ``seq``, above the seqs the ledger gives."""
        raise CorruptLedgerError(
            f"run {self.run_id!r} holds an event with seq {seq}, above the seq the ledger "
            "gives new events: what is appended would sort before it, where no live fold "
            "reads it (a hand-edited or damaged row). Nothing was written; restore the "
            "ledger from a backup, or delete or renumber that row"
        )
