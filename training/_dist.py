"""The meetings of training's ranks: ``dataflow.live.agree``, with training's error type."""

from __future__ import annotations

from typing import Any

from dataflow import live
from training._errors import CheckpointError


def agree(
    error: BaseException | None,
    payload: Any = None,
    *,
    world_size: int,
    rank: int,
    what: str,
    group: Any = None,
) -> list[Any]:
    """``dataflow.live.agree`` among ``world_size`` ranks (this one is ``rank``): raise on
    every rank if any failed, else return every rank's payload.

    A peer's failure raises :class:`CheckpointError` (what callers of the checkpoint
    manager catch), carrying the failed rank's error. With one rank, or no process
    group, nothing is sent: ``error`` is raised, or ``[payload]`` returned.
    """
    if not live.group_active(world_size):
        if error is not None:
            raise error
        return [payload]
    del rank  # the group's own rank is the one the messages name
    return live.agree(error, payload, what=what, group=group, peer_error=CheckpointError)
