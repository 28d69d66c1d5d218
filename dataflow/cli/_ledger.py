"""The ledger a command reads: the one its arguments name, opened read-only."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dataflow.cli._arguments import LEDGER_ENV, Failure, ledger_url
from dataflow.model._errors import NotALedgerError


def ledger_source(args: argparse.Namespace) -> tuple[str, str]:
    """The ledger URL to read, and where it came from: --ledger, $DATAFLOW_LEDGER or default."""
    if args.ledger is not None:
        return args.ledger, "--ledger"
    env = os.environ.get(LEDGER_ENV, "").strip()
    if env:
        try:
            ledger_url(env)
        except argparse.ArgumentTypeError as exc:
            args.parser.error(f"{LEDGER_ENV}: {exc}")
        return env, LEDGER_ENV
    from sqlalchemy.engine import make_url

    from dataflow.recorder._db import DEFAULT_URL

    path = make_url(DEFAULT_URL).database or ""
    if not os.path.exists(path):
        args.parser.error(
            f"no ledger at {path} (the default, in {os.getcwd()}): pass --ledger URL "
            f"or set {LEDGER_ENV}"
        )
    return DEFAULT_URL, "default"


def open_ledger(args: argparse.Namespace) -> Any:
    """The ledger the arguments name, read-only: nothing is created or written, a missing
    one is an error, and one on a read-only file system is opened immutable (said on stderr)."""
    from dataflow.recorder._ledger import Ledger

    url, source = ledger_source(args)
    try:
        ledger = Ledger.open(url, create=False, read_only=True)
    except NotALedgerError as exc:
        if source != LEDGER_ENV:
            raise
        raise Failure(f"{exc} (the URL came from ${LEDGER_ENV})") from exc
    if ledger.immutable:
        print(
            f"dataflow: ledger {ledger.safe_url} is on a read-only file system or in a "
            "directory that cannot be written, with no -wal or -shm beside it: opened "
            "read-only and immutable; it must not change while it is read",
            file=sys.stderr,
        )
    return ledger


def known_runs(ledger: Any) -> str:
    known = ledger.runs()
    shown = ", ".join(repr(r) for r in known[:20]) or "none"
    return shown + (f" (and {len(known) - 20} more)" if len(known) > 20 else "")


def check_run(ledger: Any, run_id: str) -> None:
    if ledger.head_seq(run_id) == 0:
        raise Failure(
            f"run {run_id!r} has no events in {ledger.safe_url}; known runs: "
            f"{known_runs(ledger)} (check --run)"
        )
