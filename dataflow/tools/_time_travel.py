"""The seq that ``replay --at-step`` and ``--at`` name, and the run's current lineage."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dataflow.live._replay import replay
from dataflow.model._errors import InvalidArgumentError
from dataflow.model._events import Kind
from dataflow.model._fold import RunState
from dataflow.tools._progress import PROGRESS_EVERY, Progress
from dataflow.tools._times import iso_time

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger


def lineage(state: RunState) -> list[tuple[int, int | None]]:
    """The current lineage, oldest epoch first: (epoch, step its child resumed from).

    The current epoch's step is None (nothing cut it yet).
    """
    chain: list[tuple[int, int | None]] = []
    epoch: int | None = state.epoch
    cut: int | None = None
    while epoch is not None and epoch in state.plans and len(chain) <= len(state.plans):
        chain.append((epoch, cut))
        checkpoint = state.plans[epoch].checkpoint
        if checkpoint is None:
            break
        cut, epoch = checkpoint.step, checkpoint.epoch
    return chain[::-1]


def seq_at_step(ledger: Ledger, run_id: str, step: int, *, progress: Progress | None = None) -> int:
    """The seq of the state at optimizer step ``step`` of the current lineage.

    The lineage's checkpoint at ``step`` if it has one, else its last ack at a step
    <= ``step``. ValueError (with the lineage's range of steps) when the lineage has no
    such event or never reached ``step``.
    """
    state = replay(ledger, run_id)
    chain = dict(lineage(state))
    checkpoints = {c.step: c.seq for c in state.lineage_checkpoints()}
    best_ack, low, high = 0, math.inf, -1
    for n, (seq, kind, _s, _r, epoch, ack_step, _a, _p, _t) in enumerate(ledger.rows(run_id), 1):
        if kind == Kind.ACK and epoch in chain and isinstance(ack_step, int):
            cut = chain[epoch]
            if cut is None or ack_step <= cut:
                low, high = min(low, ack_step), max(high, ack_step)
                if ack_step <= step:
                    best_ack = max(best_ack, seq)
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(seq)
    low, high = min([low, *checkpoints]), max([high, *checkpoints])
    if high < 0:
        raise InvalidArgumentError(
            f"the current lineage of run {run_id!r} has no acks or checkpoints yet: "
            "no step to go to (use --upto SEQ)"
        )
    if not low <= step <= high:
        raise InvalidArgumentError(
            f"the current lineage of run {run_id!r} goes from step {low} to step {high}; "
            f"step {step} is outside it"
        )
    if step in checkpoints:
        return checkpoints[step]
    return best_ack or max(seq for s, seq in checkpoints.items() if s <= step)


def seq_at_time(ledger: Ledger, run_id: str, ts: float, *, progress: Progress | None = None) -> int:
    """The seq of the run's last event with a timestamp <= ``ts``.

    ValueError when the run's first event is later than ``ts``.
    """
    best, first = 0, None
    for n, (seq, *_, event_ts) in enumerate(ledger.rows(run_id), 1):
        first = event_ts if first is None else min(first, event_ts)
        if event_ts <= ts:
            best = max(best, seq)
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(seq)
    if not best:
        raise InvalidArgumentError(
            f"run {run_id!r} starts at {iso_time(first or 0)}, after {iso_time(ts)}; "
            "pass a later time"
        )
    return best


# -- the report fold ----------------------------------------------------------------
