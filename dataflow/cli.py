"""The ``dataflow`` command line: inspect and verify runs, export logs, run the demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from dataflow._errors import DataflowError


def _open(url: str | None) -> Any:
    from dataflow._ledger import Ledger

    return Ledger.open(url)


def _check_run(ledger: Any, run_id: str) -> None:
    if ledger.head_seq(run_id) == 0:
        known = ledger.runs()
        raise ValueError(
            f"run {run_id!r} has no events in {ledger.safe_url}; known runs: {known[:20] or 'none'}"
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
    for run_id in ledger.runs():
        print(run_id)
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    ledger = _open(args.ledger)
    if args.follow:
        source = ledger.follow(args.run, args.after, timeout=args.timeout)
    else:
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


def cmd_demo(args: argparse.Namespace) -> int:
    from dataflow._demo import run_demo

    return run_demo(workdir=args.dir, samples=args.samples, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataflow",
        description="Inspect and verify dataflow runs (the ledger is the source of truth).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_help = "ledger URL (default: sqlite:///./dataflow.db)"

    p = sub.add_parser("replay", help="fold a run's log and verify its invariants")
    p.add_argument("--ledger", default=None, help=ledger_help)
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--upto", type=int, default=None, help="fold only events with seq <= UPTO")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("runs", help="list the runs in a ledger")
    p.add_argument("--ledger", default=None, help=ledger_help)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("events", help="print a run's events as JSON lines")
    p.add_argument("--ledger", default=None, help=ledger_help)
    p.add_argument("--run", required=True)
    p.add_argument("--after", type=int, default=0, help="only events with seq > AFTER")
    p.add_argument("--upto", type=int, default=None)
    p.add_argument("--follow", action="store_true", help="keep tailing new events")
    p.add_argument("--timeout", type=float, default=None, help="with --follow: stop when idle")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("export", help="write a run's events to a Parquet file")
    p.add_argument("--ledger", default=None, help=ledger_help)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True, help="output .parquet path")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "demo", help="run the end-to-end demo: produce, train, crash, resume, verify"
    )
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DataflowError as exc:
        print(f"dataflow: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"dataflow: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `dataflow events ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
