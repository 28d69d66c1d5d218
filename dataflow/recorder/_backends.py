"""The backend of a ledger URL: SQLite or PostgreSQL."""

from __future__ import annotations

import re

import sqlalchemy.exc as sa_exc
from sqlalchemy.engine import make_url

from dataflow.model._errors import InvalidArgumentError
from dataflow.recorder._db import Backend
from dataflow.recorder._postgres import PostgresBackend
from dataflow.recorder._sqlite import SQLiteBackend

_BACKENDS: dict[str, type[Backend]] = {"sqlite": SQLiteBackend, "postgresql": PostgresBackend}


def backend_for(url: str) -> Backend:
    """A fresh backend for ``url``; InvalidArgumentError for a URL that names none."""
    try:
        name = make_url(url).get_backend_name()
    except (sa_exc.ArgumentError, ValueError) as exc:  # ValueError: e.g. a bad port
        raise InvalidArgumentError(
            f"cannot parse ledger URL {_masked(url)!r} ({exc}): use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        ) from None
    backend = _BACKENDS.get(name)
    if backend is None:
        raise InvalidArgumentError(
            f"unsupported ledger URL {_masked(url)!r}: use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        )
    return backend()


def _masked(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part (if any) hidden."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
