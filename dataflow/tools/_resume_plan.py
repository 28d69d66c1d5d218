"""What a resume would do (``replay --plan-resume``), folded into a state of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataflow.live._replay import replay
from dataflow.model._errors import ArgumentTypeError, UnknownCheckpointError
from dataflow.model._events import Kind, dump_payload
from dataflow.model._exclusions import trained_after
from dataflow.model._fold import RunState
from dataflow.tools._run_report import on_disk

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

#: The actor of the resume event :func:`plan_resume` folds (it is never written).
PLAN_ACTOR = "dataflow-plan-resume"


def plan_resume(
    ledger: Ledger, run_id: str, checkpoint: object, *, upto_seq: int | None = None
) -> dict[str, Any]:
    """What ``Consumer.resume(checkpoint)`` would do now, without writing anything.

    ``checkpoint``: a step, ``"latest"`` or None (from scratch), as ``resume`` takes it.
    The run is folded, then one resume event, exactly as rank 0 would append it with
    the current epoch's settings (world size, release policy, attempts, order seed), is
    folded into that state alone. UnknownCheckpointError names the recorded steps.
    """
    if (
        checkpoint is not None
        and checkpoint != "latest"
        and (not isinstance(checkpoint, int) or isinstance(checkpoint, bool))
    ):  # as resume refuses them: True and 1.0 are no step 1
        raise ArgumentTypeError(
            'checkpoint must be a step (an int), "latest" or None, got '
            f"{type(checkpoint).__name__} {checkpoint!r:.100}"
        )
    state = replay(ledger, run_id, upto_seq=upto_seq)
    ckpt = None if checkpoint is None else state.checkpoint_for(checkpoint)
    if ckpt is None and checkpoint not in (None, "latest"):
        usable = sorted({c.step for c in state.checkpoints} - _removed_steps(state))
        removed = sorted(_removed_steps(state))
        raise UnknownCheckpointError(
            f"run {run_id!r} has no checkpoint at step {checkpoint} to resume from; "
            f"recorded steps: {usable[-20:] or 'none'}"
            + (f" (removed: {removed[-20:]})" if removed else "")
            + " (check --plan-resume; `latest` or `none` also work)"
        )
    trained_before, leased_before = dict(state.trained), dict(state.leased)
    # What the abandoned steps trained, by step: the samples to exclude when they went wrong.
    abandoned = trained_after(state, ckpt.step) if ckpt is not None else list(state.trained)
    epoch = state.epoch + 1
    node = state._epochs.get(state.epoch)  # the settings of the epoch a resume replaces
    payload: dict[str, Any] = {
        "checkpoint_seq": ckpt.seq if ckpt else None,
        "checkpoint_step": ckpt.step if ckpt else None,
        "world_size": state.world_size,
        "release_policy": state.release_policy,
        "max_attempts": node.max_attempts if node else 3,
    }
    if state.order_seed is not None:
        payload["order_seed"] = state.order_seed
    row = (
        state.head_seq + 1,
        Kind.RESUME,
        None,
        None,
        epoch,
        ckpt.step if ckpt else None,
        PLAN_ACTOR,
        dump_payload(payload),
        ledger.clock(),  # the clock of the run's other events
    )
    state.apply_rows((row,))
    plan = state.plans[epoch]
    # An excluded sample the resume drops from the trained set is not trained again.
    untrained = [s for s in trained_before if s not in plan.trained and s not in state.excluded]
    return {
        "run_id": run_id,
        "head_seq": row[0] - 1,
        "epoch": epoch,
        "checkpoint": None
        if ckpt is None
        else {"step": ckpt.step, "epoch": ckpt.epoch, "seq": ckpt.seq, "path": ckpt.path}
        | {"on_disk": on_disk(ckpt)},
        "world_size": plan.world_size,
        "release_policy": payload["release_policy"],
        "trained": len(plan.trained),
        "requeued": list(plan.requeued),
        "requeued_per_rank": [
            len(plan.requeued[rank :: plan.world_size]) for rank in range(plan.world_size)
        ],
        "released": list(plan.released),
        "regenerate": list(plan.regenerate),
        "untrained": untrained,
        "trained_after": abandoned,
        "excluded": len(state.excluded),
        "leases_voided": sorted(leased_before),
    }


def _removed_steps(state: RunState) -> set[int]:
    return {c.step for c in state.checkpoints if c.seq in state.removed_checkpoints}


# -- live status --------------------------------------------------------------------
