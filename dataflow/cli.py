"""The ``dataflow`` command line: inspect and verify runs, export logs, run the demo.

Errors are one line on stderr, with a hint: exit status 2 for a usage error
(a bad option value, caught while parsing; a step or time the run does not
reach), 1 for a failure (no ledger at the URL, an unknown run, checkpoint or
sample, a file that cannot be written, a run that fails verification ...).
``dataflow --debug ...`` adds the traceback. The inspecting commands (``runs``,
``replay``, ``status``, ``events``, ``export``, ``gc``) open the ledger without
creating anything: a mistyped path is reported, never turned into a new, empty
ledger. Without ``--ledger`` they read ``$DATAFLOW_LEDGER``, else
``./dataflow.db``. What they compute lives in :mod:`dataflow.tools._inspect`; heavy
packages (pyarrow, matplotlib, tqdm) are imported by the commands that use them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from dataflow.model._errors import (
    ArgumentTypeError,
    DataflowError,
    InvalidArgumentError,
    NotALedgerError,
)
from dataflow.model._text import printable
from dataflow.tools import _inspect
from dataflow.tools._inspect import NotInRunError, Progress

_MAX_SEQ = 2**63 - 1
#: The environment variable that names the ledger when ``--ledger`` is not given.
LEDGER_ENV = "DATAFLOW_LEDGER"
_SHOWN_IDS = 10


class _Failure(Exception):
    """A failure the CLI reports in one line (exit status 1)."""


class _Usage(Exception):
    """A value the run cannot take, found after parsing (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, with where to look (argparse's default also prints the usage)."""
        self.exit(2, printable(f"{self.prog}: error: {message} (see `{self.prog} --help`)") + "\n")


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
    if value > threading.TIMEOUT_MAX:  # what a sleep or a wait can take
        raise argparse.ArgumentTypeError(
            f"expected at most {threading.TIMEOUT_MAX:.0f} seconds, got {text!r}"
        )
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _run_id(text: str) -> str:
    from dataflow.recorder._ledger import check_id

    try:
        return check_id("run id", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sample_id(text: str) -> str:
    from dataflow.model._refs import validate_sample_id

    try:
        return validate_sample_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _time(text: str) -> float:
    try:
        return _inspect.parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _checkpoint(text: str) -> int | str:
    """A step, ``latest`` or ``none`` (from scratch), as ``Consumer.resume`` takes them."""
    if text in ("latest", "none"):
        return text
    try:
        return _int_in(0, _MAX_SEQ, "a checkpoint step")(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a checkpoint step (an int >= 0), `latest` or `none`, got {text!r}"
        ) from None


def _ledger_url(text: str) -> str:
    from dataflow.recorder._backends import backend_for

    try:
        backend_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _output_path(example: str, suffixes: tuple[str, ...] = ()) -> Callable[[str], str]:
    """A file to write: not a directory, in a directory that exists, with one of ``suffixes``."""

    def parse(text: str) -> str:
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory; name the file to write, e.g. "
                f"{os.path.join(text, example)}"
            )
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(
                f"the directory {parent} of {text!r} does not exist; create it first"
            )
        if suffixes and not text.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(
                f"{text!r} must end with {' or '.join(suffixes)} (the format follows the name)"
            )
        return text

    return parse


def _ledger_source(args: argparse.Namespace) -> tuple[str, str]:
    """The ledger URL to read, and where it came from: --ledger, $DATAFLOW_LEDGER or default."""
    if args.ledger is not None:
        return args.ledger, "--ledger"
    env = os.environ.get(LEDGER_ENV, "").strip()
    if env:
        try:
            _ledger_url(env)
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


def _open(args: argparse.Namespace) -> Any:
    """The ledger the arguments name, read-only: nothing is created or written, a missing
    one is an error, and one on a read-only file system is opened immutable (said on stderr)."""
    from dataflow.recorder._ledger import Ledger

    url, source = _ledger_source(args)
    try:
        ledger = Ledger.open(url, create=False, read_only=True)
    except NotALedgerError as exc:
        if source != LEDGER_ENV:
            raise
        raise _Failure(f"{exc} (the URL came from ${LEDGER_ENV})") from exc
    if ledger.immutable:
        print(
            f"dataflow: ledger {ledger.safe_url} is on a read-only file system or in a "
            "directory that cannot be written, with no -wal or -shm beside it: opened "
            "read-only and immutable; it must not change while it is read",
            file=sys.stderr,
        )
    return ledger


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


@contextlib.contextmanager
def _progress(what: str, total: int) -> Iterator[Progress | None]:
    """A progress bar on stderr, by seq reached, when stderr is a terminal (else None)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # a bar is a nicety: go on without one
        yield None
        return
    with tqdm(
        total=total, desc=what, unit="seq", unit_scale=True, file=sys.stderr, leave=False
    ) as bar:

        def advance(seq: int) -> None:
            bar.update(max(0, seq - bar.n))

        yield advance


def _say(text: str, *, file: Any = None, end: str = "\n", flush: bool = False) -> None:
    """Print a line of text with every control character escaped (see dataflow.model._text): what
    it holds may come from the ledger (reasons, paths, ids) and so from anyone."""
    print(printable(text), file=file, end=end, flush=flush)


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_SHOWN_IDS])
    return shown + (f" (and {len(ids) - _SHOWN_IDS} more)" if len(ids) > _SHOWN_IDS else "")


# -- replay ---------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    if args.plot and (args.sample is not None or args.plan_resume is not None):
        args.parser.error("--plot draws the run's timeline: leave out --sample and --plan-resume")
    ledger = _open(args)
    _check_run(ledger, args.run)
    upto = _as_of(ledger, args)
    if args.sample is not None:
        return _replay_sample(ledger, args, upto)
    if args.plan_resume is not None:
        return _replay_plan(ledger, args, upto)
    with _progress("replay", upto or ledger.head_seq(args.run)) as progress:
        fold = _inspect.RunFold(ledger, args.run, upto_seq=upto)
        fold.update(progress)
    report = _inspect.run_report(fold)
    if args.plot:
        _plot(fold, args.plot)
    violations = report["violations"]
    if args.verify:
        _print_verify(args, report)
    elif args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report, args.plot)
    if violations:
        _say(
            f"dataflow: error: run {args.run!r} fails verification: {len(violations)} "
            f"violations (listed above; `dataflow replay --sample ID` shows a sample's events)",
            file=sys.stderr,
        )
    return 1 if violations else 0


def _as_of(ledger: Any, args: argparse.Namespace) -> int | None:
    """The seq that --upto, --at-step or --at names (None: the head)."""
    head = ledger.head_seq(args.run)
    try:
        if args.at_step is not None:
            with _progress("finding the step", head) as progress:
                return _inspect.seq_at_step(ledger, args.run, args.at_step, progress=progress)
        if args.at is not None:
            with _progress("finding the time", head) as progress:
                return _inspect.seq_at_time(ledger, args.run, args.at, progress=progress)
    except ValueError as exc:
        flag = "--at-step" if args.at_step is not None else "--at"
        raise _Usage(f"{flag}: {exc}") from exc
    return args.upto


def _plot(fold: Any, path: str) -> None:
    try:
        _inspect.plot_timeline(fold, path)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        raise _Failure(
            "--plot needs matplotlib, which is not installed: pip install 'dataflow[plot]' "
            "(or pip install matplotlib)"
        ) from exc


_CHECKS = (
    "nothing lost (every committed sample in exactly one state)",
    "nothing trained twice in the lineage",
    "every ack, nack and loss by the lease holder",
    "every lease of a committed, pending sample",
    "no release before the policy allowed it",
    "sequence order (epochs, checkpoint steps and each consumer's ack steps only go up; "
    "no write from a fenced-off epoch)",
)


def _print_verify(args: argparse.Namespace, report: dict[str, Any]) -> None:
    violations = report["violations"]
    if args.json:
        keys = ("run_id", "head_seq", "events", "violations")
        print(json.dumps({k: report[k] for k in keys} | {"checks": list(_CHECKS)}, indent=2))
        return
    _say(f"run {report['run_id']!r}, {report['events']} events up to seq {report['head_seq']}")
    for check in _CHECKS:
        _say(f"  checked: {check}")
    _print_verdict(violations)


def _print_verdict(violations: list[str]) -> None:
    _say(f"{'verify':>15}: " + ("clean" if not violations else f"{len(violations)} violations"))
    for v in violations:
        _say(f"  - {v}")


_HEADLINE = (
    "run_id",
    "head_seq",
    "epoch",
    "data_epoch",
    "committed",
    "pending",
    "leased",
    "trained",
    "released",
    "dead",
    "lost",
    "regenerate",
    "producers_done",
)


def _print_report(report: dict[str, Any], plot: str | None) -> None:
    for key in _HEADLINE:
        _say(f"{key:>15}: {report[key]}")
    _say(f"{'stores':>15}: {_stores_line(report['stores'])}")
    _say(f"{'events':>15}: {report['events']} from {report['first_time']} to {report['last_time']}")
    for c in report["checkpoints"]:
        flags = "".join(
            [
                f" [removed: {c['removed']}]" if c["removed"] else "",
                " [not on disk]" if c["on_disk"] is False else "",
                " [off the lineage]" if not c["in_lineage"] else "",
            ]
        )
        _say(f"{'checkpoint':>15}: step {c['step']} (epoch {c['epoch']}) {c['path']}{flags}")
    _say(f"{'lineage':>15}: " + " -> ".join(f"epoch {e}" for e in report["lineage"]))
    for e in report["epochs"]:
        origin = (
            "from scratch"
            if e["checkpoint_step"] is None
            else f"from step {e['checkpoint_step']} (epoch {e['parent']})"
            + (" [not on disk]" if e["checkpoint_on_disk"] is False else "")
        )
        _say(
            f"{'epoch ' + str(e['epoch']):>15}: {origin}, by {e['by']} at {e['time']}, world "
            f"size {e['world_size']}: requeued {e['requeued']}, regenerate {e['regenerate']}, "
            f"released {e['released']}" + ("" if e["in_lineage"] else " [abandoned]")
        )
    if report["throughput"]:
        _say(
            f"{'throughput':>15}: {'start':<29} {'seconds':>8} {'commits/s':>10} {'acks/s':>9}"
            f" {'committed':>9} {'in flight':>9} {'trained':>8}"
        )
        for t in report["throughput"]:
            _say(
                f"{'':>15}  {t['start']:<29} {t['seconds']:>8.3f} {_rate(t['commits_per_s']):>10}"
                f" {_rate(t['acks_per_s']):>9} {t['committed']:>9} {t['in_flight']:>9}"
                f" {t['trained']:>8}"
            )
    for m in report["markers"]:
        _say(f"{m['kind']:>15}: {m['time']} (seq {m['seq']}) {m['text']}")
    for o in report["outages"]:
        crash = f"the crash of epoch {o['epoch']} (seq {o['crash_seq']})"
        if o["seconds"] is None:
            _say(f"{'outage':>15}: since {crash}, no lease yet")
        else:
            _say(
                f"{'outage':>15}: {o['seconds']:.3f} s from {crash} to the first lease after "
                f"its resume (seq {o['first_lease_seq']}, {o['first_lease_time']})"
            )
    if plot:
        _say(f"{'plot':>15}: {plot}")
    _print_verdict(report["violations"])


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _replay_sample(ledger: Any, args: argparse.Namespace, upto: int | None) -> int:
    with _progress("reading the log", upto or ledger.head_seq(args.run)) as progress:
        history = _inspect.sample_history(
            ledger, args.run, args.sample, upto_seq=upto, progress=progress
        )
    if args.json:
        print(json.dumps(history, indent=2))
        return 0
    now = history["current"]
    if now is None:
        _say(f"sample {args.sample!r} of run {args.run!r}: not committed")
    else:
        facts = [f"revision {now['revision']}", f"{now['attempts']} failed attempts"]
        if now["trained_step"] is not None:
            facts.append(f"trained at step {now['trained_step']}")
        if now["leased_by"] is not None:
            facts.append(f"leased by {now['leased_by']}")
        if now["released"]:
            facts.append("features released")
        if now["reason"]:
            facts.append(now["reason"])
        _say(f"sample {args.sample!r} of run {args.run!r}: {now['state']} ({', '.join(facts)})")
    _say(f"{'seq':>8}  {'time':<29} {'kind':<12} {'epoch':>5} {'step':>6}  {'actor':<16} detail")
    for e in history["events"]:
        step = "-" if e["step"] is None else e["step"]
        _say(
            f"{e['seq']:>8}  {e['time']:<29} {e['kind']:<12} {e['epoch']:>5} {step:>6}  "
            f"{e['actor']:<16} {e['detail']}".rstrip()
        )
    return 0


def _replay_plan(ledger: Any, args: argparse.Namespace, upto: int | None) -> int:
    which = None if args.plan_resume == "none" else args.plan_resume
    plan = _inspect.plan_resume(ledger, args.run, which, upto_seq=upto)
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    ckpt = plan["checkpoint"]
    if ckpt is None:
        _say(f"a resume of run {args.run!r} from scratch (nothing is written)")
    else:
        where = {True: "on disk", False: "NOT on disk", None: "remote"}[ckpt["on_disk"]]
        _say(
            f"a resume of run {args.run!r} from the checkpoint at step {ckpt['step']} "
            f"(epoch {ckpt['epoch']}, seq {ckpt['seq']}) {ckpt['path']} [{where}] "
            "(nothing is written)"
        )
    _say(
        f"it would start epoch {plan['epoch']} with world size {plan['world_size']} and "
        f"release policy {plan['release_policy']}"
    )
    per_rank = plan["requeued_per_rank"]
    rows = [
        ("stays trained", plan["trained"], ""),
        ("requeue", len(plan["requeued"]), _ids(plan["requeued"])),
        ("regenerate", len(plan["regenerate"]), _ids(plan["regenerate"])),
        ("release", len(plan["released"]), _ids(plan["released"])),
        ("train again", len(plan["untrained"]), _ids(plan["untrained"])),
        ("void leases", len(plan["leases_voided"]), _ids(plan["leases_voided"])),
    ]
    for name, count, ids in rows:
        _say(f"{name:>15}: {count:<6} {ids}".rstrip())
    if len(per_rank) > 1:
        _say(f"{'per rank':>15}: " + ", ".join(f"{r}: {n}" for r, n in enumerate(per_rank)))
    return 0


# -- status ---------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    if args.count is not None and not args.follow:
        args.parser.error("--count N stops --follow after N refreshes: add --follow")
    ledger = _open(args)
    _check_run(ledger, args.run)
    fold = _inspect.RunFold(ledger, args.run, window=args.window)
    shown = 0
    clear = args.follow and not args.json and sys.stdout.isatty()
    try:
        while True:
            with _progress("reading the log", ledger.head_seq(args.run)) as progress:
                fold.update(progress if shown == 0 else None)
            report = _inspect.status(fold, time.time())
            if args.json:
                print(json.dumps(report, indent=None if args.follow else 2), flush=True)
            else:
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                elif shown:
                    print()
                _print_status(report)
            shown += 1
            if not args.follow or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        if not args.follow:
            raise
        return 0


def _stores_line(uris: list[str]) -> str:
    """The stores the run's producers claimed to write to (repr: they are the ledger's text)."""
    return ", ".join(map(repr, uris)) if uris else "none recorded (producers before schema 3)"


def _print_status(s: dict[str, Any]) -> None:
    done = ", every producer closed" if s["producers_done"] else ""
    _say(
        f"run {s['run_id']!r}: {s['events']} events (newest at seq {s['head_seq']} of the "
        f"ledger, whose seqs all runs share), epoch {s['epoch']} (world size "
        f"{s['world_size']}); last event {s['idle_s']:.1f} s ago, at {s['last_event']}{done}"
    )
    _say(
        f"samples: {s['committed']} committed, {s['pending']} pending, {s['leased']} leased, "
        f"{s['trained']} trained, {s['regenerate']} to regenerate ({s['lost']} lost), "
        f"{s['dead']} dead, {s['released']} released; lag {s['lag']} (committed, not trained)"
    )
    r = s["rates"]
    _say(
        f"rates over the last {s['window_s']:g} s: {r['commits_per_s']:.2f} commits/s, "
        f"{r['leases_per_s']:.2f} leases/s, {r['acks_per_s']:.2f} acks/s"
    )
    _say("producers:" + ("" if s["producers"] else " none"))
    for pid, p in s["producers"].items():
        state = "closed" if p["closed"] else "open"
        _say(
            f"  {pid:<20} {p['committed']:>8} committed  {state:<7}"
            f"{p['commits_per_s']:.2f} commits/s  epoch {p['epoch']}"
        )
    _say(f"stores: {_stores_line(s['stores'])}")
    _say(f"consumers of epoch {s['epoch']}:" + ("" if s["consumers"] else " none"))
    for cid, c in s["consumers"].items():
        _say(
            f"  {cid:<20} {c['leased']:>8} leased  {c['acked']:>8} acked  step "
            f"{c['last_step']:<6} {c['acks_per_s']:.2f} acks/s"
        )
    pending = ", ".join(f"rank {r}: {n}" for r, n in enumerate(s["pending_per_rank"]))
    _say(f"pending per rank: {pending}")


def cmd_runs(args: argparse.Namespace) -> int:
    ledger = _open(args)
    runs = ledger.runs()
    for run_id in runs:
        _say(run_id)
    if not runs:
        _say(f"dataflow: no runs in {ledger.safe_url}", file=sys.stderr)
    unlisted = ledger.unlisted_runs()
    if unlisted:
        _say(
            f"dataflow: warning: {len(unlisted)} runs have events but no row in the runs table "
            f"(deleted by hand?): {', '.join(repr(r) for r in unlisted[:20])}; the next write "
            "to each restores it",
            file=sys.stderr,
        )
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    ledger = _open(args)
    if args.follow:
        if ledger.head_seq(args.run) == 0:
            _say(
                f"dataflow: run {args.run!r} has no events in {ledger.safe_url} yet; waiting for "
                f"its first (known runs: {_known_runs(ledger)})",
                file=sys.stderr,
                flush=True,
            )
        source = ledger.follow(args.run, args.after, timeout=args.timeout)
    else:
        _check_run(ledger, args.run)
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
    ledger = _open(args)
    _check_run(ledger, args.run)
    with _progress("export", ledger.head_seq(args.run)) as progress:
        rows = export_parquet(ledger, args.run, out, samples_path=samples, progress=progress)
    _say(f"wrote {rows} events of run {args.run!r} to {out}")
    if samples is not None:
        import pyarrow.parquet as pq

        count = pq.ParquetFile(samples).metadata.num_rows
        _say(f"wrote the state of its {count} samples to {samples}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    import dataclasses

    from dataflow.tools._gc import collect_garbage

    ledger = _open(args)
    _check_run(ledger, args.run)
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
            _say(
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
        raise _Failure(
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
            raise _Failure(f"no shared-directory store at {root} (check --store)")
        if not os.path.isdir(os.path.join(root, "samples")):  # opening it would lay one out
            raise _Failure(
                f"{root} is no shared-directory store: it has no samples/ (check --store)"
            )
    if parts.scheme == "mem":
        raise _Failure(
            f"{uri} is an in-process store: it lives in the process that made it, and no other "
            "process can collect it (name a shared-directory or Mooncake store)"
        )
    return open_store(uri)


def cmd_demo(args: argparse.Namespace) -> int:
    from dataflow.demo import DemoOptions, run_demo

    options = DemoOptions(
        workdir=args.workdir,
        quick=args.quick,
        crash=not args.no_crash,
        seed=args.seed,
        samples=args.samples,
        ledger=args.ledger,
        store=args.store,
        start_mooncake_master=args.start_mooncake_master,
    )
    report = run_demo(options)
    clean = not (report["verify"] or report["lost"] or report["duplicated"])
    return 0 if clean else 1


def cmd_chaos(args: argparse.Namespace) -> int:
    from dataflow.demo._chaos import ChaosOptions, clean, run_chaos

    options = ChaosOptions(
        trials=args.trials,
        seed=args.seed,
        ledger=args.ledger,
        store=args.store,
        workdir=args.workdir,
        quick=args.quick,
        mode=args.mode,
        json_path=args.json,
        start_postgres=args.start_postgres,
        targets=None if args.targets is None else tuple(args.targets),
    )
    return 0 if clean(run_chaos(options)) else 1


def cmd_mooncake_keeper(args: argparse.Namespace) -> int:
    from stores import lend_memory

    def ready(store: Any) -> None:
        size = store.segment_size
        print(
            f"lending {size / 2**20:,.0f} MiB to {store.uri} (pid {os.getpid()}); "
            "stop with SIGTERM or Ctrl-C",
            flush=True,
        )

    if not args.store.startswith("mooncake://"):
        raise _Usage(f"--store {args.store!r} is not a mooncake:// URI")
    lend_memory(args.store, ready=ready)
    print("stopped: the memory is no longer lent, what it held is gone", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dataflow",
        description="Inspect and verify dataflow runs (the ledger is the source of truth).",
        epilog=f"Without --ledger, the commands read the ledger ${LEDGER_ENV} names, else "
        "sqlite:///./dataflow.db. docs/cli.md has examples of every command.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error, not just its line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_help = (
        f"URL of an existing ledger (default: ${LEDGER_ENV}, else sqlite:///./dataflow.db); "
        "nothing is created"
    )
    seq = _int_in(0, _MAX_SEQ, "a seq")

    def command(name: str, func: Callable[[argparse.Namespace], int], **kw: Any) -> Any:
        p = sub.add_parser(name, **kw)
        p.set_defaults(func=func, parser=p)
        return p

    def ledger_and_run(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ledger", type=_ledger_url, default=None, help=ledger_help)
        p.add_argument("--run", type=_run_id, required=True, help="run id")

    p = command(
        "replay",
        cmd_replay,
        help="fold a run's log: counts, lineage, checkpoints, throughput; verify it",
        description="Fold a run's log and report it; exit 1 when it fails verification.",
    )
    ledger_and_run(p)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--upto", type=seq, default=None, help="fold only events with seq <= UPTO")
    when.add_argument(
        "--at-step",
        type=_int_in(0, _MAX_SEQ, "a step"),
        default=None,
        metavar="S",
        help="the state at optimizer step S of the current lineage (its checkpoint at S, "
        "else its last ack at a step <= S)",
    )
    when.add_argument(
        "--at",
        type=_time,
        default=None,
        metavar="TIME",
        help="the state at TIME: ISO 8601 (naive: local time) or unix seconds",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--sample", type=_sample_id, default=None, metavar="ID", help="one sample's whole history"
    )
    what.add_argument(
        "--plan-resume",
        type=_checkpoint,
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
        type=_output_path("run.png", (".png", ".svg", ".pdf")),
        default=None,
        metavar="FILE.png",
        help="draw committed, in flight and trained over time, crashes and resumes marked "
        "(needs matplotlib: pip install 'dataflow[plot]')",
    )

    p = command("status", cmd_status, help="a run's in-flight work, lag and rates, live")
    ledger_and_run(p)
    p.add_argument("--follow", action="store_true", help="refresh until Ctrl-C")
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=2.0,
        help="with --follow: seconds between refreshes (default 2)",
    )
    p.add_argument(
        "--count",
        type=_int_in(1, _MAX_SEQ, "refreshes"),
        default=None,
        metavar="N",
        help="with --follow: stop after N refreshes",
    )
    p.add_argument(
        "--window",
        type=_positive_seconds,
        default=60.0,
        help="rates count the events of the last WINDOW seconds (default 60)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one line per refresh)")

    p = command("runs", cmd_runs, help="list the runs in a ledger")
    p.add_argument("--ledger", type=_ledger_url, default=None, help=ledger_help)

    p = command("events", cmd_events, help="print a run's events as JSON lines")
    ledger_and_run(p)
    p.add_argument("--after", type=seq, default=0, help="only events with seq > AFTER")
    p.add_argument("--upto", type=seq, default=None, help="only events with seq <= UPTO")
    p.add_argument("--follow", action="store_true", help="keep tailing new events")
    p.add_argument(
        "--timeout", type=_seconds, default=None, help="with --follow: stop after idle seconds"
    )

    p = command(
        "export",
        cmd_export,
        help="write a run's events, and the state of each sample, to Parquet files",
        description="Write a run's events to FILE.parquet and the state of each committed "
        "sample to FILE.samples.parquet.",
    )
    ledger_and_run(p)
    parquet = _output_path("events.parquet")
    p.add_argument("file", nargs="?", type=parquet, metavar="FILE.parquet", help="output file")
    p.add_argument("--out", type=parquet, default=None, help="the output file, as an option")
    p.add_argument(
        "--no-samples", action="store_true", help="write the events only, not FILE.samples.parquet"
    )

    p = command(
        "gc",
        cmd_gc,
        help="remove stored features that no committed event of the ledger keeps alive",
    )
    ledger_and_run(p)
    p.add_argument(
        "--store",
        default=None,
        help="URI of the store to collect (dir://..., mooncake://...?admin=...); default: "
        "every store the run's producers recorded when they started",
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=300.0,
        help="leave alone what was put in the last GRACE seconds (default 300)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = command(
        "demo",
        cmd_demo,
        help="the main job: producers, a two-rank gloo trainer, a SIGKILL and a resume, verified",
        description="Two producer processes stream features over ZeroMQ to a two-rank gloo "
        "trainer, which is SIGKILLed partway through and resumes through the ledger; ends "
        "with the replay report and writes report.json and timeline.png to the work directory.",
    )
    p.add_argument(
        "--workdir",
        "--dir",
        default="dataflow-demo",
        metavar="DIR",
        help="where the ledger, features, checkpoints, logs and report go (default: "
        "./dataflow-demo; created if missing)",
    )
    p.add_argument("--quick", action="store_true", help="a small run: under a minute on 2 cores")
    p.add_argument("--no-crash", action="store_true", help="do not kill the trainer ranks")
    p.add_argument(
        "--seed",
        type=_int_in(0, 2**32 - 1, "a seed"),
        default=0,
        metavar="N",
        help="seeds the data, the models and the moment of the kill",
    )
    p.add_argument(
        "--samples",
        type=_int_in(64, 1_000_000, "samples"),
        default=None,
        metavar="N",
        help="samples to produce and train (default: 384 with --quick, else 3072)",
    )
    p.add_argument(
        "--ledger",
        type=_ledger_url,
        default=None,
        metavar="URL",
        help="ledger URL, e.g. postgresql+psycopg://... (default: sqlite:///WORKDIR/ledger.db)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="feature store URI, e.g. mooncake://HOST:PORT?... (default: a shared directory "
        "under WORKDIR/features)",
    )
    p.add_argument(
        "--start-mooncake-master",
        action="store_true",
        help="start a local mooncake_master for --store mooncake:// and stop it at the end",
    )

    p = command(
        "chaos",
        cmd_chaos,
        help="the demo pipeline SIGKILLed at random, trial after trial, and checked",
        description="Run the demo pipeline (2 producers, 2 gloo ranks, ZeroMQ) again and "
        "again; each trial SIGKILLs a producer, one rank or both ranks (or a mooncake_master "
        "or PostgreSQL server it started) at a random moment, "
        "restarts them, and checks verify, lost/duplicated samples, the weights against an "
        "uninterrupted run (offline trials) and orphans after gc. Exit 1 if any check fails.",
    )
    p.add_argument(
        "--trials",
        type=_int_in(1, 100_000, "trials"),
        default=20,
        metavar="N",
        help="how many trials (default: 20)",
    )
    p.add_argument(
        "--seed",
        type=_int_in(0, 2**32 - 1, "a seed"),
        default=0,
        metavar="S",
        help="trial i draws its kill from S+i; the data and models come from S (default: 0)",
    )
    p.add_argument(
        "--ledger",
        type=_ledger_url,
        default=None,
        metavar="URL",
        help="one ledger for every trial (default: a SQLite file per trial under WORKDIR); "
        "chaos never kills a server it did not start (see --start-postgres)",
    )
    p.add_argument(
        "--start-postgres",
        action="store_true",
        help="start a throw-away PostgreSQL server (fsync, synchronous_commit and "
        "full_page_writes on) under WORKDIR for the ledger, stop it at the end, and add it "
        "to the targets: its postmaster SIGKILLed, then started again (crash recovery)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="dir:///PATH: each trial's features under PATH/trial-NNN (default: under "
        "WORKDIR); mooncake://: a local mooncake_master per trial, killed as a target too",
    )
    p.add_argument(
        "--json",
        type=_output_path("chaos.json", (".json",)),
        default=None,
        metavar="FILE",
        help="write the totals and every trial's result to FILE as JSON",
    )
    p.add_argument(
        "--workdir",
        default="dataflow-chaos",
        metavar="DIR",
        help="where the trials' ledgers, features, checkpoints and logs go "
        "(default: ./dataflow-chaos)",
    )
    p.add_argument("--quick", action="store_true", help="smaller trials (128 samples, not 256)")
    p.add_argument(
        "--mode",
        choices=("alternate", "streaming", "offline"),
        default="alternate",
        help="alternate (default: every other trial offline, in the seeded order, its weights "
        "compared with an uninterrupted run), or every trial streaming, or every one offline",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="kill only these, taken in turn in this order: producer, rank, ranks, "
        "mooncake_master (with --store mooncake://), postgres (with --start-postgres) "
        "(default: all of them that the other options allow)",
    )

    p = command(
        "mooncake-keeper",
        cmd_mooncake_keeper,
        help="lend a Mooncake cluster memory until SIGTERM or Ctrl-C (the process nobody kills)",
        description="Open the Mooncake store at URI with its segment_size of memory (default "
        "512M) lent to the cluster, and hold it until SIGTERM or SIGINT. Mooncake keeps "
        "every object in memory some client lends; producers and ranks open their stores "
        "with segment_size=0, so that a crash of theirs loses no features.",
    )
    p.add_argument(
        "--store",
        required=True,
        metavar="URI",
        help="mooncake://HOST:PORT?metadata=...&namespace=...&segment_size=4G&admin=HOST:PORT",
    )
    return parser


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    _say(f"dataflow: error: {' '.join(message.split())}", file=sys.stderr)
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
    except (InvalidArgumentError, ArgumentTypeError) as exc:  # a value only the library checks
        return _fail(args, str(exc), 2)
    except (_Failure, DataflowError, NotInRunError) as exc:
        return _fail(args, str(exc), 1)
    except _Usage as exc:
        return _fail(args, str(exc), 2)
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
