"""What every ledger backend provides (:class:`Backend`), the schema it creates, and the one
place where driver errors become ours. ``_backends.backend_for`` picks the backend of a URL."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

import sqlalchemy.exc as sa_exc
from sqlalchemy import Connection, Engine, insert, inspect, select, update

from dataflow.model._errors import (
    DataflowError,
    IntegrityError,
    InvalidArgumentError,
    LedgerError,
    LedgerFilesReplacedError,
    NotALedgerError,
    OperationalError,
)
from dataflow.recorder._schema import SCHEMA_VERSION, metadata, schema_info

DEFAULT_URL = "sqlite:///./dataflow.db"
DURABILITY = ("full", "normal")
WRITE_OPTION = "dataflow_write"


class SQLiteFilesReplaced(sqlite3.OperationalError):
    """Raised by the SQLite backend's hooks, as the driver would: a file of the open
    ledger was deleted or replaced. translate_errors makes it LedgerFilesReplacedError."""


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Map SQLAlchemy and driver errors to the dataflow error tree.

    Our own errors pass through untouched; anything else from the database
    becomes IntegrityError or OperationalError naming what was being done,
    and a file that SQLite says is no database becomes NotALedgerError.
    """
    try:
        yield
    except DataflowError:
        raise
    except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
        raise _translated(what, exc) from exc


def _translated(what: str, exc: Exception) -> LedgerError:
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, SQLiteFilesReplaced):
        return LedgerFilesReplacedError(f"{what}: {orig}")
    if getattr(orig, "sqlite_errorname", None) == "SQLITE_NOTADB":
        return NotALedgerError(
            f"{what}: the file is not a SQLite database ({orig}), so it is no ledger; "
            "check the path (the file was left as it is)"
        )
    if isinstance(exc, sa_exc.IntegrityError):
        return IntegrityError(f"{what}: the database refused the write: {orig}")
    if _lock_timed_out(orig):
        return OperationalError(
            f"{what}: {orig}: another connection held the ledger's write lock for longer "
            "than busy_timeout, and this transaction wrote nothing; retry, or open the "
            "ledger with a longer Ledger.open(busy_timeout=...)"
        )
    if _unreachable(exc, orig):
        return OperationalError(
            f"{what}: the ledger is unreachable ({str(orig).strip()}): the connection failed, or "
            "the link stayed silent for longer than the bound that Ledger.open(busy_timeout=...) "
            'sets (docs/reliability.md, "Timeouts"); retry once it answers: a retried commit '
            "of the same samples settles what this one did"
        )
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError)):
        return OperationalError(f"{what}: {orig}")
    if isinstance(exc, sa_exc.DBAPIError):
        return LedgerError(f"{what}: database error: {orig}")
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return LedgerError(f"{what}: {exc}")
    return OperationalError(f"{what}: {exc}")


def _lock_timed_out(orig: object) -> bool:
    """SQLite's busy_timeout, or PostgreSQL's lock_timeout (SQLSTATE 55P03), ran out."""
    return (
        getattr(orig, "sqlite_errorname", None) in ("SQLITE_BUSY", "SQLITE_LOCKED")
        or getattr(orig, "sqlstate", None) == "55P03"
    )


def _unreachable(exc: Exception, orig: object) -> bool:
    """The database server could not be reached or stopped answering.

    An error of the driver's own (psycopg's have no SQLSTATE: the server sent none)
    on connecting, a link that timed out or a connection the pool found dead; not an
    error the server reported.
    """
    if getattr(exc, "connection_invalidated", False):
        return True
    return isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) and (
        getattr(orig, "sqlstate", False) is None
    )


class Backend:
    """What differs between databases: finding or making the ledger, engines, run locks."""

    name: str
    #: Set before ``prepare``: open to read only (create nothing); a SQLite ledger whose
    #: directory cannot be written is opened with SQLite's ``mode=ro`` or immutable.
    read_only: bool = False
    #: Set by ``prepare`` when the ledger was opened in SQLite's immutable mode.
    immutable: bool = False

    def prepare(self, url: str, *, create: bool, durability: str, busy_timeout_s: float) -> None:
        """Before the engine: check that what ``url`` names can hold a ledger.

        With ``create`` a missing ledger may be made; without it nothing is
        created (no file, no directory). Never initializes over an existing
        file that is not a ledger: raise NotALedgerError instead.
        """

    def create_engine(self, url: str, *, durability: str, busy_timeout_s: float) -> Engine:
        raise NotImplementedError

    def lock_run(
        self, conn: Connection, run_id: str, *, shared: bool = False, consumers: bool = False
    ) -> tuple[int, int | None]:
        """Lock the run for this transaction (create its row if missing); its consumer epoch,
        and the first seq of the rows this transaction inserts (None: the database gives
        seqs as it inserts).

        ``shared``: other shared holders of the run append at the same time (the
        producers' commits, see ``Ledger.write``); ``consumers``: one consumer write of
        the run at a time, beside the producers. A backend with a single writer ignores
        both.
        """
        raise NotImplementedError

    def check_seqs(self, conn: Connection) -> None:
        """When a writer opens the ledger: refuse one whose existing seqs the seqs of new
        events would not sort after."""

    def lock_schema(self, conn: Connection) -> None:
        """Serialize schema creation between processes opening a fresh database."""


def create_schema(conn: Connection) -> None:
    """Create every ledger table that is missing, record the version once, migrate older ones."""
    version = (
        conn.execute(select(schema_info.c.version)).scalar()
        if inspect(conn).has_table(schema_info.name)
        else None
    )
    metadata.create_all(conn)
    if version is None:
        conn.execute(insert(schema_info).values(id=1, version=SCHEMA_VERSION))
    elif version < SCHEMA_VERSION:
        _migrate(conn, version)


def _migrate(conn: Connection, version: int) -> None:
    """Bring a ledger of an older schema ``version`` to SCHEMA_VERSION, step by step.

    Runs in the opening transaction, under the schema lock: all steps or none.
    """
    steps = {
        1: lambda: None,  # 1 -> 2: create_all made the snapshots table; events are unchanged
        # 2 -> 3: create_all made the producers table, empty: a producer of an older
        # ledger never claimed its id (its rows carry epoch 0); its next start claims 1.
        2: lambda: None,
        # 3 -> 4: no table changes: the version tells older readers (which refuse a newer
        # version) that batch rows may follow; the rows already there stay as they are.
        3: lambda: None,
    }
    while version < SCHEMA_VERSION:
        steps[version]()
        version += 1
    conn.execute(update(schema_info).where(schema_info.c.id == 1).values(version=version))


def check_durability(durability: str) -> None:
    if durability not in DURABILITY:
        raise InvalidArgumentError(f"durability must be one of {DURABILITY}, got {durability!r}")


def write_options() -> dict[str, bool]:
    """Execution options that make a SQLite transaction take the write lock at BEGIN."""
    return {WRITE_OPTION: True}
