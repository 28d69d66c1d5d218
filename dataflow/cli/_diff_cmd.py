"""``dataflow diff``: compare the final lineages of two runs (committed, trained, order)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dataflow.cli._arguments import (
    Failure,
    Usage,
    add_command,
    add_ledger_and_run,
    ledger_url,
    run_id,
)
from dataflow.cli._ledger import check_run, open_ledger
from dataflow.model._errors import DataflowError
from dataflow.tools._diff import diff_runs
from dataflow.tools._printing import print_diff


def add_diff(sub: Any) -> None:
    """The ``diff`` subcommand."""
    p = add_command(
        sub,
        "diff",
        cmd_diff,
        help="compare the final lineages of two runs: committed, trained, order of training",
        description="Compare what two runs' final lineages committed and trained, and in what "
        "order (step, rank, sample). Exit 0 when the trained sets and orders are the same, "
        "1 when they differ, 2 on bad input (an unknown run, a ledger that cannot be read).",
    )
    add_ledger_and_run(p)
    p.add_argument("--other-run", type=run_id, required=True, help="the run to compare with")
    p.add_argument(
        "--other-ledger",
        type=ledger_url,
        default=None,
        help="URL of the ledger of --other-run (default: the --ledger one)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def cmd_diff(args: argparse.Namespace) -> int:
    # Exit 1 means "the runs differ" here, so what the other commands report with 1 (an
    # unknown run, a ledger that cannot be opened) is bad input: exit 2.
    try:
        ledger = open_ledger(args)
        check_run(ledger, args.run)
        other = ledger
        if args.other_ledger is not None:
            other = open_ledger(argparse.Namespace(ledger=args.other_ledger, parser=args.parser))
        check_run(other, args.other_run)
        report = diff_runs(ledger, args.run, args.other_run, other_ledger=other)
    except (Failure, DataflowError, OSError) as exc:
        raise Usage(str(exc)) from exc
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print_diff(report.as_dict())
    return 0 if report.identical else 1
