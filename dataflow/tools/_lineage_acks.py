"""Each sample's acks in a run's final lineage, counted from the events alone.

A second count beside the fold's, for the demo's report and the fault trials: a sample
acked twice in the final lineage shows as 2 here whatever the fold made of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from dataflow.model._events import Event, Kind


def final_lineage_acks(events: Iterable[Event]) -> Counter[str]:
    """Each sample's acks in the run's final lineage, from the events alone.

    A resume from the checkpoint at step S of epoch E starts an epoch whose lineage is
    E's acks up to S, and so on back; what E acked after S was abandoned.
    """
    checkpoint_at: dict[int, tuple[int, int]] = {}  # seq -> (epoch, step)
    parent: dict[int, tuple[int, int] | None] = {}  # epoch -> (epoch, step) it resumed from
    acks: dict[int, list[tuple[int, str]]] = {}  # epoch -> (step, sample id)
    final = 0
    for event in events:
        if event.kind == Kind.CHECKPOINT:
            checkpoint_at[event.seq] = (event.epoch, event.step or 0)
        elif event.kind == Kind.RESUME:
            seq = event.payload.get("checkpoint_seq")
            parent[event.epoch] = checkpoint_at.get(seq) if seq is not None else None
            final = event.epoch
        elif event.kind == Kind.ACK and event.sample_ids:
            acks.setdefault(event.epoch, []).extend(
                (step or 0, s) for s, step in zip(event.sample_ids, event.sample_steps, strict=True)
            )
    counts: Counter[str] = Counter()
    epoch: int | None = final
    cut: int | None = None
    while epoch:
        counts.update(sid for step, sid in acks.get(epoch, ()) if cut is None or step <= cut)
        back = parent.get(epoch)
        epoch, cut = back if back is not None else (None, None)
    return counts
