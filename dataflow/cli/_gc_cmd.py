"""``dataflow gc``: remove stored features that no committed event keeps alive."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from dataflow.cli._arguments import Failure, add_command, add_ledger_and_run, seconds
from dataflow.cli._ledger import check_run, open_ledger
from dataflow.tools._printing import say


def add_gc(sub: Any) -> None:
    """The ``gc`` subcommand."""
    p = add_command(
        sub,
        "gc",
        cmd_gc,
        help="remove stored features that no committed event of the ledger keeps alive",
    )
    add_ledger_and_run(p)
    p.add_argument(
        "--store",
        default=None,
        help="URI of the store to collect (dir://..., mooncake://...?admin=...); default: "
        "every store the run's producers recorded when they started",
    )
    p.add_argument(
        "--grace",
        type=seconds,
        default=300.0,
        help="leave alone what was put in the last GRACE seconds (default 300)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_gc(args: argparse.Namespace) -> int:
    import dataclasses

    from dataflow.tools._gc import collect_garbage

    ledger = open_ledger(args)
    check_run(ledger, args.run)
    for uri in [args.store] if args.store is not None else _recorded_stores(ledger, args.run):
        store = _open_store(uri)
        try:
            report = collect_garbage(ledger, store, grace=args.grace, dry_run=args.dry_run)
        finally:
            store.close()
        if args.json:
            print(json.dumps({"store": uri} | dataclasses.asdict(report)))
        else:
            verb = "would remove" if report.dry_run else "removed"
            say(
                f"{verb} {report.removed} stored generations ({report.bytes} bytes) from "
                f"{uri}; kept {report.kept} the ledger references and {report.young} "
                f"younger than {args.grace:g} s"
            )
    return 0


def _recorded_stores(ledger: Any, run_id: str) -> list[str]:
    """Every store the run's producers claimed to write to (``--store`` not given)."""
    from dataflow.live._replay import replay

    uris = list(replay(ledger, run_id).store_uris)
    if not uris:
        raise Failure(
            f"run {run_id!r} records no store (its producers predate producer claims, "
            "schema 3): name it with --store URI"
        )
    return uris


def _open_store(uri: str) -> Any:
    """The store at ``uri``; a shared directory must already exist (gc creates nothing)."""
    from urllib.parse import unquote, urlsplit

    from stores import open_store

    parts = urlsplit(uri)
    if parts.scheme == "dir" and not parts.netloc:  # dir://x/y: the store says what is wrong
        root = unquote(parts.path)
        if not os.path.isdir(root):
            raise Failure(f"no shared-directory store at {root} (check --store)")
        if not os.path.isdir(os.path.join(root, "samples")):  # opening it would lay one out
            raise Failure(
                f"{root} is no shared-directory store: it has no samples/ (check --store)"
            )
    if parts.scheme == "mem":
        raise Failure(
            f"{uri} is an in-process store: it lives in the process that made it, and no other "
            "process can collect it (name a shared-directory or Mooncake store)"
        )
    return open_store(uri)
