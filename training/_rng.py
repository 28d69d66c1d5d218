"""The random number generator state of a rank, as tensors and plain values only."""

from __future__ import annotations

import random
from typing import Any

import torch

from dataflow import InvalidArgumentError
from training._accelerator import current_accelerator


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's (when installed), torch's CPU and the current accelerator device's
    RNG state. Only the current device: a checkpoint loads on a machine with another
    number of devices. Every value loads with ``torch.load(weights_only=True)``."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    device = current_accelerator()
    if device is not None:
        module = torch.get_device_module(device.type)
        state["accelerator"] = {"type": device.type, "state": module.get_rng_state(device.index)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned; parts this machine lacks are skipped.

    All or nothing: a part that cannot be applied raises ``InvalidArgumentError`` naming
    it, with every generator as it was before the call."""
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise InvalidArgumentError(f"not an rng_state() dict: {type(state).__name__}")
    before = rng_state()
    try:
        _apply(state)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as exc:
        _apply(before)
        raise InvalidArgumentError(
            f"not an rng_state() dict ({type(exc).__name__}: {str(exc)[:200]}): pass what "
            "training.rng_state() returned; every generator is left as it was"
        ) from exc


def _apply(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            n = state["numpy"]
            keys = n["keys"].numpy().astype(np.uint32)
            np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    saved = state.get("accelerator")
    device = current_accelerator()
    if saved is not None and device is not None and saved["type"] == device.type:
        torch.get_device_module(device.type).set_rng_state(saved["state"], device.index)
