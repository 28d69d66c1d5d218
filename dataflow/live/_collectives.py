"""The few collectives the core runs when torch.distributed is initialized.

A process group exists only where torch was imported, so nothing here imports
torch unless one does. Every collective runs on the default group, on the
device its backend communicates from (CUDA under NCCL: a CPU tensor there
fails), and a rank that failed joins it anyway: a failure on one rank becomes
an error on every rank instead of a peer left waiting until the group's timeout.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from dataflow.model._errors import PeerFailedError

if TYPE_CHECKING:
    import torch

#: Backends that communicate from an accelerator, and the device type they use.
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


def group_active(world_size: int) -> bool:
    """Whether ``world_size`` ranks share an initialized default process group."""
    torch = sys.modules.get("torch")
    return (
        world_size > 1
        and torch is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def flag_device(group: Any = None) -> torch.device:
    """The device ``group`` (the default one: None) communicates from: this process's
    current accelerator under an accelerator's backend (``"nccl"``, ``"cpu:gloo,cuda:nccl"``),
    else the CPU. Derived from the backend, so every rank of a group picks alike."""
    import torch

    backend = str(torch.distributed.get_backend(group)).lower()
    for name, device_type in _ACCELERATOR_BACKENDS.items():
        if name in backend:
            return torch.device(device_type, getattr(torch, device_type).current_device())
    return torch.device("cpu")


def broadcast_int(value: int) -> int:
    """Rank 0's ``value``, on every rank of the default group."""
    import torch

    tensor = torch.tensor([value], dtype=torch.int64, device=flag_device())
    torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


def agree(error: Exception | None, *, what: str) -> None:
    """Meet every rank of the default group; raise on each if any rank passed an error.

    The rank that failed raises its own ``error``; the others raise a
    :class:`PeerFailedError` naming the ranks that failed. With no error
    anywhere it returns once every rank got here, as a barrier would.
    """
    import torch

    dist = torch.distributed
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=flag_device())
    if error is not None:
        flags[dist.get_rank()] = 1
    dist.all_reduce(flags)
    if error is not None:
        raise error
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if failed:
        ranks = ", ".join(map(str, failed))
        raise PeerFailedError(
            f"{what} failed on rank {ranks} (this is rank {dist.get_rank()}); see the error "
            "raised there"
        )


def join_loopback_gloo(rank: int, world_size: int, port: int, *, timeout_s: float) -> None:
    """Join a gloo group whose rank 0 listens on 127.0.0.1:``port``, on loopback only: the
    processes of one machine (the demo's ranks, the benchmarks', the tests')."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
