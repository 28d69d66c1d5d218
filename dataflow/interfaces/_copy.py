"""Tensor bytes copied as one single-threaded memcpy, for the stores' reads into memory
they are given. Nothing here imports torch before a tensor is handed in."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view; no copy.

    Goes through ``reshape(-1)`` because ``view(dtype)`` refuses 0-d tensors,
    and through uint8 because numpy has no bfloat16, float8 or complex32.
    """
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for a dense ``target`` of the same dtype and shape.

    Dense CPU sources go through numpy as one single-threaded memcpy: torch's
    copy_ opens an OpenMP parallel region, which crawls when another process
    holds one of the cores (on 2 cores beside a Mooncake master, 2.3 ms
    instead of 20 us per MiB).
    """
    if (
        source.device.type == "cpu"
        and target.device.type == "cpu"
        and source.is_contiguous()
        and not source.is_conj()
        and not source.is_neg()
    ):
        byte_view(target).numpy()[...] = byte_view(source.detach()).numpy()
    else:
        target.copy_(source.detach())
