"""``dataflow status``: a run's in-flight work, lag and rates, once or refreshed live."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from dataflow.cli._arguments import (
    MAX_SEQ,
    add_command,
    add_ledger_and_run,
    int_in,
    positive_seconds,
)
from dataflow.cli._ledger import check_run, open_ledger
from dataflow.tools._printing import print_status, progress_bar
from dataflow.tools._run_fold import RunFold
from dataflow.tools._status import status


def add_status(sub: Any) -> None:
    """The ``status`` subcommand."""
    p = add_command(sub, "status", cmd_status, help="a run's in-flight work, lag and rates, live")
    add_ledger_and_run(p)
    p.add_argument("--follow", action="store_true", help="refresh until Ctrl-C")
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=2.0,
        help="with --follow: seconds between refreshes (default 2)",
    )
    p.add_argument(
        "--count",
        type=int_in(1, MAX_SEQ, "refreshes"),
        default=None,
        metavar="N",
        help="with --follow: stop after N refreshes",
    )
    p.add_argument(
        "--window",
        type=positive_seconds,
        default=60.0,
        help="rates count the events of the last WINDOW seconds (default 60)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one line per refresh)")


def cmd_status(args: argparse.Namespace) -> int:
    if args.count is not None and not args.follow:
        args.parser.error("--count N stops --follow after N refreshes: add --follow")
    ledger = open_ledger(args)
    check_run(ledger, args.run)
    fold = RunFold(ledger, args.run, window=args.window)
    shown = 0
    clear = args.follow and not args.json and sys.stdout.isatty()
    try:
        while True:
            with progress_bar("reading the log", ledger.head_seq(args.run)) as progress:
                fold.update(progress if shown == 0 else None)
            report = status(fold, ledger.clock())  # the clock of the events' ts
            if args.json:
                print(json.dumps(report, indent=None if args.follow else 2), flush=True)
            else:
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                elif shown:
                    print()
                print_status(report)
            shown += 1
            if not args.follow or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        if not args.follow:
            raise
        return 0
