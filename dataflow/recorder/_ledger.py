"""The ledger: an append-only event log per run, in SQLite or PostgreSQL."""

from __future__ import annotations

import contextlib
import functools
import math
import struct
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import (
    Connection,
    CursorResult,
    Row,
    bindparam,
    delete,
    func,
    insert,
    inspect,
    literal_column,
    select,
    update,
)
from sqlalchemy.engine import make_url

from dataflow.model import _snapshot
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    CorruptLedgerError,
    InvalidArgumentError,
    InvalidIdError,
    LedgerError,
    NotALedgerError,
    ProducerFencedError,
    ReadOnlyLedgerError,
    SchemaVersionError,
    StaleEpochError,
)
from dataflow.model._events import Event, Kind, check_payload, load_payload
from dataflow.recorder._db import (
    DEFAULT_URL,
    backend_for,
    check_durability,
    create_schema,
    translate_errors,
    write_options,
)
from dataflow.recorder._schema import SCHEMA_VERSION, events, producers, schema_info, snapshots

if TYPE_CHECKING:
    from dataflow.model._fold import RunState
from dataflow.recorder._schema import runs as runs_table

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
_PAGE = 5000
_T = TypeVar("_T")
_MAX_POLL_S = 3600.0


def _per_dialect(build: Callable[..., _T]) -> Callable[..., _T]:
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


@_per_dialect
def _driver_sql(dialect: Any, statement: str) -> tuple[str, tuple[str, ...] | None, dict[str, Any]]:
    """``_STATEMENTS[statement]`` compiled once for ``dialect``: its SQL text, the order of
    its parameters when the driver takes them by position (None: by name), and the values
    the statement itself binds (a LIMIT)."""
    compiled = _STATEMENTS[statement]().compile(dialect=dialect)
    order = tuple(compiled.positiontup) if compiled.positional else None  # type: ignore[arg-type]
    return str(compiled), order, dict(compiled.params)


def _run_sql(conn: Connection, statement: str, **params: Any) -> CursorResult[Any]:
    """Run a statement of the hot paths (a lease, an ack, a catch-up read) as driver SQL.

    Building a Core statement and its cache key took longer than SQLite took to run
    it; the same statement with bound parameters, compiled once, runs in a fraction.
    """
    sql, order, bound = _driver_sql(conn.dialect, statement)
    values = {**bound, **params}
    if order is None:
        return conn.exec_driver_sql(sql, {key: values[key] for key in bound})
    return conn.exec_driver_sql(sql, tuple(values[key] for key in order))


def _rows_after() -> Any:
    return (
        select(*ROW_COLUMNS)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq > bindparam("after"))
        .order_by(events.c.seq)
    )


def _page_after() -> Any:
    return _rows_after().limit(_PAGE)


def _page_between() -> Any:
    return _page_after().where(events.c.seq <= bindparam("upto"))


def _seq_above(last_inserted: str) -> Callable[[], Any]:
    """The run's highest seq above the seq of the row this connection inserted last."""
    return lambda: (
        select(events.c.seq)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq > literal_column(last_inserted))
        .order_by(events.c.seq.desc())
        .limit(1)
    )


def _producer_epoch() -> Any:
    return select(producers.c.epoch).where(
        producers.c.run_id == bindparam("run_id"),
        producers.c.producer_id == bindparam("producer_id"),
    )


_STATEMENTS = {
    "rows_after": _rows_after,
    "page_after": _page_after,
    "page_between": _page_between,
    "seq_above_rowid": _seq_above("last_insert_rowid()"),
    "seq_above_lastval": _seq_above("lastval()"),
    "unseen_rows": lambda: (
        select(events.c.seq, events.c.kind, events.c.sample_id)
        .where(events.c.run_id == bindparam("run_id"), events.c.seq <= 0)
        .order_by(events.c.seq)
        .limit(bindparam("limit"))
    ),
    "producer_epoch": _producer_epoch,
}
# Each run id of the events once, one index probe per run (a skip scan; SQLite and
# PostgreSQL both read DISTINCT as a scan of every event).
_EVENT_RUN_IDS = f"""
WITH RECURSIVE r(run_id) AS (
    SELECT MIN(run_id) FROM {events.name}
    UNION ALL
    SELECT (SELECT MIN(e.run_id) FROM {events.name} e WHERE e.run_id > r.run_id)
    FROM r WHERE r.run_id IS NOT NULL
)
SELECT run_id FROM r WHERE run_id IS NOT NULL
"""
_SEQ_ABOVE_INSERT = {"sqlite": "seq_above_rowid", "postgresql": "seq_above_lastval"}


MAX_ID_LENGTH = 256


def check_id(name: str, value: object) -> str:
    """Return ``value`` if it is a valid run, producer or consumer id, else raise InvalidIdError.

    A valid id is a str of 1 to 256 printable characters (``str.isprintable``:
    letters, digits, punctuation and spaces of any script) that does not
    start or end with whitespace. Control characters (NUL, tab, newline,
    DEL ...) and other invisible ones are refused.
    """
    if not isinstance(value, str):
        raise InvalidIdError(
            f"{name} must be a str of 1 to {MAX_ID_LENGTH} printable characters, "
            f"got {value!r} ({type(value).__name__})"
        )
    if not 0 < len(value) <= MAX_ID_LENGTH:
        shown = repr(value) if len(value) <= 40 else f"{len(value)} characters: {value[:40]!r}..."
        raise InvalidIdError(
            f"{name} must be a str of 1 to {MAX_ID_LENGTH} printable characters (at most "
            f"{MAX_ID_LENGTH}), got {shown}"
        )
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise InvalidIdError(
            f"{name} {value!r} holds the control or invisible character {bad!r} at position "
            f"{value.index(bad)}; ids are 1 to {MAX_ID_LENGTH} printable characters: "
            "remove or replace it"
        )
    if value != value.strip():
        raise InvalidIdError(
            f"{name} {value!r} starts or ends with whitespace; strip it (ids are compared "
            "exactly, and an outer space is invisible when printed)"
        )
    return value


def _check_run_id(run_id: object) -> str:
    return check_id("run_id", run_id)


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


def _newest_commits(
    conn: Connection, run_id: str, sample_ids: Sequence[str]
) -> dict[str, tuple[int, str]]:
    found: dict[str, tuple[int, str]] = {}
    for start in range(0, len(sample_ids), 900):
        chunk = list(dict.fromkeys(sample_ids[start : start + 900]))
        stmt = select(events.c.sample_id, events.c.revision, events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind == Kind.COMMIT,
            events.c.revision.isnot(None),  # lets the planner use the partial commit index
            events.c.sample_id.in_(chunk),
            events.c.seq > 0,  # what no fold reads is no commit (see _refuse_unseen_commits)
        )
        for sample_id, revision, payload in conn.execute(stmt):
            if sample_id not in found or revision > found[sample_id][0]:
                found[sample_id] = (revision, payload)
    return found


def _refuse_unseen_commits(conn: Connection, run_id: str, sample_ids: Sequence[str]) -> None:
    """CorruptLedgerError when a row no fold reads (a seq <= 0, or a revision on an event
    that is no commit) holds the commit index for one of ``sample_ids``: skipping those
    commits would leave the samples untrained while the producer is told they were."""
    for start in range(0, len(sample_ids), 900):
        found = conn.execute(
            select(events.c.seq, events.c.kind, events.c.sample_id)
            .where(
                events.c.run_id == run_id,
                events.c.revision.isnot(None),
                events.c.sample_id.in_(sample_ids[start : start + 900]),
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


def _commit_payloads(conn: Connection, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
    """The ref JSON of exactly ``revisions[sample_id]`` for each id (the commit index's key)."""
    found: dict[str, str] = {}
    ids = list(revisions)
    for start in range(0, len(ids), 900):
        stmt = select(events.c.sample_id, events.c.revision, events.c.payload).where(
            events.c.run_id == run_id,
            events.c.kind == Kind.COMMIT,
            events.c.revision.isnot(None),
            events.c.sample_id.in_(ids[start : start + 900]),
        )
        for sample_id, revision, payload in conn.execute(stmt):
            if revisions[sample_id] == revision:
                found[sample_id] = payload
    return found


def _released_revision(conn: Connection, run_id: str, sample_id: str) -> int | None:
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


MAX_SEQ = 2**63 - 1


def _check_seq(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ:
        raise InvalidArgumentError(
            f"{name} must be an int from 0 to 2**63-1 (a seq), got {value!r}"
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
        row = _run_sql(
            self.conn, "producer_epoch", run_id=self.run_id, producer_id=producer_id
        ).cursor.fetchone()
        return None if row is None else row[0]

    def set_epoch(self, epoch: int) -> None:
        self.conn.execute(
            update(runs_table).where(runs_table.c.run_id == self.run_id).values(epoch=epoch)
        )
        self.epoch = epoch

    def rows_after(self, seq: int) -> list[Any]:
        return _run_sql(self.conn, "rows_after", run_id=self.run_id, after=seq).fetchall()

    def commits(self, sample_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """(newest revision, its ref JSON) per committed id among ``sample_ids``."""
        return _newest_commits(self.conn, self.run_id, sample_ids)

    def released_revision(self, sample_id: str) -> int | None:
        """Highest revision of ``sample_id`` whose features were released, if any."""
        return _released_revision(self.conn, self.run_id, sample_id)

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
        _refuse_unseen_commits(self.conn, run_id, held)
        return _newest_commits(self.conn, run_id, held)

    def _insert(self, rows: list[tuple[Any, ...]], *, skip_held_commits: bool) -> int:
        """Insert ``rows``; the number inserted (short when commits were skipped)."""
        sql, positional = _insert_sql(self.conn.dialect, skip_held_commits)
        params: list[Any] = rows
        if not positional:
            params = [dict(zip(_INSERT_KEYS, row, strict=True)) for row in rows]
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
        above = _run_sql(self.conn, _SEQ_ABOVE_INSERT[self.conn.dialect.name], run_id=self.run_id)
        seq = above.scalar()
        if seq is not None:
            raise CorruptLedgerError(
                f"run {self.run_id!r} holds an event with seq {seq}, above the seq the ledger "
                "gives new events: what is appended would sort before it, where no live fold "
                "reads it (a hand-edited or damaged row). Nothing was written; restore the "
                "ledger from a backup, or delete or renumber that row"
            )


_INSERT_KEYS = (
    "run_id", "kind", "sample_id", "revision", "epoch", "step", "actor", "payload", "ts",
)  # fmt: skip


@_per_dialect
def _insert_sql(dialect: Any, skip_held_commits: bool) -> tuple[str, bool]:
    """The INSERT of an event row for ``dialect``, and whether its parameters are positional.

    ``skip_held_commits``: a commit whose (run, sample, revision) is held already
    is left out (``ON CONFLICT ... DO NOTHING`` on the commit index) instead of
    failing the transaction. On PostgreSQL a row left out still takes a seq from
    the sequence; nothing reads seq as contiguous (it is global to the ledger, so
    a run's seqs skip the other runs' events anyway, and a rolled-back
    transaction leaves gaps too): folds, snapshots, ``follow`` and ``--upto``
    only compare seqs.
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
    # inline(): no RETURNING seq on PostgreSQL, which executemany would only discard.
    compiled = stmt.inline().compile(dialect=dialect, column_keys=list(_INSERT_KEYS))
    if compiled.positional:
        assert tuple(compiled.positiontup) == _INSERT_KEYS, compiled.positiontup
    return str(compiled), bool(compiled.positional)


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

    # -- writing (used by Producer and Consumer) -----------------------------
    @contextlib.contextmanager
    def write(self, run_id: str, what: str) -> Iterator[WriteTransaction]:
        """An append transaction holding ``run_id``'s write lock; commits on success.

        A failure while committing raises CommitOutcomeUnknownError: the database
        may have committed before the connection failed, so the caller cannot
        take the write as undone.
        """
        from dataflow.live._metrics import observe_append  # cached after the first; no prometheus

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
                epoch = self._backend.lock_run(conn, run_id)
                yield WriteTransaction(conn, run_id, epoch)
                committing = True  # leaving the block commits
        except LedgerError as exc:
            if not committing:
                raise
            raise CommitOutcomeUnknownError(
                f"{exc} (while committing: the write may or may not be in the ledger; read it "
                "back before writing it again)"
            ) from exc
        # Committed: what a writer waited, lock included (RunMetrics' dataflow_append_seconds).
        observe_append(self.url, run_id, what, time.perf_counter() - started)

    # -- reading -------------------------------------------------------------
    def rows(
        self, run_id: str, *, after_seq: int = 0, upto_seq: int | None = None
    ) -> Iterator[Row[Any]]:
        """Raw event rows of a run in seq order, in constant memory (keyset pages)."""
        _check_run_id(run_id)
        _check_seq("after_seq", after_seq)
        _check_seq("upto_seq", upto_seq, optional=True)
        cursor = after_seq
        statement = "page_after" if upto_seq is None else "page_between"
        while True:
            with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
                # Plain driver tuples, not Rows: the GC untracks tuples of
                # scalars, while a page of Rows survives into the old
                # generation and triggers full collections of the whole heap.
                page = _run_sql(
                    conn, statement, run_id=run_id, after=cursor, upto=upto_seq
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

        Never skips an event (appends are serialized per run, so seq order is
        commit order). Stops after ``timeout`` seconds without a new event
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
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            return _newest_commits(conn, run_id, list(sample_ids))

    def commit_payloads(self, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
        """The ref JSON committed for each ``sample_id: revision`` (ids not found are left out).

        What a RunState that keeps only its live refs in memory reads the others from.
        """
        _check_run_id(run_id)
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            return _commit_payloads(conn, run_id, revisions)

    # -- snapshots -------------------------------------------------------------
    def save_snapshot(self, run_id: str, state: RunState, *, keep: int = 2) -> bool:
        """Store ``state`` as the run's snapshot at its ``head_seq``; keep the newest ``keep``.

        A snapshot is a cache of a replay: restarts and ``replay`` read the newest
        valid one and fold only the events after it. False when the ledger is of an
        older schema opened read-only, or holds a snapshot at that seq already.
        """
        _check_run_id(run_id)
        from dataflow.model._fold import RunState

        if not isinstance(state, RunState):
            raise ArgumentTypeError(f"state must be a RunState, got {type(state).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(
                f"keep must be an int >= 1 (the snapshot just saved counts), got {keep!r}"
            )
        if state.run_id != run_id:
            raise InvalidArgumentError(f"the state is of run {state.run_id!r}, not {run_id!r}")
        self._check_writable(f"save a snapshot of run {run_id!r}")
        if (self._schema_version or SCHEMA_VERSION) < 2 or state.head_seq == 0:
            return False
        body = _snapshot.encode(state)
        row = {
            "run_id": run_id,
            "seq": state.head_seq,
            "format": _snapshot.FORMAT,
            "digest": _snapshot.digest(body),
            "body": body,
            "ts": time.time(),
        }
        with (
            translate_errors(f"snapshotting run {run_id!r}"),
            self._engine.connect().execution_options(**write_options()) as conn,
            conn.begin(),
        ):
            mine = snapshots.c.run_id == run_id
            if conn.execute(
                select(snapshots.c.seq).where(mine, snapshots.c.seq == state.head_seq)
            ).first():
                return False
            conn.execute(insert(snapshots).values(row))
            kept = (
                conn.execute(
                    select(snapshots.c.seq).where(mine).order_by(snapshots.c.seq.desc()).limit(keep)
                )
                .scalars()
                .all()
            )
            conn.execute(delete(snapshots).where(mine, snapshots.c.seq.not_in(kept)))
        return True

    def load_snapshot(self, run_id: str, *, upto_seq: int | None = None) -> RunState | None:
        """The run's newest valid snapshot at or before ``upto_seq``, as a RunState; None if none.

        A snapshot whose digest or body is bad is skipped with a warning (the
        caller then folds from an older one, or from the start); one of another
        format (an older dataflow) is skipped quietly.
        """
        _check_run_id(run_id)
        _check_seq("upto_seq", upto_seq, optional=True)
        if (self._schema_version or SCHEMA_VERSION) < 2:
            return None
        stmt = select(snapshots.c.seq, snapshots.c.format, snapshots.c.digest).where(
            snapshots.c.run_id == run_id
        )
        if upto_seq is not None:
            stmt = stmt.where(snapshots.c.seq <= upto_seq)
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            found = conn.execute(stmt.order_by(snapshots.c.seq.desc())).all()
        for seq, format_, digest in found:
            if format_ != _snapshot.FORMAT:
                continue
            with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
                body = conn.execute(
                    select(snapshots.c.body).where(
                        snapshots.c.run_id == run_id, snapshots.c.seq == seq
                    )
                ).scalar()
            why = None
            if body is None or _snapshot.digest(bytes(body)) != digest:
                why = "its digest does not match its body"
            else:
                try:
                    state = _snapshot.decode(run_id, bytes(body), ref_source=self)
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

    def released_revision(self, run_id: str, sample_id: str) -> int | None:
        """Highest revision of ``sample_id`` whose features were released, if any."""
        _check_run_id(run_id)
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            return _released_revision(conn, run_id, sample_id)

    def head_seq(self, run_id: str) -> int:
        """The seq of the run's newest event (0 when it has none)."""
        _check_run_id(run_id)
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
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
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            return [tuple(r) for r in _run_sql(conn, "unseen_rows", run_id=run_id, limit=limit)]

    def kind_counts(self, run_id: str, *, upto_seq: int | None = None) -> dict[str, int]:
        """How many events of each kind the run holds (with ``seq <= upto_seq``)."""
        _check_run_id(run_id)
        _check_seq("upto_seq", upto_seq, optional=True)
        query = select(events.c.kind, func.count()).where(events.c.run_id == run_id)
        if upto_seq is not None:
            query = query.where(events.c.seq <= upto_seq)
        with translate_errors(f"reading run {run_id!r}"), self._engine.connect() as conn:
            return {kind: count for kind, count in conn.execute(query.group_by(events.c.kind))}

    def runs(self) -> list[str]:
        """Every run id this ledger holds (in its runs table or in its events), sorted."""
        with translate_errors("listing runs"), self._engine.connect() as conn:
            listed = set(conn.execute(select(runs_table.c.run_id)).scalars())
            return sorted(listed.union(conn.exec_driver_sql(_EVENT_RUN_IDS).scalars()))

    def unlisted_runs(self) -> list[str]:
        """The runs with events but no row in the runs table (deleted by hand): the next
        write to such a run restores its row, at the newest epoch its events name."""
        with translate_errors("listing runs"), self._engine.connect() as conn:
            listed = set(conn.execute(select(runs_table.c.run_id)).scalars())
            return sorted(set(conn.exec_driver_sql(_EVENT_RUN_IDS).scalars()) - listed)

    def close(self) -> None:
        """Close every pooled connection; the ledger can be reopened with Ledger.open."""
        self._engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
