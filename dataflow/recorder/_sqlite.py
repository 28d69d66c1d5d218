"""SQLite specifics of the ledger: WAL, fsync level, writers that lock up front, and a
ledger file that appears whole or not at all."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
import time
import urllib.parse
import uuid
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

from dataflow.interfaces._durable import fsync_path
from dataflow.model._errors import InvalidArgumentError, NotALedgerError, ReadOnlyLedgerError
from dataflow.recorder._db import (
    WRITE_OPTION,
    Backend,
    SQLiteFilesReplaced,
    create_schema,
    write_options,
)
from dataflow.recorder._schema import events, runs, schema_info

#: SQLite's smallest page size: a database file is never shorter.
_MIN_PAGE = 512
_RUN_EPOCH = f"SELECT epoch FROM {runs.name} WHERE run_id = ?"
# A run's row starts at the newest epoch its events name: 0 for a new run, and the
# epoch it had for a run whose row was deleted (so a live consumer is not fenced off).
_NEW_RUN = (
    f"INSERT INTO {runs.name} (run_id, epoch) SELECT ?, COALESCE(MAX(epoch), 0) "
    f"FROM {events.name} WHERE run_id = ? AND kind = 'resume'"
)
#: The files a connection works through, by suffix of the ledger's path.
_FILES = ("", "-wal", "-shm")
_FILE_IDS = "dataflow_file_ids"
#: How long a lock on the ledger without a -shm beside it may last before it is taken for
#: a process that holds deleted files: a process opening or closing the ledger holds one
#: for the moment between its lock and its -shm appearing or going.
_HOLDER_GRACE_S = 2.0
_PROC_LOCKS = "/proc/locks"
#: SQLite's mode for a file beside which no -wal or -shm exists or can be made.
_IMMUTABLE = "ro&immutable=1"
_LOCK_LINE = re.compile(r"\s(-?\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s")


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


def _begin_immediate(dbapi_conn: sqlite3.Connection, timeout_s: float) -> None:
    """BEGIN IMMEDIATE, polling for the write lock every 50 us .. 1 ms until ``timeout_s``.

    SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries: a
    writer that finds the lock held for 2 ms gets it after 8, and on a busy ledger
    (producers committing, every rank leasing and acking) those sleeps were most of a
    lease's or an ack's time. The last try runs with the busy timeout restored, so
    running out of time raises SQLite's own "database is locked".
    """
    deadline = time.monotonic() + timeout_s
    delay = 50e-6
    dbapi_conn.execute("PRAGMA busy_timeout=0")
    try:
        while time.monotonic() + delay < deadline:
            try:
                dbapi_conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorname", None) != "SQLITE_BUSY":
                    raise
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        dbapi_conn.execute(f"PRAGMA busy_timeout={remaining_ms}")
        dbapi_conn.execute("BEGIN IMMEDIATE")
    finally:
        dbapi_conn.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")


def _database_path(url: str) -> str:
    parsed = make_url(url)
    database = parsed.database
    if database in (None, "", ":memory:"):
        raise InvalidArgumentError(
            f"ledger URL {url!r} is an in-memory SQLite database, which no other "
            "connection or process can see; use a file: sqlite:///PATH/ledger.db"
        )
    if parsed.query:
        raise InvalidArgumentError(
            f"ledger URL {url!r} has query parameters {sorted(parsed.query)}; dataflow sets "
            "the SQLite options itself (Ledger.open's durability and busy_timeout): use "
            "sqlite:///PATH/ledger.db"
        )
    return database


def _connect(
    path: str, timeout_s: float, *, create: bool = False, read_only: bool = False
) -> sqlite3.Connection:
    """A connection to ``path``; without ``create`` it never creates the file (``mode=rw``).

    ``read_only``: where the ledger's directory cannot be written, ``mode=ro`` (with
    SQLite's immutable mode if no -wal/-shm is beside it: see ``_read_only_mode``).
    """
    mode = _read_only_mode(path) if read_only else None
    if mode is None:
        mode = "rwc" if create else "rw"
        if not create:
            _refuse_deleted_files_held(path, timeout_s)
    uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode={mode}"
    return sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)


def _read_only_mode(path: str) -> str | None:
    """How a reader must open ``path``: None where its directory can be written.

    There ``mode=rw`` serves, and its close folds the WAL into the file as a writer's
    does (a ``mode=ro`` reader that closes last leaves the -wal and -shm behind); the
    Ledger refuses writes. Elsewhere ``mode=ro`` reads the -wal and -shm beside the file,
    and with none beside it (a backup or snapshot on a read-only mount) SQLite can make
    none and opens the file only in its immutable mode: no locks, no WAL.
    """
    if os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
        return None
    beside = any(os.path.exists(path + suffix) for suffix in ("-wal", "-shm"))
    return "ro" if beside else _IMMUTABLE


def _file_ids(path: str) -> tuple[tuple[int, int] | None, ...]:
    """(st_dev, st_ino) of the ledger's database, -wal and -shm files (None: missing)."""
    ids: list[tuple[int, int] | None] = []
    for suffix in _FILES:
        try:
            st = os.stat(path + suffix)
        except FileNotFoundError:
            ids.append(None)
        else:
            ids.append((st.st_dev, st.st_ino))
    return tuple(ids)


def _check_files_unchanged(path: str, opened: tuple[tuple[int, int] | None, ...]) -> None:
    """Raise SQLiteFilesReplaced unless the paths still name the files the connection opened.

    While any connection is open SQLite itself never deletes the -wal or -shm (the last
    close does, and this one is open), so a change means someone else deleted or replaced
    them: this connection's commits would go where no other process looks, and be lost.
    """
    now = _file_ids(path)
    for suffix, before, after in zip(_FILES, opened, now, strict=True):
        if before is not None and after != before:
            what = "was deleted" if after is None else "was replaced by another file"
            raise SQLiteFilesReplaced(
                f"the ledger's file {path}{suffix} {what} while this connection had it open; "
                "a write through it cannot be durable (other processes would not see it, "
                "and it could be lost when they close), so nothing was written. Stop every "
                "process of this ledger (close, not kill), then open it again"
            )


def _lock_holders(path: str) -> set[int]:
    """Pids holding a POSIX lock on the file at ``path`` (from /proc/locks; Linux)."""
    try:
        st = os.stat(path)
        with open(_PROC_LOCKS) as locks:
            lines = locks.readlines()
    except OSError:
        return set()
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    holders = set()
    for line in lines:
        found = _LOCK_LINE.search(line)
        if found and (int(found[2], 16), int(found[3], 16), int(found[4])) == wanted:
            holders.add(int(found[1]))
    return holders


def _refuse_deleted_files_held(path: str, timeout_s: float) -> None:
    """Raise SQLiteFilesReplaced if a process holds the ledger open but its -shm is gone.

    A connection in WAL mode holds a lock on the database file for as long as it is open,
    and its -shm file stays until the last connection closes. A lock with no -shm beside
    it (for longer than an opening or closing connection takes) is a process whose -wal
    and -shm were deleted under it: a connection opened now would make new ones, and that
    process's close would fold its own WAL over the database and unlink ours, losing
    every commit made through them.
    """
    deadline = time.monotonic() + min(timeout_s, _HOLDER_GRACE_S)
    while not os.path.exists(path + "-shm"):
        holders = _lock_holders(path)
        if not holders:
            return
        if time.monotonic() >= deadline:
            pids = ", ".join(str(pid) for pid in sorted(holders))
            raise SQLiteFilesReplaced(
                f"process(es) {pids} hold the ledger {path} open, but its {path}-shm is gone: "
                "its -wal and -shm files were deleted while they had it open. What they "
                "committed since the last checkpoint is only in those deleted files, and a "
                "-wal made now would be lost when they close. Nothing was opened or "
                f"written: stop every process of this ledger ({pids}; close, not kill: a "
                "clean close folds its WAL into the database), then open it again"
            )
        time.sleep(0.01)


def _check_ledger_file(path: str, timeout_s: float, *, read_only: bool = False) -> None:
    """Raise NotALedgerError unless ``path`` is a SQLite database holding our schema.

    Reads only: a foreign database is not even switched to WAL.
    """
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise NotALedgerError(
            f"ledger path {path} is {kind}; name the ledger's file, e.g. "
            f"sqlite:///{os.path.join(path, 'ledger.db')}"
        )
    # Sizes only: opening the file ourselves and closing it again would drop the POSIX
    # locks of every SQLite connection this process has on it (SQLite's own warning).
    size = os.path.getsize(path)
    if size == 0:
        raise NotALedgerError(
            f"{path} is an empty file (0 bytes), not a ledger; a ledger is never empty, so "
            "this one may have lost its data. It was left as it is: restore it from a "
            "backup, or delete it (or pick another path) to start a new ledger"
        )
    if size < _MIN_PAGE:
        raise NotALedgerError(
            f"{path} is not a SQLite database ({size} bytes, less than one database page), "
            "so it is no ledger. It was left as it is: check the path"
        )
    conn = _connect(path, timeout_s, read_only=read_only)
    try:
        tables = sorted(
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        )
    finally:
        conn.close()
    if schema_info.name not in tables:
        found = f"its tables: {', '.join(tables[:10])}" if tables else "it has no tables"
        raise NotALedgerError(
            f"{path} is a SQLite database but not a dataflow ledger ({found}; no "
            f"{schema_info.name} table). It was left as it is: check the path, or pick "
            "a new file for the ledger"
        )


def _publish(tmp: str, path: str) -> None:
    """Give the finished database ``tmp`` the name ``path``, unless a ledger got there first."""
    try:
        os.link(tmp, path)  # atomic, and never replaces a file
    except FileExistsError:
        return  # another process created the ledger meanwhile: open theirs
    except OSError:
        # A file system without hard links: O_EXCL still never replaces a file,
        # though a concurrent open may see it before it is whole (and is then
        # refused as not a ledger, never handed an empty one).
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "wb") as out, open(tmp, "rb") as src:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)


class SQLiteBackend(Backend):
    name = "sqlite"

    def prepare(self, url: str, *, create: bool, durability: str, busy_timeout_s: float) -> None:
        path = _database_path(url)
        if os.path.lexists(path):
            if not self.read_only and _read_only_mode(path) == _IMMUTABLE:
                raise ReadOnlyLedgerError(
                    f"ledger {path} cannot be opened for writing: its directory cannot be "
                    "written, so SQLite can make no -wal or -shm there (a read-only file "
                    "system or mount?); to read it, open it with Ledger.open(url, "
                    "read_only=True) (the dataflow commands that read do)"
                )
            _check_ledger_file(path, busy_timeout_s, read_only=self.read_only)
            self.immutable = self.read_only and _read_only_mode(path) == _IMMUTABLE
            return
        if not create or self.read_only:
            shown = path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"
            raise NotALedgerError(
                f"no ledger at {shown}: the file does not exist (nothing was created); "
                "check the path"
            )
        # Built under a temporary name and linked into place, so the ledger's
        # path never holds an empty or half-made file: an empty file there
        # always means lost data, never a ledger that another process is
        # still creating.
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.new-{uuid.uuid4().hex[:12]}")
        try:
            engine = self._engine(
                f"sqlite:///{tmp}",
                durability=durability,
                busy_timeout_s=busy_timeout_s,
                create_file=True,
            )
            try:
                with engine.connect().execution_options(**write_options()) as conn, conn.begin():
                    create_schema(conn)
            finally:
                engine.dispose()  # the last close folds the WAL into the file
            fsync_path(tmp)
            _publish(tmp, path)
        finally:
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp + suffix)

    def create_engine(self, url: str, *, durability: str, busy_timeout_s: float) -> Engine:
        return self._engine(url, durability=durability, busy_timeout_s=busy_timeout_s)

    def _engine(
        self, url: str, *, durability: str, busy_timeout_s: float, create_file: bool = False
    ) -> Engine:
        # Our own connect: the ledger's file exists (prepare made sure), and a
        # connection must never create an empty one in its place.
        path = _database_path(url)
        read_only = self.read_only and _read_only_mode(path) is not None
        engine = create_engine(
            url,
            creator=lambda: _connect(path, busy_timeout_s, create=create_file, read_only=read_only),
        )
        synchronous = "FULL" if durability == "full" else "NORMAL"

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, record: Any) -> None:
            # Take transaction control from pysqlite: it would BEGIN lazily and
            # DEFERRED, and two deferred writers that both read first deadlock
            # on the lock upgrade (SQLITE_BUSY, no busy-wait).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            if not read_only:  # a mode=ro connection can switch nothing
                _enable_wal(cur, busy_timeout_s)  # the pragma opens the -wal and -shm
                cur.execute(f"PRAGMA synchronous={synchronous}")
                record.info[_FILE_IDS] = _file_ids(path)
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            if not conn.get_execution_options().get(WRITE_OPTION, False):
                conn.exec_driver_sql("BEGIN")
                return
            dbapi_conn = conn.connection.driver_connection
            _begin_immediate(dbapi_conn, busy_timeout_s)
            opened = conn.connection.info.get(_FILE_IDS)  # None: a mode=ro reader's
            try:
                if opened is not None:
                    _check_files_unchanged(path, opened)
            except SQLiteFilesReplaced:
                dbapi_conn.execute("ROLLBACK")
                raise

        return engine

    def lock_run(
        self, conn: Connection, run_id: str, *, shared: bool = False, consumers: bool = False
    ) -> tuple[int, int | None]:
        # BEGIN IMMEDIATE already holds the database's single write lock, so
        # nobody can add the run between the read and the insert. Plain driver
        # SQL: every append starts here, and building the Core statements cost
        # more than running them. One writer at a time: ``shared`` changes nothing,
        # and the rowids are the seqs.
        epoch = conn.exec_driver_sql(_RUN_EPOCH, (run_id,)).scalar()
        if epoch is not None:
            return int(epoch), None
        conn.exec_driver_sql(_NEW_RUN, (run_id, run_id))
        return int(conn.exec_driver_sql(_RUN_EPOCH, (run_id,)).scalar_one()), None
