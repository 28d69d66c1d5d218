"""The demo's report: counts from the fold, a second count straight from the events, and
the timeline plot (matplotlib, imported only here, and optional)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dataflow.model._events import Event, Kind
from dataflow.model._fold import RunState
from dataflow.tools._lineage_acks import final_lineage_acks


@dataclass
class Lineage:
    """What the event log says, read without the fold: the acks of the final lineage."""

    acks: Counter[str] = field(default_factory=Counter)
    resume_ts: list[float] = field(default_factory=list)
    checkpoints: list[tuple[float, int]] = field(default_factory=list)  # ts, step
    first_lease_ts: float | None = None
    last_ack_ts: float | None = None


def lineage_report(events: Iterable[Event]) -> Lineage:
    """Count each sample's acks in the final lineage, from the events alone
    (:func:`~dataflow.tools._lineage_acks.final_lineage_acks`), and when the run
    leased, acked, checkpointed and resumed. (The demo never starts a new data epoch,
    so one lineage is one pass over the data.)
    """
    events = list(events)
    lineage = Lineage(acks=final_lineage_acks(events))
    for event in events:
        if event.kind == Kind.CHECKPOINT:
            lineage.checkpoints.append((event.ts, event.step or 0))
        elif event.kind == Kind.RESUME:
            lineage.resume_ts.append(event.ts)
        elif event.kind == Kind.ACK and event.sample_ids:
            lineage.last_ack_ts = event.ts
        elif event.kind == Kind.LEASE and lineage.first_lease_ts is None:
            lineage.first_lease_ts = event.ts
    return lineage


def build_report(
    *,
    run_id: str,
    ledger_url: str,
    store_uri: str,
    state: RunState,
    lineage: Lineage,
    final: dict[str, Any],
    wall_s: float,
    kill: dict[str, Any] | None,
) -> dict[str, Any]:
    """report.json: ``lost`` is committed and never trained, ``duplicated`` trained more
    than once in the final lineage (counted from the events, not the fold)."""
    committed = set(state.committed)
    trained = set(state.trained)
    span = (
        lineage.last_ack_ts - lineage.first_lease_ts
        if lineage.first_lease_ts is not None and lineage.last_ack_ts is not None
        else 0.0
    )
    return {
        "run_id": run_id,
        "ledger_url": ledger_url,
        "store_uri": store_uri,
        "committed": len(committed),
        "trained": len(trained),
        "lost": len(committed - trained),
        "duplicated": sum(1 for n in lineage.acks.values() if n > 1),
        "trained_per_events": len(lineage.acks),
        "dead": len(state.dead),
        "resumes": max(len(lineage.resume_ts) - 1, 0),
        "verify": state.verify(),
        "final_metrics": final.get("metrics") or {},
        "final_step": final.get("step"),
        "checkpoints": [c.step for c in state.lineage_checkpoints()],
        "kill": kill,
        "samples_per_s": round(len(trained) / span, 2) if span > 0 else 0.0,
        "wall_s": round(wall_s, 2),
    }


def write_timeline(path: Any, timeline: dict[str, Any]) -> str | None:
    """Plot the run to ``path`` (PNG); return why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install matplotlib)"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t, committed, trained = (
        zip(*timeline["samples"], strict=True) if timeline["samples"] else ((), (), ())
    )
    top.step(t, committed, where="post", label="committed (producers)", color="tab:blue")
    top.step(t, trained, where="post", label="trained (final lineage so far)", color="tab:green")
    top.axhline(timeline["total"], color="grey", linewidth=0.5, linestyle=":")
    kill = timeline["kill"]
    for ax in (top, bottom):
        ax.axvspan(0, timeline["started"], color="0.92")
        if kill is not None:
            ax.axvline(kill["t"], color="tab:red", linestyle="--", linewidth=1)
        for resumed in timeline["resumes"][1:]:
            ax.axvline(resumed, color="tab:purple", linestyle=":", linewidth=1)
    if kill is not None:
        top.annotate(
            f"SIGKILL both ranks\nafter step {kill['step']}",
            (kill["t"], timeline["total"]),
            textcoords="offset points",
            xytext=(-6, -4),
            ha="right",
            va="top",
            color="tab:red",
            fontsize=8,
        )
    for resumed in timeline["resumes"][1:]:
        top.annotate(
            "resumed",
            (resumed, 0),
            textcoords="offset points",
            xytext=(4, 4),
            color="tab:purple",
            fontsize=8,
        )
    if timeline["checkpoints"]:
        ct, _ = zip(*timeline["checkpoints"], strict=True)
        top.plot(ct, [0] * len(ct), "k|", markersize=10, label="checkpoints")
    top.annotate(
        "start-up: the fork server\nimports torch",
        (timeline["started"] / 2, timeline["total"] / 2),
        ha="center",
        color="0.4",
        fontsize=8,
    )
    top.set_ylabel("samples")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(
        "dataflow demo: two producers, two gloo ranks, one SIGKILL" if kill else "dataflow demo"
    )
    evals = [(et, m["eval/simulated_acc_len"]) for et, _, m in timeline["evals"] if m]
    if evals:
        et, acc = zip(*evals, strict=True)
        bottom.plot(et, acc, "o-", color="tab:orange", markersize=3)
    bottom.set_ylabel("simulated acceptance length")
    bottom.set_xlabel("seconds since the demo started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
