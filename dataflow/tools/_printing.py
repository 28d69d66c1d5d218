"""The read side's reports as text: what ``dataflow replay`` and ``status`` print, and the
demo too (the report of ``dataflow replay`` ends each demo run).

Every line goes through :func:`say`, which escapes control characters: what a report
holds may come from the ledger (reasons, paths, ids) and so from anyone.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from dataflow.model._text import printable
from dataflow.tools._progress import Progress

_SHOWN_IDS = 10


@contextlib.contextmanager
def progress_bar(what: str, total: int) -> Iterator[Progress | None]:
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


def say(text: str, *, file: Any = None, end: str = "\n", flush: bool = False) -> None:
    """Print a line of text with every control character escaped (see dataflow.model._text): what
    it holds may come from the ledger (reasons, paths, ids) and so from anyone."""
    print(printable(text), file=file, end=end, flush=flush)


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_SHOWN_IDS])
    return shown + (f" (and {len(ids) - _SHOWN_IDS} more)" if len(ids) > _SHOWN_IDS else "")


# -- replay ---------------------------------------------------------------------------


CHECKS = (
    "nothing lost (every committed sample in exactly one state)",
    "nothing trained twice in the lineage",
    "every ack, nack and loss by the lease holder",
    "every lease of a committed, pending sample",
    "no release before the policy allowed it",
    "sequence order (epochs, checkpoint steps and each consumer's ack steps only go up; "
    "no write from a fenced-off epoch)",
)


def print_verify(report: dict[str, Any], *, as_json: bool = False) -> None:
    """What ``replay --verify`` prints: the checks made and the violations found."""
    violations = report["violations"]
    if as_json:
        keys = ("run_id", "head_seq", "events", "violations")
        print(json.dumps({k: report[k] for k in keys} | {"checks": list(CHECKS)}, indent=2))
        return
    say(f"run {report['run_id']!r}, {report['events']} events up to seq {report['head_seq']}")
    for check in CHECKS:
        say(f"  checked: {check}")
    print_verdict(violations)


def print_verdict(violations: list[str]) -> None:
    """The verify line, then each violation."""
    say(f"{'verify':>15}: " + ("clean" if not violations else f"{len(violations)} violations"))
    for v in violations:
        say(f"  - {v}")


HEADLINE = (
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


def print_run_report(report: dict[str, Any], plot: str | None = None) -> None:
    """What ``dataflow replay`` prints: a run report (``run_report``), and the plot's path."""
    for key in HEADLINE:
        say(f"{key:>15}: {report[key]}")
    say(f"{'stores':>15}: {stores_line(report['stores'])}")
    say(f"{'events':>15}: {report['events']} from {report['first_time']} to {report['last_time']}")
    for c in report["checkpoints"]:
        flags = "".join(
            [
                f" [removed: {c['removed']}]" if c["removed"] else "",
                " [not on disk]" if c["on_disk"] is False else "",
                " [off the lineage]" if not c["in_lineage"] else "",
            ]
        )
        say(f"{'checkpoint':>15}: step {c['step']} (epoch {c['epoch']}) {c['path']}{flags}")
    say(f"{'lineage':>15}: " + " -> ".join(f"epoch {e}" for e in report["lineage"]))
    for e in report["epochs"]:
        origin = (
            "from scratch"
            if e["checkpoint_step"] is None
            else f"from step {e['checkpoint_step']} (epoch {e['parent']})"
            + (" [not on disk]" if e["checkpoint_on_disk"] is False else "")
        )
        say(
            f"{'epoch ' + str(e['epoch']):>15}: {origin}, by {e['by']} at {e['time']}, world "
            f"size {e['world_size']}: requeued {e['requeued']}, regenerate {e['regenerate']}, "
            f"released {e['released']}" + ("" if e["in_lineage"] else " [abandoned]")
        )
    if report["throughput"]:
        say(
            f"{'throughput':>15}: {'start':<29} {'seconds':>8} {'commits/s':>10} {'acks/s':>9}"
            f" {'committed':>9} {'in flight':>9} {'trained':>8}"
        )
        for t in report["throughput"]:
            say(
                f"{'':>15}  {t['start']:<29} {t['seconds']:>8.3f} {_rate(t['commits_per_s']):>10}"
                f" {_rate(t['acks_per_s']):>9} {t['committed']:>9} {t['in_flight']:>9}"
                f" {t['trained']:>8}"
            )
    for m in report["markers"]:
        say(f"{m['kind']:>15}: {m['time']} (seq {m['seq']}) {m['text']}")
    for o in report["outages"]:
        crash = f"the crash of epoch {o['epoch']} (seq {o['crash_seq']})"
        if o["seconds"] is None:
            say(f"{'outage':>15}: since {crash}, no lease yet")
        else:
            say(
                f"{'outage':>15}: {o['seconds']:.3f} s from {crash} to the first lease after "
                f"its resume (seq {o['first_lease_seq']}, {o['first_lease_time']})"
            )
    for r in report.get("resumes", ()):
        say(f"{'restart':>15}: {resume_line(r)}")
    if plot:
        say(f"{'plot':>15}: {plot}")
    print_verdict(report["violations"])


def resume_line(r: dict[str, Any]) -> str:
    """One restart and its cost, as ``replay`` prints it."""
    ckpt = r["checkpoint"]
    origin = (
        "from scratch"
        if ckpt is None
        else f"from the checkpoint at step {ckpt['step']} (seq {ckpt['seq']})"
    )
    wait = (
        "no lease since"
        if r["seconds"] is None
        else f"{r['seconds']:.3f} s from the last event of epoch {r['previous_epoch']} to the "
        "first lease"
    )
    return (
        f"epoch {r['epoch']} {origin} (seq {r['seq']}, {r['time']}): kept {r['kept']}, "
        f"requeued {r['requeued']}, regenerated {r['regenerated']}, redone "
        f"{r['redone_sample_steps']} sample-steps; {wait}"
    )


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def stores_line(uris: list[str]) -> str:
    """The stores the run's producers claimed to write to (repr: they are the ledger's text)."""
    return ", ".join(map(repr, uris)) if uris else "none recorded (producers before schema 3)"


def print_status(s: dict[str, Any]) -> None:
    """What ``dataflow status`` prints of a status report (``status``)."""
    done = ", every producer closed" if s["producers_done"] else ""
    say(
        f"run {s['run_id']!r}: {s['events']} events (newest at seq {s['head_seq']} of the "
        f"ledger, whose seqs all runs share), epoch {s['epoch']} (world size "
        f"{s['world_size']}); last event {s['idle_s']:.1f} s ago, at {s['last_event']}{done}"
    )
    say(
        f"samples: {s['committed']} committed, {s['pending']} pending, {s['leased']} leased, "
        f"{s['trained']} trained, {s['regenerate']} to regenerate ({s['lost']} lost), "
        f"{s['dead']} dead, {s['released']} released; lag {s['lag']} (committed, not trained)"
    )
    r = s["rates"]
    say(
        f"rates over the last {s['window_s']:g} s: {r['commits_per_s']:.2f} commits/s, "
        f"{r['leases_per_s']:.2f} leases/s, {r['acks_per_s']:.2f} acks/s"
    )
    say("producers:" + ("" if s["producers"] else " none"))
    for pid, p in s["producers"].items():
        state = "closed" if p["closed"] else "open"
        say(
            f"  {pid:<20} {p['committed']:>8} committed  {state:<7}"
            f"{p['commits_per_s']:.2f} commits/s  epoch {p['epoch']}"
        )
    say(f"stores: {stores_line(s['stores'])}")
    say(f"consumers of epoch {s['epoch']}:" + ("" if s["consumers"] else " none"))
    for cid, c in s["consumers"].items():
        say(
            f"  {cid:<20} {c['leased']:>8} leased  {c['acked']:>8} acked  step "
            f"{c['last_step']:<6} {c['acks_per_s']:.2f} acks/s"
        )
    pending = ", ".join(f"rank {r}: {n}" for r, n in enumerate(s["pending_per_rank"]))
    say(f"pending per rank: {pending}")


def fails_verification(run_id: str, violations: int) -> str:
    """The error line of a replay whose run fails verification."""
    return (
        f"dataflow: error: run {run_id!r} fails verification: {violations} "
        f"violations (listed above; `dataflow replay --sample ID` shows a sample's events)"
    )


def print_sample_history(history: dict[str, Any]) -> None:
    """What ``replay --sample`` prints of a sample's history (``sample_history``)."""
    run_id, sample_id, now = history["run_id"], history["sample_id"], history["current"]
    if now is None:
        say(f"sample {sample_id!r} of run {run_id!r}: not committed")
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
        say(f"sample {sample_id!r} of run {run_id!r}: {now['state']} ({', '.join(facts)})")
    say(f"{'seq':>8}  {'time':<29} {'kind':<12} {'epoch':>5} {'step':>6}  {'actor':<16} detail")
    for e in history["events"]:
        step = "-" if e["step"] is None else e["step"]
        say(
            f"{e['seq']:>8}  {e['time']:<29} {e['kind']:<12} {e['epoch']:>5} {step:>6}  "
            f"{e['actor']:<16} {e['detail']}".rstrip()
        )


def print_resume_plan(plan: dict[str, Any]) -> None:
    """What ``replay --plan-resume`` prints of a plan (``plan_resume``)."""
    run_id, ckpt = plan["run_id"], plan["checkpoint"]
    if ckpt is None:
        say(f"a resume of run {run_id!r} from scratch (nothing is written)")
    else:
        where = {True: "on disk", False: "NOT on disk", None: "remote"}[ckpt["on_disk"]]
        say(
            f"a resume of run {run_id!r} from the checkpoint at step {ckpt['step']} "
            f"(epoch {ckpt['epoch']}, seq {ckpt['seq']}) {ckpt['path']} [{where}] "
            "(nothing is written)"
        )
    say(
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
        say(f"{name:>15}: {count:<6} {ids}".rstrip())
    if len(per_rank) > 1:
        say(f"{'per rank':>15}: " + ", ".join(f"{r}: {n}" for r, n in enumerate(per_rank)))


# -- diff -------------------------------------------------------------------------------


def print_diff(d: dict[str, Any]) -> None:
    """What ``dataflow diff`` prints of a comparison (``RunDiff.as_dict``)."""
    a, b = repr(d["run_a"]), repr(d["run_b"])
    say(f"comparing the final lineages of run {a} (A) and run {b} (B)")

    def verdict(same: bool) -> str:
        return "same" if same else "DIFFERENT"

    committed = verdict(d["same_committed"])
    if not d["same_committed"]:
        committed += (
            f" ({d['committed_only_in_a']} only in A, {d['committed_only_in_b']} only in B)"
        )
    say(f"{'committed':>15}: {committed}")
    say(
        f"{'trained':>15}: {verdict(d['same_trained'])} (A {d['trained_a']}, B {d['trained_b']};"
        f" {d['only_in_a']} only in A, {d['only_in_b']} only in B)"
    )
    if d["only_in_a"]:
        say(f"{'only in A':>15}: {_ids(d['only_in_a_samples'])}")
    if d["only_in_b"]:
        say(f"{'only in B':>15}: {_ids(d['only_in_b_samples'])}")
    div = d["divergence"]
    if div is None:
        say(f"{'order':>15}: same (step, rank, sample)")
    else:
        say(f"{'order':>15}: DIFFERENT from step {div['step']}")
        for name in ("a", "b"):
            pairs = [f"rank {rank}: {sid}" for rank, sid in div[name]]
            say(f"{'at step ' + str(div['step']) + ' ' + name.upper():>15}: {_ids(pairs) or '-'}")
    identical = d["same_trained"] and d["same_order"]
    say(f"{'verdict':>15}: " + ("identical" if identical else "the runs differ"))
