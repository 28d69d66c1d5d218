"""``dataflow replay``: fold a run's log and report it, verify it, go back to a step or a
time, follow one sample, plan a resume, plot the timeline."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dataflow.cli._arguments import (
    MAX_SEQ,
    SEQ,
    Failure,
    Usage,
    add_command,
    add_ledger_and_run,
    checkpoint,
    int_in,
    output_path,
    sample_id,
    time_value,
)
from dataflow.cli._ledger import check_run, open_ledger
from dataflow.tools._printing import (
    fails_verification,
    print_resume_plan,
    print_run_report,
    print_sample_history,
    print_verify,
    progress_bar,
    say,
)
from dataflow.tools._resume_plan import plan_resume
from dataflow.tools._run_fold import RunFold
from dataflow.tools._run_report import run_report
from dataflow.tools._samples import sample_history
from dataflow.tools._time_travel import seq_at_step, seq_at_time
from dataflow.tools._timeline_plot import plot_timeline


def add_replay(sub: Any) -> None:
    """The ``replay`` subcommand."""
    p = add_command(
        sub,
        "replay",
        cmd_replay,
        help="fold a run's log: counts, lineage, checkpoints, throughput; verify it",
        description="Fold a run's log and report it; exit 1 when it fails verification.",
    )
    add_ledger_and_run(p)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--upto", type=SEQ, default=None, help="fold only events with seq <= UPTO")
    when.add_argument(
        "--at-step",
        type=int_in(0, MAX_SEQ, "a step"),
        default=None,
        metavar="S",
        help="the state at optimizer step S of the current lineage (its checkpoint at S, "
        "else its last ack at a step <= S)",
    )
    when.add_argument(
        "--at",
        type=time_value,
        default=None,
        metavar="TIME",
        help="the state at TIME: ISO 8601 (naive: local time) or unix seconds",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--sample", type=sample_id, default=None, metavar="ID", help="one sample's whole history"
    )
    what.add_argument(
        "--plan-resume",
        type=checkpoint,
        default=None,
        metavar="STEP",
        help="what a resume from the checkpoint at STEP (or `latest`, or `none`: from "
        "scratch) would requeue, release and ask to regenerate; writes nothing",
    )
    what.add_argument(
        "--verify", action="store_true", help="only check every invariant; list the violations"
    )
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.add_argument(
        "--plot",
        type=output_path("run.png", (".png", ".svg", ".pdf")),
        default=None,
        metavar="FILE.png",
        help="draw committed, in flight and trained over time, crashes and resumes marked "
        "(needs matplotlib: pip install 'dataflow[plot]')",
    )


def cmd_replay(args: argparse.Namespace) -> int:
    if args.plot and (args.sample is not None or args.plan_resume is not None):
        args.parser.error("--plot draws the run's timeline: leave out --sample and --plan-resume")
    ledger = open_ledger(args)
    check_run(ledger, args.run)
    upto = _as_of(ledger, args)
    if args.sample is not None:
        return _replay_sample(ledger, args, upto)
    if args.plan_resume is not None:
        return _replay_plan(ledger, args, upto)
    with progress_bar("replay", upto or ledger.head_seq(args.run)) as progress:
        fold = RunFold(ledger, args.run, upto_seq=upto)
        fold.update(progress)
    report = run_report(fold)
    if args.plot:
        _plot(fold, args.plot)
    violations = report["violations"]
    if args.verify:
        print_verify(report, as_json=args.json)
    elif args.json:
        print(json.dumps(report, indent=2))
    else:
        print_run_report(report, args.plot)
    if violations:
        say(fails_verification(args.run, len(violations)), file=sys.stderr)
    return 1 if violations else 0


def _as_of(ledger: Any, args: argparse.Namespace) -> int | None:
    """The seq that --upto, --at-step or --at names (None: the head)."""
    head = ledger.head_seq(args.run)
    try:
        if args.at_step is not None:
            with progress_bar("finding the step", head) as progress:
                return seq_at_step(ledger, args.run, args.at_step, progress=progress)
        if args.at is not None:
            with progress_bar("finding the time", head) as progress:
                return seq_at_time(ledger, args.run, args.at, progress=progress)
    except ValueError as exc:
        flag = "--at-step" if args.at_step is not None else "--at"
        raise Usage(f"{flag}: {exc}") from exc
    return args.upto


def _plot(fold: Any, path: str) -> None:
    try:
        plot_timeline(fold, path)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        raise Failure(
            "--plot needs matplotlib, which is not installed: pip install 'dataflow[plot]' "
            "(or pip install matplotlib)"
        ) from exc


def _replay_sample(ledger: Any, args: argparse.Namespace, upto: int | None) -> int:
    with progress_bar("reading the log", upto or ledger.head_seq(args.run)) as progress:
        history = sample_history(ledger, args.run, args.sample, upto_seq=upto, progress=progress)
    if args.json:
        print(json.dumps(history, indent=2))
    else:
        print_sample_history(history)
    return 0


def _replay_plan(ledger: Any, args: argparse.Namespace, upto: int | None) -> int:
    which = None if args.plan_resume == "none" else args.plan_resume
    plan = plan_resume(ledger, args.run, which, upto_seq=upto)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print_resume_plan(plan)
        _print_trained_after(args, plan)
    return 0


def _print_trained_after(args: argparse.Namespace, plan: dict[str, Any]) -> None:
    """The samples the abandoned steps trained, and the line that excludes them."""
    ckpt, ids = plan["checkpoint"], plan["trained_after"]
    if ckpt is None or not ids:
        return
    shown = ", ".join(ids[:10]) + (f" ... ({len(ids)} in all)" if len(ids) > 10 else "")
    say(f"{'trained after':>15}: {len(ids):<6} {shown}")
    ledger = " --ledger URL" if args.ledger is not None else ""
    say(
        f"to skip them: dataflow exclude{ledger} --run {args.run} --trained-after "
        f'{ckpt["step"]} --reason "..." (before the resume)'
    )
