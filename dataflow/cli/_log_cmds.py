"""The commands that read a ledger's log as it is: ``runs``, ``events`` and ``export``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dataflow.cli._arguments import (
    LEDGER_HELP,
    SEQ,
    add_command,
    add_ledger_and_run,
    ledger_url,
    output_path,
    seconds,
)
from dataflow.cli._ledger import check_run, known_runs, open_ledger
from dataflow.tools._printing import progress_bar, say


def add_log_commands(sub: Any) -> None:
    """The ``runs``, ``events`` and ``export`` subcommands."""
    p = add_command(sub, "runs", cmd_runs, help="list the runs in a ledger")
    p.add_argument("--ledger", type=ledger_url, default=None, help=LEDGER_HELP)

    p = add_command(sub, "events", cmd_events, help="print a run's events as JSON lines")
    add_ledger_and_run(p)
    p.add_argument("--after", type=SEQ, default=0, help="only events with seq > AFTER")
    p.add_argument("--upto", type=SEQ, default=None, help="only events with seq <= UPTO")
    p.add_argument("--follow", action="store_true", help="keep tailing new events")
    p.add_argument(
        "--timeout", type=seconds, default=None, help="with --follow: stop after idle seconds"
    )

    p = add_command(
        sub,
        "export",
        cmd_export,
        help="write a run's events, and the state of each sample, to Parquet files",
        description="Write a run's events to FILE.parquet and the state of each committed "
        "sample to FILE.samples.parquet.",
    )
    add_ledger_and_run(p)
    parquet = output_path("events.parquet")
    p.add_argument("file", nargs="?", type=parquet, metavar="FILE.parquet", help="output file")
    p.add_argument("--out", type=parquet, default=None, help="the output file, as an option")
    p.add_argument(
        "--no-samples", action="store_true", help="write the events only, not FILE.samples.parquet"
    )


def cmd_runs(args: argparse.Namespace) -> int:
    ledger = open_ledger(args)
    runs = ledger.runs()
    for run_id in runs:
        say(run_id)
    if not runs:
        say(f"dataflow: no runs in {ledger.safe_url}", file=sys.stderr)
    unlisted = ledger.unlisted_runs()
    if unlisted:
        say(
            f"dataflow: warning: {len(unlisted)} runs have events but no row in the runs table "
            f"(deleted by hand?): {', '.join(repr(r) for r in unlisted[:20])}; the next write "
            "to each restores it",
            file=sys.stderr,
        )
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    ledger = open_ledger(args)
    if args.follow:
        if ledger.head_seq(args.run) == 0:
            say(
                f"dataflow: run {args.run!r} has no events in {ledger.safe_url} yet; waiting for "
                f"its first (known runs: {known_runs(ledger)})",
                file=sys.stderr,
                flush=True,
            )
        source = ledger.follow(args.run, args.after, timeout=args.timeout)
    else:
        check_run(ledger, args.run)
        source = ledger.events(args.run, after_seq=args.after, upto_seq=args.upto)
    upto = args.upto
    for event in source:
        if upto is not None and event.seq > upto:  # a run's seqs may skip past it
            break
        print(json.dumps(event.to_dict(), sort_keys=True), flush=True)
        if upto is not None and event.seq >= upto:  # --follow: stop there, not at the next
            break
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dataflow.tools._export import export_parquet, samples_path_for

    if (args.file is None) == (args.out is None):
        args.parser.error(
            "name the file to write once: `dataflow export --run RUN FILE.parquet` "
            "(or --out FILE.parquet)"
        )
    out = args.file or args.out
    samples = None if args.no_samples else samples_path_for(out)
    ledger = open_ledger(args)
    check_run(ledger, args.run)
    with progress_bar("export", ledger.head_seq(args.run)) as progress:
        rows = export_parquet(ledger, args.run, out, samples_path=samples, progress=progress)
    say(f"wrote {rows} events of run {args.run!r} to {out}")
    if samples is not None:
        import pyarrow.parquet as pq

        count = pq.ParquetFile(samples).metadata.num_rows
        say(f"wrote the state of its {count} samples to {samples}")
    return 0
