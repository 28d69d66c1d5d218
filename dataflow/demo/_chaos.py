"""``dataflow chaos``: the demo pipeline, SIGKILLed at random, restarted, and checked.

Each trial is one run of the demo (two producer processes, two gloo trainer ranks, a
shared-directory store and a SQLite ledger of its own) at a small size. Trial ``i`` draws
its kill from seed ``S + i``: the target (a producer, one trainer rank, both ranks and,
with ``--store mooncake://``, the ``mooncake_master`` each trial starts, in turn) and the
moment (a random point of the run's progress, or a chosen one: a producer between the
puts of a commit batch and its commit, both ranks in the middle of writing a checkpoint).
The conductor restarts what died as an operator would: a producer is started again and
emits everything once more (the ledger answers what it holds, so only the rest is stored
and committed); when one rank dies its peer fails on its next gloo
collective (or is killed after ``SURVIVOR_WAIT_S``), and both are restarted, resuming
through the ledger; a killed master is started afresh on its ports, holding nothing, and
whatever failed on its outage is restarted. With ``--start-postgres`` the ledger is a
PostgreSQL server chaos starts (durable: fsync, synchronous_commit and full_page_writes
on), and its postmaster is a target too: SIGKILLed, then started again on its port and
data directory (crash recovery replays the WAL), and whatever failed on its outage is
restarted the same way.

Every other trial is *offline*: the producers commit a dataset, which the ranks train in
the seeded order (no stream), and the final weights must be ``torch.equal`` to those of
an uninterrupted run of the same data (run once per ``--seed``: the data and models come
from ``S``, the trials' seeds only draw the kills). The others stream refs over ZeroMQ in
arrival order. After each run: ``replay(...).verify()`` must be clean, every committed
sample trained exactly once in the final lineage (counted from the events), and after
``collect_garbage(grace=0)`` the store must hold nothing the fold does not keep alive.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dataflow.demo._chaos_plan import (
    DURABLE,
    MASTER,
    QUICK_SIZE,
    SIZE,
    TARGETS,
    ChaosOptions,
    plan_kill,
)
from dataflow.demo._chaos_plan import KillPlan as KillPlan
from dataflow.demo._chaos_trial import ChaosTrial
from dataflow.demo._options import DemoError, DemoOptions
from dataflow.demo._run import (
    Terminated,
    _write_json,
    sigterm_raises,
)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _same_weights(path: str, reference: str) -> bool:
    import torch

    ours = torch.load(path, weights_only=True)
    theirs = torch.load(reference, weights_only=True)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


class Chaos:
    """``dataflow chaos``: ``run()`` returns the summary it prints (and writes as JSON)."""

    def __init__(self, options: ChaosOptions) -> None:
        self.options = options
        self.size = QUICK_SIZE if options.quick else SIZE
        self.workdir = Path(options.workdir).absolute()
        self._reference: str | None = None
        self.mooncake = (options.store or "").startswith("mooncake://")
        self.targets = options.targets or options.available_targets()
        self.ledger_url = options.ledger
        self.postgres: Any = None  # the PostgresServer chaos started (--start-postgres)

    def _demo_options(self, name: str) -> DemoOptions:
        store = self.options.store
        if self.mooncake:
            assert store is not None
            # A master of its own per trial (the demo starts it; chaos kills it).
            own = {"store": store, "start_mooncake_master": True}
        else:
            own = {"store": None if store is None else f"{store.rstrip('/')}/{name}"}
        return DemoOptions(
            workdir=str(self.workdir / name),
            quick=True,
            seed=self.options.seed,
            samples=self.size[0],
            ledger=self.ledger_url,
            **own,
        )

    def _offline(self, trial: int) -> bool:
        mode = self.options.mode
        return mode == "offline" or (mode == "alternate" and trial % 2 == 1)

    def reference(self) -> str:
        """The weights of an uninterrupted offline run of ``--seed``'s data (once)."""
        if self._reference is None:
            name = f"reference-seed-{self.options.seed}"
            run = ChaosTrial(self._demo_options(name), plan=None, streaming=False, size=self.size)
            result = run.run()
            if result["verify"] or result["lost"] or result["duplicated"]:
                raise DemoError(f"the uninterrupted reference run failed its checks: {result}")
            self._reference = result["weights"]
        return self._reference

    def trial(self, trial: int) -> dict[str, Any]:
        seed = self.options.seed + trial
        offline = self._offline(trial)
        plan = plan_kill(seed, trial, self.size[0], self.size[1], self.targets)
        out: dict[str, Any] = {
            "trial": trial,
            "seed": seed,
            "mode": "offline" if offline else "streaming",
            "plan": plan.describe(),
            "target": plan.target,
        }
        try:
            reference = self.reference() if offline else None
            name = f"trial-{trial:03d}"
            run = ChaosTrial(
                self._demo_options(name),
                plan=plan,
                streaming=not offline,
                size=self.size,
                postgres=self.postgres,
            )
            out.update(run.run())
            if reference is not None:
                same = _same_weights(out["weights"], reference)
                if plan.target == MASTER:
                    # Not a check: the loader skips a sample whose payload is gone and trains
                    # it once regenerated, so the batches (and the weights) may differ from
                    # the uninterrupted run's (docs/operations.md, "Lost payloads").
                    out["weights_equal"] = same
                else:
                    out["mismatch"] = not same
        except Terminated:
            raise  # the operator stops chaos, not this trial
        except DemoError as exc:
            out["failure"] = str(exc)
        return out

    def run(self) -> dict[str, Any]:
        """Run the trials. A SIGTERM, between trials too, stops chaos and what it started
        (the PostgreSQL server included)."""
        with sigterm_raises():
            return self._run_all()

    def _run_all(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            if self.options.start_postgres:
                self._start_postgres()
            return self._run(started)
        finally:
            if self.postgres is not None:
                log = self.postgres.directory / "server.log"
                if log.exists():
                    shutil.copyfile(log, self.workdir / "postgres.log")
                self.postgres.stop()

    def _start_postgres(self) -> None:
        """A throw-away PostgreSQL server with durable settings (checked with SHOW), its
        files under the workdir (as root: where the ``postgres`` user can reach them)."""
        import psycopg

        from dataflow.testing._postgres import PostgresServer, _conninfo

        where = self.workdir
        if os.geteuid() == 0 and not all(p.stat().st_mode & 0o001 for p in (where, *where.parents)):
            where = None  # the postgres user cannot enter it: tempfile's directory instead
        server = PostgresServer(durable=True)
        saved, tempfile.tempdir = tempfile.tempdir, where and str(where)
        try:
            server.start()
        except RuntimeError as exc:
            raise DemoError(f"--start-postgres: {exc}") from exc
        finally:
            tempfile.tempdir = saved
        self.postgres = server
        with psycopg.connect(_conninfo(server.url)) as conn:
            settings = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in DURABLE}
        if set(settings.values()) != {"on"}:
            raise DemoError(f"--start-postgres: the server runs with {settings}")
        self.ledger_url = server.create_database("dataflow_chaos")

    def _run(self, started: float) -> dict[str, Any]:
        from tqdm import tqdm

        results = []
        bar = tqdm(range(self.options.trials), desc="chaos", unit="trial", file=sys.stderr)
        for trial in bar:
            result = self.trial(trial)
            results.append(result)
            bar.set_postfix_str(f"last: {result['plan']}", refresh=True)
            with (self.workdir / "trials.jsonl").open("a") as file:
                file.write(json.dumps(result) + "\n")
        bar.close()
        summary = summarize(results, time.monotonic() - started, self.targets)
        print(format_table(summary), flush=True)
        if self.options.json_path is not None:
            _write_json(Path(self.options.json_path), summary)
        return summary


def trial_totals(results: list[dict[str, Any]]) -> dict[str, int]:
    """What every chaos report adds up over its trials: lost, duplicated, weight
    mismatches, orphans, failed verifications and failed trials."""
    return {
        "lost": sum(r.get("lost", 0) for r in results),
        "duplicated": sum(r.get("duplicated", 0) for r in results),
        "mismatches": sum(1 for r in results if r.get("mismatch")),
        "orphans": sum(r.get("orphans", 0) for r in results),
        "verify_failures": sum(1 for r in results if r.get("verify")),
        "failures": sum(1 for r in results if "failure" in r),
    }


def summarize(
    results: list[dict[str, Any]], wall_s: float, targets: tuple = TARGETS
) -> dict[str, Any]:
    """The JSON of ``dataflow chaos --json``: totals over the trials, and each trial."""
    kills = dict.fromkeys(targets, 0)
    for r in results:
        kill = r.get("kill")
        if kill and not kill.get("missed") and "failure" not in r:
            kills[r["target"]] += 1
    recovery = [r["recovery_s"] for r in results if r.get("recovery_s") is not None]
    p50, p99 = _percentile(recovery, 0.5), _percentile(recovery, 0.99)
    return {
        "trials": len(results),
        "kills": kills,
        "missed": sum(1 for r in results if (r.get("kill") or {}).get("missed")),
        "late": sum(1 for r in results if (r.get("kill") or {}).get("late")),
        **trial_totals(results),
        "gc_removed": sum(r.get("gc_removed", 0) for r in results),
        "recovery_s_p50": None if p50 is None else round(p50, 3),
        "recovery_s_p99": None if p99 is None else round(p99, 3),
        "wall_s": round(wall_s, 1),
        "results": results,
    }


def clean(summary: dict[str, Any]) -> bool:
    keys = ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures")
    return not any(summary[k] for k in keys)


def format_table(summary: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    kills = summary["kills"]
    offline = sum(1 for r in summary["results"] if r["mode"] == "offline")
    rows = [
        ("trials", f"{summary['trials']} ({offline} offline, seeded order; the rest streaming)"),
        (
            "kills",
            ", ".join(f"{k} {v}" for k, v in kills.items())
            + (f" ({summary['missed']} missed: the run ended first)" if summary["missed"] else "")
            + (
                f" ({summary['late']} late: after the victim's part of the run)"
                if summary.get("late")
                else ""
            ),
        ),
        ("lost", summary["lost"]),
        ("duplicated", summary["duplicated"]),
        ("weight mismatches", summary["mismatches"]),
        ("orphans after gc", f"{summary['orphans']} ({summary['gc_removed']} collected)"),
        ("verify failures", summary["verify_failures"]),
        ("failed trials", summary["failures"]),
        ("recovery p50", seconds(summary["recovery_s_p50"])),
        ("recovery p99", seconds(summary["recovery_s_p99"])),
        ("wall", f"{summary['wall_s']:.1f} s"),
    ]
    lines = [f"{name:>18}  {value}" for name, value in rows]
    for r in summary["results"]:
        if "failure" in r:
            lines.append(f"  trial {r['trial']} failed: {r['failure']}")
    lines.append("verdict: " + ("clean" if clean(summary) else "FAILED"))
    return "\n".join(lines)


def run_chaos(options: ChaosOptions) -> dict[str, Any]:
    """Run ``dataflow chaos``; return the summary (``clean(summary)`` says if it passed)."""
    return Chaos(options).run()
