"""The current accelerator device, if this machine has one (CUDA, or what
``torch.accelerator`` knows: XPU, MPS, ...)."""

from __future__ import annotations

import torch


def current_accelerator(*, initialize: bool = True) -> torch.device | None:
    """This process's current accelerator device, or None on a CPU-only machine.

    ``initialize=False``: None also while this process has not started using the
    accelerator, instead of starting it (for CUDA that creates a context, hundreds of
    MiB of the device's memory, in a job that may never use the device).
    """
    if torch.cuda.is_available():
        if not initialize and not torch.cuda.is_initialized():
            return None
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        device = accelerator.current_accelerator()
        module = torch.get_device_module(device.type)
        started = getattr(module, "is_initialized", None)
        if not initialize and started is not None and not started():
            return None
        return torch.device(device.type, accelerator.current_device_index())
    return None
