"""``dataflow chaos --hosts``: the demo pipeline on a simulated cluster, with network faults.

Each trial builds a cluster of its own (``dataflow.testing.Cluster``: one network
namespace per host, joined by a bridge): PostgreSQL (durable) on ``pg``, the Mooncake
master and the store keeper on ``master`` (or, without Mooncake, the shared-directory
store under the work directory, which every host sees), producers on ``producer0`` and
``producer1``, ranks on ``trainer0`` and ``trainer1`` (gloo between their addresses),
every URL and endpoint an address, never loopback; the stream runs with CURVE.

The fault kinds (``FAULTS``) are spread over the trials (``assign``): with fewer trials
than kinds a trial injects several, one after another, so ``--trials 6`` covers all
nine. Even trials stream refs; odd ones train a committed dataset in the seeded order,
and their final weights must be ``torch.equal`` to those of an uninterrupted run on a
cluster of its own. After each trial, as ``dataflow chaos`` checks: ``verify`` clean,
every committed sample trained exactly once in the final lineage, and nothing the fold
does not keep alive left in the store after ``dataflow gc``. A kind's figures add up the
trials that injected it (a trial with two kinds counts for both).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from dataflow.demo._chaos import _percentile, _same_weights, trial_totals
from dataflow.demo._chaos_hosts_plan import (
    AMBIENT,
    FAULTS,
    HostsChaosOptions,
    assign,
    plan_faults,
    streaming,
)
from dataflow.demo._chaos_hosts_trial import HostsTrial
from dataflow.demo._options import DemoError, DemoOptions
from dataflow.demo._run import Terminated, _write_json, sigterm_raises


class HostsUnavailable(DemoError):
    """This process cannot build a simulated cluster (the reason says why)."""


def mooncake_available() -> bool:
    """Whether a Mooncake store can run here (the client and its master's binary)."""
    try:
        import mooncake.store  # noqa: F401

        from stores.mooncake_master import find_master_binary

        find_master_binary()
    except Exception:
        return False
    return True


class HostsChaos:
    """``dataflow chaos --hosts``: ``run()`` returns the summary it prints (and writes)."""

    def __init__(self, options: HostsChaosOptions) -> None:
        self.options = options
        self.workdir = Path(options.workdir).absolute()
        self.mooncake = mooncake_available() if options.mooncake is None else options.mooncake
        self.kinds = options.kinds(self.mooncake)
        self._reference: str | None = None

    def run(self) -> dict[str, Any]:
        from dataflow.testing._netns import cluster_unavailable

        reason = cluster_unavailable()
        if reason is not None:
            raise HostsUnavailable(f"--hosts needs network namespaces: {reason}")
        with sigterm_raises():
            return self._run()

    def _run(self) -> dict[str, Any]:
        from tqdm import tqdm

        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        plan = assign(self.options.trials, self.kinds)
        results = []
        bar = tqdm(plan, desc="chaos --hosts", unit="trial", file=sys.stderr)
        for trial, kinds in enumerate(bar):
            result = self.trial(trial, kinds)
            results.append(result)
            bar.set_postfix_str(f"last: {', '.join(kinds)}", refresh=True)
            with (self.workdir / "trials.jsonl").open("a") as file:
                file.write(json.dumps(result) + "\n")
        bar.close()
        summary = summarize_hosts(results, self.kinds, time.monotonic() - started)
        summary["store"] = "mooncake" if self.mooncake else "shared directory"
        print(format_hosts_table(summary), flush=True)
        if self.options.json_path is not None:
            _write_json(Path(self.options.json_path), summary)
        return summary

    def trial(self, trial: int, kinds: tuple[str, ...]) -> dict[str, Any]:
        seed = self.options.seed + trial
        stream = streaming(trial, kinds)
        plans = plan_faults(seed, kinds, quick=self.options.quick)
        ambient = tuple(k for k in kinds if k in AMBIENT)
        out: dict[str, Any] = {
            "trial": trial,
            "seed": seed,
            "mode": "streaming" if stream else "offline",
            "kinds": list(kinds),
        }
        started = time.monotonic()
        try:
            reference = None if stream else self.reference()
            out.update(self._run_trial(f"trial-{trial:03d}", plans, ambient, stream, seed))
            if reference is not None:
                out["mismatch"] = not _same_weights(out["weights"], reference)
        except Terminated:
            raise
        except DemoError as exc:
            out["failure"] = str(exc)
        out["wall_s"] = round(time.monotonic() - started, 1)  # the reference's too, once
        return out

    def reference(self) -> str:
        """The weights of an uninterrupted offline run on a cluster of its own (once)."""
        if self._reference is None:
            name = f"reference-seed-{self.options.seed}"
            result = self._run_trial(name, [], (), False, self.options.seed)
            if result["verify"] or result["lost"] or result["duplicated"]:
                raise DemoError(f"the uninterrupted reference run failed its checks: {result}")
            self._reference = result["weights"]
        return self._reference

    def _run_trial(
        self, name: str, plans: list, ambient: tuple[str, ...], stream: bool, seed: int
    ) -> dict[str, Any]:
        from dataflow.testing._cluster import Cluster
        from dataflow.testing._postgres import create_database

        where = self.workdir / name
        with Cluster(workdir=where / "cluster") as cluster:
            try:
                postgres = cluster.start_postgres(durable=True)
            except RuntimeError as exc:
                raise DemoError(f"PostgreSQL did not start on host 'pg': {exc}") from exc
            ledger = create_database(cluster.postgres_url(postgres), "dataflow_chaos")
            master = cluster.start_mooncake_master() if self.mooncake else None
            options = DemoOptions(
                workdir=str(where),
                quick=True,
                seed=self.options.seed,
                samples=self.options.size[0],
                ledger=ledger,
            )
            run = HostsTrial(
                options,
                cluster=cluster,
                postgres=postgres,
                master=master,
                faults=plans,
                ambient=ambient,
                streaming=stream,
                size=self.options.size,
                seed=seed,
                gloo_timeout_s=self.options.gloo_timeout_s,
            )
            return run.run()


def summarize_hosts(
    results: list[dict[str, Any]], kinds: tuple[str, ...], wall_s: float
) -> dict[str, Any]:
    """The JSON of ``dataflow chaos --hosts --json``: totals, per fault kind, each trial."""
    faults: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        landed, missed, recovery = 0, 0, []
        totals = dict.fromkeys(("lost", "duplicated", "mismatches", "orphans", "failures"), 0)
        for r in results:
            if kind not in r["kinds"]:
                continue
            records = [f for f in r.get("faults", []) if f["kind"] == kind]
            if kind in AMBIENT or any(not f.get("missed") for f in records) or "failure" in r:
                landed += 1
                totals["lost"] += r.get("lost", 0)
                totals["duplicated"] += r.get("duplicated", 0)
                totals["mismatches"] += int(bool(r.get("mismatch")))
                totals["orphans"] += r.get("orphans", 0)
                totals["failures"] += int("failure" in r or bool(r.get("verify")))
            else:
                missed += 1
            recovery += [f["recovery_s"] for f in records if f.get("recovery_s") is not None]
        p50, p99 = _percentile(recovery, 0.5), _percentile(recovery, 0.99)
        faults[kind] = {
            "trials": landed,
            "missed": missed,
            **totals,
            "recovery_p50_s": None if p50 is None else round(p50, 3),
            "recovery_p99_s": None if p99 is None else round(p99, 3),
        }
    return {
        "trials": len(results),
        **trial_totals(results),
        "payloads_lost": sum(r.get("payloads_lost", 0) for r in results),
        "unexercised": [k for k, v in faults.items() if not v["trials"]],
        "faults": faults,
        "wall_s": round(wall_s, 1),
        "results": results,
    }


def clean_hosts(summary: dict[str, Any]) -> bool:
    """Nothing lost, duplicated, mismatched or orphaned, no failure, every kind injected."""
    keys = ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures")
    return not any(summary[k] for k in keys) and not summary["unexercised"]


def format_hosts_table(summary: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    head = ("fault", "trials", "lost", "dup", "mismatch", "orphans", "p50 s", "p99 s")
    rows = [head]
    for kind, v in summary["faults"].items():
        rows.append(
            (
                kind + (f" ({v['missed']} missed)" if v["missed"] else ""),
                str(v["trials"]),
                str(v["lost"]),
                str(v["duplicated"]),
                str(v["mismatches"]),
                str(v["orphans"]),
                seconds(v["recovery_p50_s"]),
                seconds(v["recovery_p99_s"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(
        f"{summary['trials']} trials ({summary.get('store', '')} store): lost "
        f"{summary['lost']}, duplicated {summary['duplicated']}, mismatches "
        f"{summary['mismatches']}, orphans {summary['orphans']}, verify failures "
        f"{summary['verify_failures']}, failed trials {summary['failures']}; "
        f"{summary['wall_s']:.1f} s"
    )
    for r in summary["results"]:
        if "failure" in r:
            lines.append(f"  trial {r['trial']} failed: {r['failure']}")
    if summary["unexercised"]:
        lines.append(f"  never injected: {', '.join(summary['unexercised'])}")
    lines.append("verdict: " + ("clean" if clean_hosts(summary) else "FAILED"))
    return "\n".join(lines)


def run_hosts_chaos(options: HostsChaosOptions) -> dict[str, Any]:
    """Run ``dataflow chaos --hosts``; ``clean_hosts(summary)`` says if it passed."""
    return HostsChaos(options).run()


__all__ = ["FAULTS", "HostsChaos", "HostsUnavailable", "clean_hosts", "run_hosts_chaos"]
