"""The ``dataflow`` command line: inspect and verify runs, export logs, run the demo.

Errors are one line on stderr, with a hint: exit status 2 for a usage error
(a bad option value, caught while parsing), 1 for a failure (no ledger at the
URL, an unknown run, a file that cannot be written ...). ``dataflow --debug
...`` adds the traceback. The inspecting commands (``runs``, ``replay``,
``events``, ``export``, ``gc``) open the ledger without creating anything: a
mistyped path is reported, never turned into a new, empty ledger.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from dataflow._errors import DataflowError

_MAX_SEQ = 2**63 - 1


class _Failure(Exception):
    """A failure the CLI reports in one line (exit status 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, with where to look (argparse's default also prints the usage)."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int ({what}), got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high} ({what}), got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _run_id(text: str) -> str:
    from dataflow._ledger import check_id

    try:
        return check_id("run id", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ledger_url(text: str) -> str:
    from dataflow._db import backend_for

    try:
        backend_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parquet_path(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; name the file to write, e.g. "
            f"{os.path.join(text, 'events.parquet')}"
        )
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"the directory {parent} of {text!r} does not exist; create it first"
        )
    return text


def _open(url: str | None) -> Any:
    """The ledger at ``url`` for reading: nothing is created, a missing ledger is an error."""
    from dataflow._ledger import Ledger

    return Ledger.open(url, create=False)


def _known_runs(ledger: Any) -> str:
    known = ledger.runs()
    shown = ", ".join(repr(r) for r in known[:20]) or "none"
    return shown + (f" (and {len(known) - 20} more)" if len(known) > 20 else "")


def _check_run(ledger: Any, run_id: str) -> None:
    if ledger.head_seq(run_id) == 0:
        raise _Failure(
            f"run {run_id!r} has no events in {ledger.safe_url}; known runs: "
            f"{_known_runs(ledger)} (check --run)"
        )


def _summary(state: Any) -> dict[str, Any]:
    return {
        "run_id": state.run_id,
        "head_seq": state.head_seq,
        "epoch": state.epoch,
        "data_epoch": state.data_epoch,
        "committed": len(state.committed),
        "pending": len(state.pending),
        "leased": len(state.leased),
        "trained": len(state.trained),
        "released": len(state.released),
        "dead": len(state.dead),
        "lost": len(state.lost),
        "regenerate": len(state.regenerate),
        "checkpoints": [
            {
                "step": c.step,
                "epoch": c.epoch,
                "path": c.path,
                "seq": c.seq,
                "digest": c.digest,
                "removed": state.removed_checkpoints.get(c.seq),
            }
            for c in state.checkpoints
        ],
        "producers_done": state.producers_done,
    }


def cmd_replay(args: argparse.Namespace) -> int:
    from dataflow._projection import replay

    ledger = _open(args.ledger)
    _check_run(ledger, args.run)
    state = replay(ledger, args.run, upto_seq=args.upto)
    violations = state.verify()
    report = _summary(state) | {"violations": violations}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if key in ("checkpoints", "violations"):
                continue
            print(f"{key:>15}: {value}")
        for c in report["checkpoints"]:
            gone = f" [removed: {c['removed']}]" if c["removed"] else ""
            print(f"{'checkpoint':>15}: step {c['step']} (epoch {c['epoch']}) {c['path']}{gone}")
        print(
            f"{'verify':>15}: " + ("clean" if not violations else f"{len(violations)} violations")
        )
        for v in violations:
            print(f"  - {v}")
    return 1 if violations else 0


def cmd_runs(args: argparse.Namespace) -> int:
    ledger = _open(args.ledger)
    runs = ledger.runs()
    for run_id in runs:
        print(run_id)
    if not runs:
        print(f"dataflow: no runs in {ledger.safe_url}", file=sys.stderr)
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    ledger = _open(args.ledger)
    if args.follow:
        if ledger.head_seq(args.run) == 0:
            print(
                f"dataflow: run {args.run!r} has no events in {ledger.safe_url} yet; waiting for "
                f"its first (known runs: {_known_runs(ledger)})",
                file=sys.stderr,
                flush=True,
            )
        source = ledger.follow(args.run, args.after, timeout=args.timeout)
    else:
        _check_run(ledger, args.run)
        source = ledger.events(args.run, after_seq=args.after, upto_seq=args.upto)
    for event in source:
        print(json.dumps(event.to_dict(), sort_keys=True), flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dataflow._export import export_parquet

    ledger = _open(args.ledger)
    _check_run(ledger, args.run)
    rows = export_parquet(ledger, args.run, args.out)
    print(f"wrote {rows} events of run {args.run!r} to {args.out}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    import dataclasses

    from dataflow._gc import collect_garbage

    ledger = _open(args.ledger)
    _check_run(ledger, args.run)
    store = _open_store(args.store)
    try:
        report = collect_garbage(ledger, store, grace=args.grace, dry_run=args.dry_run)
    finally:
        store.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    else:
        verb = "would remove" if report.dry_run else "removed"
        print(
            f"{verb} {report.removed} stored generations ({report.bytes} bytes) from "
            f"{args.store}; kept {report.kept} the ledger references and {report.young} "
            f"younger than {args.grace:g} s"
        )
    return 0


def _open_store(uri: str) -> Any:
    """The store at ``uri``; a shared directory must already exist (gc creates nothing)."""
    from urllib.parse import unquote, urlsplit

    from stores import open_store

    parts = urlsplit(uri)
    if parts.scheme == "dir" and not os.path.isdir(unquote(parts.path)):
        raise _Failure(f"no shared-directory store at {unquote(parts.path)} (check --store)")
    return open_store(uri)


def cmd_demo(args: argparse.Namespace) -> int:
    from dataflow._demo import run_demo

    return run_demo(workdir=args.dir, samples=args.samples, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dataflow",
        description="Inspect and verify dataflow runs (the ledger is the source of truth).",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error, not just its line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_help = "URL of an existing ledger (default: sqlite:///./dataflow.db); nothing is created"
    seq = _int_in(0, _MAX_SEQ, "a seq")

    def ledger_and_run(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ledger", type=_ledger_url, default=None, help=ledger_help)
        p.add_argument("--run", type=_run_id, required=True, help="run id")

    p = sub.add_parser("replay", help="fold a run's log and verify its invariants")
    ledger_and_run(p)
    p.add_argument("--upto", type=seq, default=None, help="fold only events with seq <= UPTO")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("runs", help="list the runs in a ledger")
    p.add_argument("--ledger", type=_ledger_url, default=None, help=ledger_help)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("events", help="print a run's events as JSON lines")
    ledger_and_run(p)
    p.add_argument("--after", type=seq, default=0, help="only events with seq > AFTER")
    p.add_argument("--upto", type=seq, default=None, help="only events with seq <= UPTO")
    p.add_argument("--follow", action="store_true", help="keep tailing new events")
    p.add_argument(
        "--timeout", type=_seconds, default=None, help="with --follow: stop after idle seconds"
    )
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("export", help="write a run's events to a Parquet file")
    ledger_and_run(p)
    p.add_argument("--out", type=_parquet_path, required=True, help="output .parquet path")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "gc", help="remove stored features that no committed event of the ledger keeps alive"
    )
    ledger_and_run(p)
    p.add_argument("--store", required=True, help="URI of the run's feature store (dir://...)")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=300.0,
        help="leave alone what was put in the last GRACE seconds (default 300)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "demo", help="run the end-to-end demo: produce, train, crash, resume, verify"
    )
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--samples", type=_int_in(16, 100_000, "samples"), default=48)
    p.add_argument("--seed", type=_int_in(0, 2**32 - 1, "a seed"), default=0)
    p.set_defaults(func=cmd_demo)
    return parser


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"dataflow: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. `dataflow events ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("dataflow: interrupted", file=sys.stderr)
        return 130
    except (_Failure, DataflowError) as exc:
        return _fail(args, str(exc), 1)
    except OSError as exc:  # a raw one names its file; ours say what to do
        hint = " (check the path and its permissions)" if exc.filename else ""
        return _fail(args, f"{exc}{hint}", 1)
    except (ValueError, TypeError) as exc:  # a value only the library could check
        return _fail(args, str(exc), 2)
    except Exception as exc:
        return _fail(
            args,
            f"unexpected {type(exc).__name__}: {exc} (`dataflow --debug ...` shows the traceback)",
            1,
        )


if __name__ == "__main__":
    sys.exit(main())
