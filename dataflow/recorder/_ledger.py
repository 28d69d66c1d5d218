"""The ledger: an append-only event log per run, in SQLite or PostgreSQL.

:class:`Ledger` opens a ledger and reads it; appends go through
:meth:`Ledger.write`, whose :class:`~dataflow.recorder._write.WriteTransaction`
(``_write.py``) holds the run's lock (on PostgreSQL producers' commits share it,
``_postgres.py`` says how readers stay exact). The hot SQL is in ``_sql.py``, the
snapshots table in ``_snapshots.py``, and what differs between databases in the
backends (``_sqlite.py``, ``_postgres.py``, picked by ``_backends.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Row, func, inspect, select
from sqlalchemy.engine import make_url

from dataflow.model import _snapshot
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    InvalidArgumentError,
    LedgerError,
    NotALedgerError,
    ReadOnlyLedgerError,
    SchemaVersionError,
)
from dataflow.model._events import Event, load_payload
from dataflow.model._ids import MAX_ID_LENGTH, check_id
from dataflow.model._ids import check_run_id as _check_run_id
from dataflow.recorder import _observers
from dataflow.recorder._backends import backend_for
from dataflow.recorder._clock import read_clock
from dataflow.recorder._db import (
    DEFAULT_URL,
    check_durability,
    create_schema,
    translate_errors,
    write_options,
)
from dataflow.recorder._reads import (
    batch_sample_counts,
    commit_payloads,
    newest_commits,
    released_revision,
)
from dataflow.recorder._schema import SCHEMA_VERSION, events, schema_info
from dataflow.recorder._schema import runs as runs_table
from dataflow.recorder._snapshots import stored_snapshots, write_snapshot
from dataflow.recorder._sql import EVENT_RUN_IDS, run_sql, tail_statement
from dataflow.recorder._write import NewEvent, WriteTransaction

# check_id, _check_run_id, NewEvent and WriteTransaction are imported from here by
# the layers above; they live in dataflow.model._ids and ._write.
__all__ = [
    "MAX_ID_LENGTH",
    "MAX_SEQ",
    "Ledger",
    "NewEvent",
    "WriteTransaction",
    "_check_run_id",
    "check_id",
]

#: Events per page of :meth:`Ledger.rows`.
_PAGE = 5000
_MAX_POLL_S = 3600.0
MAX_SEQ = 2**63 - 1


def _check_seq(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ:
        raise InvalidArgumentError(
            f"{name} must be an int from 0 to 2**63-1 (a seq), got {value!r}"
        )


class Ledger:
    """The append-only event log of runs; every run state is a fold over it.

    Open with :meth:`open`. SQLite (the default, ``sqlite:///./dataflow.db``)
    serves one machine; PostgreSQL (``postgresql+psycopg://...``) serves runs
    whose producers and trainers span machines. Many processes may share one
    ledger: dedup of commits and epoch fencing are enforced inside the append
    transaction by the database, not by in-memory state.
    """

    def __init__(
        self,
        url: str,
        *,
        durability: str = "full",
        busy_timeout: float = 30.0,
        create: bool = True,
        read_only: bool = False,
    ) -> None:
        if not isinstance(url, str):
            raise ArgumentTypeError(f"ledger URL must be a str, got {type(url).__name__}")
        check_durability(durability)
        if (
            not isinstance(busy_timeout, (int, float))
            or isinstance(busy_timeout, bool)
            or not 0 < busy_timeout < math.inf
        ):
            raise InvalidArgumentError(
                f"busy_timeout must be a positive number of seconds, got {busy_timeout!r}"
            )
        if not isinstance(create, bool):
            raise ArgumentTypeError(f"create must be a bool, got {create!r}")
        if not isinstance(read_only, bool):
            raise ArgumentTypeError(f"read_only must be a bool, got {read_only!r}")
        create = create and not read_only
        self._backend = backend_for(url)
        self._backend.read_only = read_only
        self.url = url
        self.durability = durability
        self.read_only = read_only
        timeout_s = float(busy_timeout)
        with translate_errors(f"opening ledger {self.safe_url}"):
            self._backend.prepare(
                url, create=create, durability=durability, busy_timeout_s=timeout_s
            )
            self._engine = self._backend.create_engine(
                url, durability=durability, busy_timeout_s=timeout_s
            )
            try:
                self._open_schema(create)
            except BaseException:
                self._engine.dispose()
                raise

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        create: bool = True,
        durability: str = "full",
        busy_timeout: float = 30.0,
        read_only: bool = False,
    ) -> Ledger:
        """Open the ledger at ``url``; with ``create`` (default) make it where there is none.

        ``create=True``: a missing SQLite file (and its directories) is
        created, and a PostgreSQL database without the ledger's tables gets
        them. ``create=False``: the ledger must exist; nothing is created, and
        NotALedgerError says so. Either way, an existing SQLite file that is
        empty, not a SQLite database, or a database without the ledger's
        tables raises NotALedgerError and is left as it is: it may be a
        ledger that lost its data, and starting afresh over it would make
        every trainer begin from scratch.

        ``durability="full"`` (default) fsyncs every transaction; ``"normal"``
        is faster but may lose the last transactions on power loss (SQLite
        ``synchronous=NORMAL``, PostgreSQL ``synchronous_commit=off``).
        ``busy_timeout`` bounds how long a writer waits for the write lock; on
        PostgreSQL also how long a dead client holds a run's lock and how long a call
        waits on a silent link (docs/reliability.md, "Timeouts").

        ``read_only=True`` creates nothing and writes nothing: a write raises
        ReadOnlyLedgerError. A SQLite ledger where no ``-wal``/``-shm`` can be
        made beside it (a read-only file system, a backup or snapshot mount) is
        then opened in SQLite's immutable mode (:attr:`immutable`): it is read
        without locks, so it must not change while it is open.
        """
        url = DEFAULT_URL if url is None else url
        return cls(
            url,
            durability=durability,
            busy_timeout=busy_timeout,
            create=create,
            read_only=read_only,
        )

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def schema_version(self) -> int:
        """The schema version of the ledger as opened: this dataflow's, or an older one's
        opened with ``create=False`` (which migrates nothing). Writers write the rows that
        version's readers read (batch rows from version 4 on)."""
        return self._schema_version or SCHEMA_VERSION

    @property
    def immutable(self) -> bool:
        """Opened in SQLite's immutable mode (read-only, no locks): see :meth:`open`."""
        return self._backend.immutable

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyLedgerError(
                f"cannot {what}: ledger {self.safe_url} was opened read-only "
                "(Ledger.open(..., read_only=True)) and nothing was written; open it "
                "without read_only to write"
            )

    def __repr__(self) -> str:
        return f"Ledger({self.safe_url!r})"

    def _open_schema(self, create: bool) -> None:
        options = write_options() if create else {}
        with self._engine.connect().execution_options(**options) as conn, conn.begin():
            if create:
                self._backend.lock_schema(conn)
                create_schema(conn)
            elif not inspect(conn).has_table(schema_info.name):
                raise NotALedgerError(
                    f"{self.safe_url} holds no dataflow ledger (no {schema_info.name} table); "
                    "nothing was created: check the URL"
                )
            version = conn.execute(select(schema_info.c.version)).scalar()
            self._schema_version = version
            if version is not None and version > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"ledger {self.safe_url} has schema version {version}, newer than this "
                    f"dataflow's {SCHEMA_VERSION}: upgrade dataflow to read it"
                )
            if not self.read_only:
                self._backend.check_seqs(conn)

    # -- writing (used by Producer and Consumer) -----------------------------
    @contextlib.contextmanager
    def write(
        self, run_id: str, what: str, *, shared: bool = False, consumers: bool = False
    ) -> Iterator[WriteTransaction]:
        """An append transaction holding ``run_id``'s write lock; commits on success.

        ``shared=True``: the lock is shared with other shared writers of the run,
        which append at the same time (on PostgreSQL; SQLite has one writer at a
        time). For a producer's commits of first revisions and its close, whose
        checks the database makes exactly however producers interleave: the commit
        index skips a sample committed meanwhile, and the producer's epoch is read
        inside the transaction (a claim holds the lock alone). Not for a write that
        decides from the run's state (a lease, an ack, a resume; a claim, or a next
        revision, read from what the transaction reads): such a write holds the
        lock alone (the default), waiting for the shared writers in flight, and
        reads the run's exact state. ``consumers=True``: a consumer's write, which
        reads the run's exact state too (below its own events), and on PostgreSQL
        waits only for the run's writes that began before it: producers go on
        beside it (``_postgres.py``).

        A failure while committing raises CommitOutcomeUnknownError: the database
        may have committed before the connection failed, so the caller cannot
        take the write as undone.
        """
        _check_run_id(run_id)
        self._check_writable(f"write ({what}) in run {run_id!r}")
        started = time.perf_counter()
        committing = False
        try:
            with (
                translate_errors(f"{what} in run {run_id!r}"),
                self._engine.connect().execution_options(**write_options()) as conn,
                conn.begin(),
            ):
                epoch, first_seq = self._backend.lock_run(
                    conn, run_id, shared=shared, consumers=consumers
                )
                yield WriteTransaction(conn, run_id, epoch, first_seq=first_seq, shared=shared)
                committing = True  # leaving the block commits
        except LedgerError as exc:
            if not committing:
                raise
            raise CommitOutcomeUnknownError(
                f"{exc} (while committing: the write may or may not be in the ledger; read it "
                "back before writing it again)"
            ) from exc
        # Committed: what a writer waited, lock included (RunMetrics' dataflow_append_seconds).
        if _observers.observers:
            _observers.notify(self.url, run_id, what, time.perf_counter() - started)

    # -- reading -------------------------------------------------------------
    def rows(
        self, run_id: str, *, after_seq: int = 0, upto_seq: int | None = None
    ) -> Iterator[Row[Any]]:
        """Raw event rows of a run in seq order, in constant memory (keyset pages).

        Only rows that no transaction still running can add to: none ever appears
        later below the last seq read (on PostgreSQL, the rows below the horizon of
        the transactions still running, see ``_postgres.py``).
        """
        _check_run_id(run_id)
        _check_seq("after_seq", after_seq)
        _check_seq("upto_seq", upto_seq, optional=True)
        cursor = after_seq
        statement = tail_statement(
            self._engine.dialect, "page_after" if upto_seq is None else "page_between"
        )
        while True:
            with self._reading(run_id) as conn:
                # Plain driver tuples, not Rows: the GC untracks tuples of
                # scalars, while a page of Rows survives into the old
                # generation and triggers full collections of the whole heap.
                page = run_sql(
                    conn, statement, run_id=run_id, after=cursor, upto=upto_seq, limit=_PAGE
                ).cursor.fetchall()
            yield from page
            if len(page) < _PAGE:
                return
            cursor = page[-1][0]

    def events(
        self, run_id: str, *, after_seq: int = 0, upto_seq: int | None = None
    ) -> Iterator[Event]:
        """The run's events with ``after_seq < seq <= upto_seq``, oldest first."""
        for seq, kind, sample_id, revision, epoch, step, actor, payload, ts in self.rows(
            run_id, after_seq=after_seq, upto_seq=upto_seq
        ):
            yield Event(
                seq,
                run_id,
                kind,
                sample_id,
                epoch,
                step,
                actor,
                load_payload(payload),
                ts,
                revision,
            )

    def follow(
        self,
        run_id: str,
        after_seq: int = 0,
        *,
        poll_interval: float = 0.05,
        timeout: float | None = None,
    ) -> Iterator[Event]:
        """Tail a run live: yield every event after ``after_seq`` as it commits.

        Never skips an event: it reads only seqs below which no event can still
        appear (see :meth:`rows`). Stops after ``timeout`` seconds without a new event
        (None: never stops; close the generator to stop).
        """
        _check_seq("after_seq", after_seq)
        for name, value in (("poll_interval", poll_interval), ("timeout", timeout)):
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0
            ):
                raise InvalidArgumentError(f"{name} must be a non-negative number, got {value!r}")
        if poll_interval is None or poll_interval > _MAX_POLL_S:  # time.sleep overflows
            raise InvalidArgumentError(
                f"poll_interval must be a number of seconds from 0 to {_MAX_POLL_S:g}, "
                f"got {poll_interval!r}"
            )
        last = after_seq
        idle_since = time.monotonic()
        while True:
            got = False
            for event in self.events(run_id, after_seq=last):
                got = True
                last = event.seq
                yield event
            if got:
                idle_since = time.monotonic()
            elif timeout is not None and time.monotonic() - idle_since >= timeout:
                return
            else:
                time.sleep(poll_interval)

    def commits(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """(newest revision, its ref JSON) for each of ``sample_ids`` committed in the run."""
        _check_run_id(run_id)
        if isinstance(sample_ids, str):
            raise ArgumentTypeError(f"sample_ids must be a list of ids, not the str {sample_ids!r}")
        with self._reading(run_id) as conn:
            return newest_commits(conn, run_id, list(sample_ids))

    def commit_payloads(self, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
        """The ref JSON committed for each ``sample_id: revision`` (ids not found are left out).

        What a RunState that keeps only its live refs in memory reads the others from.
        """
        _check_run_id(run_id)
        with self._reading(run_id) as conn:
            return commit_payloads(conn, run_id, revisions)

    # -- snapshots -------------------------------------------------------------
    def save_snapshot(self, run_id: str, state: Any, *, keep: int = 2) -> bool:
        """Store ``state`` (a RunState) as the run's snapshot at its ``head_seq``; keep the
        newest ``keep``.

        A snapshot is a cache of a replay: restarts and ``replay`` read the newest
        valid one and fold only the events after it. False when the ledger is of an
        older schema opened read-only, or holds a snapshot at that seq already.
        The body is the model's snapshot codec's (:mod:`dataflow.model._snapshot`).
        """
        _check_run_id(run_id)
        _snapshot.check_state(state)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(
                f"keep must be an int >= 1 (the snapshot just saved counts), got {keep!r}"
            )
        if state.run_id != run_id:
            raise InvalidArgumentError(f"the state is of run {state.run_id!r}, not {run_id!r}")
        self._check_writable(f"save a snapshot of run {run_id!r}")
        if (self._schema_version or SCHEMA_VERSION) < 2 or state.head_seq == 0:
            return False
        seq, body = state.head_seq, _snapshot.encode(state)
        digest = _snapshot.digest(body)
        with (
            translate_errors(f"snapshotting run {run_id!r}"),
            self._engine.connect().execution_options(**write_options()) as conn,
            conn.begin(),
        ):
            return write_snapshot(conn, run_id, seq, body, digest, _snapshot.FORMAT, keep)

    def load_snapshot(self, run_id: str, *, upto_seq: int | None = None) -> Any:
        """The run's newest valid snapshot at or before ``upto_seq``, as a RunState; None if none.

        A snapshot whose digest or body is bad is skipped with a warning (the
        caller then folds from an older one, or from the start); one of another
        format (an older dataflow) is skipped quietly.
        """
        _check_run_id(run_id)
        _check_seq("upto_seq", upto_seq, optional=True)
        if (self._schema_version or SCHEMA_VERSION) < 2:
            return None
        for seq, digest, body in stored_snapshots(
            functools.partial(self._reading, run_id), run_id, format_=_snapshot.FORMAT,
            upto_seq=upto_seq,
        ):  # fmt: skip
            why = None
            if body is None or _snapshot.digest(body) != digest:
                why = "its digest does not match its body"
            else:
                try:
                    state = _snapshot.decode(run_id, body, ref_source=self)
                except (
                    ValueError, KeyError, TypeError, IndexError, AttributeError,
                    OverflowError, RecursionError, struct.error, zlib.error,
                ) as exc:  # fmt: skip
                    why = f"it cannot be read ({type(exc).__name__}: {str(exc)[:120]})"
                else:
                    if state.head_seq == seq:
                        return state
                    why = f"it covers seq {state.head_seq}, not the {seq} it is filed under"
            warnings.warn(
                f"snapshot of run {run_id!r} at seq {seq} in {self.safe_url} is skipped: {why}; "
                "folding from an older snapshot or the start of the log instead",
                stacklevel=2,
            )
        return None

    @contextlib.contextmanager
    def _reading(self, run_id: str) -> Iterator[Connection]:
        """A connection to read ``run_id`` through, its errors translated."""
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            yield conn

    def released_revision(self, run_id: str, sample_id: str) -> int | None:
        """Highest revision of ``sample_id`` whose features were released, if any."""
        _check_run_id(run_id)
        with self._reading(run_id) as conn:
            return released_revision(conn, run_id, sample_id)

    def head_seq(self, run_id: str) -> int:
        """The seq of the run's newest event (0 when it has none)."""
        _check_run_id(run_id)
        with self._reading(run_id) as conn:
            return (
                conn.execute(
                    select(func.max(events.c.seq)).where(events.c.run_id == run_id)
                ).scalar()
                or 0
            )

    def unseen_rows(self, run_id: str, *, limit: int = 20) -> list[tuple[int, str, str | None]]:
        """(seq, kind, sample id) of up to ``limit`` events of the run that no fold reads: a
        seq below 1, which only a hand-edited or damaged row has."""
        _check_run_id(run_id)
        with self._reading(run_id) as conn:
            return [tuple(r) for r in run_sql(conn, "unseen_rows", run_id=run_id, limit=limit)]

    def kind_counts(
        self, run_id: str, *, upto_seq: int | None = None, by_sample: bool = False
    ) -> dict[str, int]:
        """How many events of each kind the run holds (with ``seq <= upto_seq``); with
        ``by_sample``, a batch row counts once for each sample it names."""
        _check_run_id(run_id)
        _check_seq("upto_seq", upto_seq, optional=True)
        query = select(events.c.kind, func.count()).where(events.c.run_id == run_id)
        if upto_seq is not None:
            query = query.where(events.c.seq <= upto_seq)
        with self._reading(run_id) as conn:
            counts = {kind: count for kind, count in conn.execute(query.group_by(events.c.kind))}
            if by_sample:
                for kind, extra in batch_sample_counts(conn, run_id, upto_seq).items():
                    counts[kind] += extra
            return counts

    def runs(self) -> list[str]:
        """Every run id this ledger holds (in its runs table or in its events), sorted."""
        with translate_errors("listing runs"), self._engine.connect() as conn:
            listed = set(conn.execute(select(runs_table.c.run_id)).scalars())
            return sorted(listed.union(conn.exec_driver_sql(EVENT_RUN_IDS).scalars()))

    def unlisted_runs(self) -> list[str]:
        """The runs with events but no row in the runs table (deleted by hand): the next
        write to such a run restores its row, at the newest epoch its events name."""
        with translate_errors("listing runs"), self._engine.connect() as conn:
            listed = set(conn.execute(select(runs_table.c.run_id)).scalars())
            return sorted(set(conn.exec_driver_sql(EVENT_RUN_IDS).scalars()) - listed)

    def clock(self) -> float:
        """Now, in seconds since the epoch, on the clock that stamps this ledger's events:
        the PostgreSQL server's (read from it), or this machine's for SQLite. Compare an
        event's ``ts`` with this, never with the local ``time.time()`` of another host."""
        with translate_errors("reading the ledger's clock"), self._engine.connect() as conn:
            return read_clock(conn)

    def close(self) -> None:
        """Close every pooled connection; the ledger can be reopened with Ledger.open."""
        self._engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
