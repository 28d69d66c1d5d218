"""``dataflow exclude`` and ``dataflow include``: take samples out of a run, or put them back.

They append to the ledger from outside any training process, with the run's current
consumer epoch (so the live ranks are not fenced off), in one transaction checked
against the run's exact state (:func:`dataflow.live._exclusions.write_exclusions`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dataflow.cli._arguments import (
    MAX_SEQ,
    Failure,
    add_command,
    add_ledger_and_run,
    int_in,
    sample_id,
)
from dataflow.cli._ledger import check_run, ledger_source
from dataflow.tools._printing import say


def add_exclusion_commands(sub: Any) -> None:
    """The ``exclude`` and ``include`` subcommands."""
    for name, include in (("exclude", False), ("include", True)):
        verb = "put back into" if include else "take out of"
        p = add_command(
            sub,
            name,
            cmd_include if include else cmd_exclude,
            help=f"{verb} a run samples, with a reason (appends to the ledger)",
            description=(
                "Put excluded samples back into the run (only an exclusion is undone)."
                if include
                else "Take samples out of the run, with a reason: they are never leased "
                "again, whatever checkpoint a later resume starts from."
            ),
        )
        add_ledger_and_run(p)
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--sample", type=sample_id, nargs="+", default=None, metavar="ID", help="sample ids"
        )
        which.add_argument(
            "--from-file",
            default=None,
            metavar="FILE",
            help="a file with one sample id a line (blank lines and # comments skipped; "
            "- reads standard input)",
        )
        if not include:
            which.add_argument(
                "--trained-after",
                type=int_in(0, MAX_SEQ, "a step"),
                default=None,
                metavar="S",
                help="every sample the current lineage trained at a step after S (what a "
                "resume from the checkpoint at S abandons: `replay --plan-resume S` lists "
                "them); run it before that resume",
            )
            p.add_argument(
                "--through",
                type=int_in(0, MAX_SEQ, "a step"),
                default=None,
                metavar="T",
                help="with --trained-after: only up to step T",
            )
        p.add_argument("--reason", required=True, help="why (kept in the ledger, shown in reports)")
        p.add_argument("--json", action="store_true", help="print what was done as JSON")


def cmd_exclude(args: argparse.Namespace) -> int:
    return _run(args, include=False)


def cmd_include(args: argparse.Namespace) -> int:
    return _run(args, include=True)


def _run(args: argparse.Namespace, *, include: bool) -> int:
    from dataflow.live._exclusions import write_exclusions

    through = getattr(args, "through", None)
    if through is not None and args.trained_after is None:
        args.parser.error("--through goes with --trained-after")
    ledger = _open_to_write(args)
    try:
        check_run(ledger, args.run)
        ids = _sample_ids(args, ledger)
        report = write_exclusions(ledger, args.run, ids, reason=args.reason, include=include)
    finally:
        ledger.close()
    if args.json:
        print(
            json.dumps(
                {
                    "run_id": args.run,
                    "action": report.kind,
                    "changed": list(report.changed),
                    "unchanged": list(report.unchanged),
                    "reason": report.reason,
                    "epoch": report.epoch,
                },
                indent=2,
            )
        )
        return 0
    done = "included" if include else "excluded"
    say(f"{done} {len(report.changed)} samples of run {args.run!r}: {report.reason}")
    if report.unchanged:
        say(f"{len(report.unchanged)} were excluded already (their first reason stands)")
    return 0


def _open_to_write(args: argparse.Namespace) -> Any:
    """The ledger the arguments name, to append to: nothing is created."""
    from dataflow.recorder._ledger import Ledger

    url, _source = ledger_source(args)
    return Ledger.open(url, create=False)


def _sample_ids(args: argparse.Namespace, ledger: Any) -> list[str]:
    if args.sample is not None:
        return list(args.sample)
    if args.from_file is not None:
        return _read_ids(args.from_file)
    from dataflow.live._replay import replay
    from dataflow.model._exclusions import trained_after

    state = replay(ledger, args.run)
    ids = trained_after(state, args.trained_after, args.through)
    if not ids:
        upto = f" through step {args.through}" if args.through is not None else ""
        raise Failure(
            f"the current lineage of run {args.run!r} trained nothing after step "
            f"{args.trained_after}{upto} (its newest ack step: "
            f"{max(state.trained.values(), default='none')}); after a resume from that "
            "step, its abandoned steps are no longer in the lineage: exclude before resuming, "
            "or name the samples with --sample or --from-file"
        )
    return ids


def _read_ids(path: str) -> list[str]:
    from dataflow.model._refs import validate_sample_id

    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except UnicodeDecodeError as exc:
        raise Failure(f"--from-file {path}: not UTF-8 text ({exc.reason})") from exc
    ids = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            ids.append(validate_sample_id(text))
        except ValueError as exc:
            raise Failure(f"--from-file {path}, line {number}: {exc}") from exc
    if not ids:
        raise Failure(f"--from-file {path} names no sample id (one id a line)")
    return ids
