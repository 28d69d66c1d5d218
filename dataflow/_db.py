"""Engine set-up per backend, and the one place where driver errors become ours."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

import sqlalchemy.exc as sa_exc
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import make_url

from dataflow._errors import DataflowError, IntegrityError, LedgerError, OperationalError

DEFAULT_URL = "sqlite:///./dataflow.db"
DURABILITY = ("full", "normal")
WRITE_OPTION = "dataflow_write"


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Map SQLAlchemy and driver errors to the dataflow error tree.

    Our own errors pass through untouched; anything else from the database
    becomes IntegrityError or OperationalError naming what was being done.
    """
    try:
        yield
    except DataflowError:
        raise
    except sa_exc.IntegrityError as exc:
        raise IntegrityError(f"{what}: the database refused the write: {exc.orig}") from exc
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError) as exc:
        raise OperationalError(f"{what}: {exc.orig if hasattr(exc, 'orig') else exc}") from exc
    except sa_exc.DBAPIError as exc:
        raise LedgerError(f"{what}: database error: {exc.orig}") from exc
    except sa_exc.SQLAlchemyError as exc:
        raise LedgerError(f"{what}: {exc}") from exc
    except sqlite3.Error as exc:
        raise OperationalError(f"{what}: {exc}") from exc


class Backend:
    """What differs between databases: engine set-up and taking a run's lock."""

    name: str

    def create_engine(self, url: str, *, durability: str, busy_timeout_s: float) -> Engine:
        raise NotImplementedError

    def lock_run(self, conn: Connection, run_id: str) -> int:
        """Create the run's row if missing, lock it for this transaction, return its epoch."""
        raise NotImplementedError

    def lock_schema(self, conn: Connection) -> None:
        """Serialize schema creation between processes opening a fresh database."""


def backend_for(url: str) -> Backend:
    try:
        backend = make_url(url).get_backend_name()
    except sa_exc.ArgumentError as exc:
        raise ValueError(
            f"cannot parse ledger URL {url!r}: use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        ) from exc
    if backend == "sqlite":
        from dataflow._sqlite import SQLiteBackend

        return SQLiteBackend()
    if backend == "postgresql":
        from dataflow._postgres import PostgresBackend

        return PostgresBackend()
    raise ValueError(
        f"unsupported ledger URL {url!r}: use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
    )


def check_durability(durability: str) -> None:
    if durability not in DURABILITY:
        raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")


def write_options() -> dict[str, bool]:
    """Execution options that make a SQLite transaction take the write lock at BEGIN."""
    return {WRITE_OPTION: True}
