"""The current accelerator device, if this machine has one (CUDA, or what
``torch.accelerator`` knows: XPU, MPS, ...)."""

from __future__ import annotations

import torch


def current_accelerator() -> torch.device | None:
    """This process's current accelerator device, or None on a CPU-only machine."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        device = accelerator.current_accelerator()
        return torch.device(device.type, accelerator.current_device_index())
    return None
