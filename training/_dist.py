"""What the training components need from torch.distributed: one device (the core's
``flag_device``), one agreement."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from dataflow.live._collectives import flag_device, group_active
from training._errors import CheckpointError


def exchange(text: str, group: Any = None) -> list[str]:
    """Every rank's ``text``, in rank order: UTF-8 bytes through two all_gathers, no pickle."""
    device = flag_device(group)
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data is not None:
        padded[: data.numel()] = data.to(device)
    gathered = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [
        bytes(g[: int(n.item())].cpu().tolist()).decode()
        for g, n in zip(gathered, sizes, strict=True)
    ]


def _described(error: BaseException | None) -> str | None:
    """``error`` as its peers read it; never raises (its ``__str__`` is user code)."""
    if error is None:
        return None
    try:
        message = str(error)
    except Exception as exc:
        message = f"(its message could not be made: {type(exc).__name__})"
    return f"{type(error).__name__}: {message}"


def agree(
    error: BaseException | None,
    payload: Any = None,
    *,
    world_size: int,
    rank: int,
    what: str,
    group: Any = None,
) -> list[Any]:
    """Meet the other ranks; raise on every rank if any rank failed; return every payload.

    Each rank passes the error it caught since the last meeting (or None), so an
    error on one rank becomes an error on all of them instead of a peer left
    waiting in a collective. The rank that failed re-raises its own error; the
    others raise a CheckpointError naming it.
    """
    if not group_active(world_size):
        if error is not None:
            raise error
        return [payload]
    described = _described(error)
    try:
        text = json.dumps({"error": described, "payload": payload})
    except Exception as exc:  # before the collective: the peers wait in it
        if error is None:
            error = CheckpointError(
                f"{what}: rank {rank}'s payload cannot be sent to the other ranks as JSON "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            )
            described = _described(error)
        text = json.dumps({"error": described, "payload": None})
    replies = [json.loads(r) for r in exchange(text, group)]
    if error is not None:
        raise error
    failed = [(r, m["error"]) for r, m in enumerate(replies) if m["error"] is not None]
    if failed:
        who, why = failed[0]
        raise CheckpointError(f"{what} failed on rank {who} (this is rank {rank}): {why}")
    return [m["payload"] for m in replies]
