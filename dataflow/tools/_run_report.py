"""What ``dataflow replay`` reports of a folded run: counts, checkpoints, epochs, throughput."""

from __future__ import annotations

import bisect
import os
from typing import Any

from dataflow.model._fold import Checkpoint, RunState
from dataflow.tools._run_fold import Outage, Point, Resume, RunFold
from dataflow.tools._time_travel import lineage
from dataflow.tools._times import iso_time


def summary(state: RunState) -> dict[str, Any]:
    """The run's counts and checkpoints (the keys of ``replay --json`` since its first)."""
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
        "excluded": len(state.excluded),
        "checkpoints": checkpoint_rows(state),
        "producers_done": state.producers_done,
        "stores": list(state.store_uris),
    }


def on_disk(checkpoint: Checkpoint) -> bool | None:
    """Whether the checkpoint's files exist here; None for a URI (remote storage)."""
    if "://" in checkpoint.path:
        return None
    return os.path.exists(checkpoint.path)


def checkpoint_rows(state: RunState) -> list[dict[str, Any]]:
    in_lineage = {c.seq for c in state.lineage_checkpoints()}
    return [
        {
            "step": c.step,
            "epoch": c.epoch,
            "path": c.path,
            "seq": c.seq,
            "digest": c.digest,
            "removed": state.removed_checkpoints.get(c.seq),
            "on_disk": on_disk(c),
            "in_lineage": c.seq in in_lineage,
        }
        for c in state.checkpoints
    ]


def epoch_rows(state: RunState, resumes: dict[int, Resume]) -> list[dict[str, Any]]:
    """Each epoch: the checkpoint it resumed from, what its resume did, whether it is live."""
    current = {epoch for epoch, _cut in lineage(state)}
    rows = []
    for epoch, plan in sorted(state.plans.items()):
        started = resumes.get(epoch)
        ckpt = plan.checkpoint
        rows.append(
            {
                "epoch": epoch,
                "parent": ckpt.epoch if ckpt else None,
                "checkpoint_step": ckpt.step if ckpt else None,
                "checkpoint_seq": ckpt.seq if ckpt else None,
                "checkpoint_on_disk": on_disk(ckpt) if ckpt else None,
                "seq": started.seq if started else None,
                "time": iso_time(started.ts) if started else None,
                "by": started.actor if started else None,
                "world_size": plan.world_size,
                "requeued": len(plan.requeued),
                "released": len(plan.released),
                "regenerate": len(plan.regenerate),
                "in_lineage": epoch in current,
            }
        )
    return rows


def throughput(fold: RunFold, buckets: int = 8) -> list[dict[str, Any]]:
    """The run's timeline cut into ``buckets`` equal spans of time: rates and counts.

    Each span: its start, length, commits and acks (and per second), and the committed,
    in-flight (leased) and trained counts at its end.
    """
    points = fold.points
    if not points or fold.first_ts is None:
        return []
    start, end = fold.first_ts, points[-1].ts
    n = buckets if end > start else 1
    width = (end - start) / n
    times = [p.ts for p in points]
    rows, commits, acks, t0 = [], 0, 0, start
    for i in range(n):
        edge = end if i == n - 1 else start + width * (i + 1)
        k = bisect.bisect_right(times, edge) - 1
        p = points[k] if k >= 0 else Point(0, start, 0, 0, 0, 0, 0)
        seconds = edge - t0
        rows.append(
            {
                "start": iso_time(t0),
                "seconds": round(seconds, 3),
                "commits": p.commits - commits,
                "acks": p.acks - acks,
                "commits_per_s": round((p.commits - commits) / seconds, 3) if seconds else None,
                "acks_per_s": round((p.acks - acks) / seconds, 3) if seconds else None,
                "committed": p.committed,
                "in_flight": p.leased,
                "trained": p.trained,
            }
        )
        commits, acks, t0 = p.commits, p.acks, edge
    return rows


def run_report(fold: RunFold) -> dict[str, Any]:
    """Everything ``replay`` prints: counts, checkpoints, epochs, throughput, violations."""
    state = fold.state
    return summary(state) | {
        "violations": state.verify(),
        "events": fold.events,
        "first_time": iso_time(fold.first_ts) if fold.first_ts is not None else None,
        "last_time": iso_time(fold.last_ts) if fold.last_ts is not None else None,
        "lineage": [epoch for epoch, _cut in lineage(state)],
        "epochs": epoch_rows(state, fold.resumes),
        "throughput": throughput(fold),
        "markers": [
            {"kind": m.kind, "seq": m.seq, "time": iso_time(m.ts), "epoch": m.epoch, "text": m.text}
            | {"ts": m.ts}
            for m in fold.markers
        ],
        "outages": [outage_row(o) for o in fold.outages],
        "resumes": resume_rows(fold),
    }


def resume_rows(fold: RunFold) -> list[dict[str, Any]]:
    """Each restart of the run with its cost (``live/_restarts.py``), as ``replay --json``
    lists it under ``resumes``; times as ISO text beside the unix seconds."""
    rows = []
    for cost in fold.restarts.costs(fold.state):
        row = cost.as_dict()
        row["time"] = iso_time(cost.ts)
        row["last_event_time"] = iso_time(cost.last_event_ts)
        lease_ts = cost.first_lease_ts
        row["first_lease_time"] = None if lease_ts is None else iso_time(lease_ts)
        rows.append(row)
    return rows


def outage_row(outage: Outage) -> dict[str, Any]:
    """An outage as ``replay --json`` shows it (the lease and seconds null while it lasts)."""
    seconds = outage.seconds
    return {
        "epoch": outage.epoch,
        "crash_seq": outage.crash_seq,
        "crash_time": iso_time(outage.crash_ts),
        "crash_ts": outage.crash_ts,
        "first_lease_seq": outage.lease_seq,
        "first_lease_time": None if outage.lease_ts is None else iso_time(outage.lease_ts),
        "first_lease_ts": outage.lease_ts,
        "seconds": None if seconds is None else round(seconds, 3),
    }
