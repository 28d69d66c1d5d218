"""What a checkpoint may hold: what ``torch.load(weights_only=True)`` reads back as it was.

Checked before anything is written, so a save fails with the path of the offending
value instead of a pickling error halfway through, or worse, a file that saves but
cannot be resumed (a meta tensor saves fine and loads without its data).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch

from dataflow import InvalidArgumentError

_LEAVES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        torch.dtype,
        torch.device,
        torch.Size,
        torch.layout,
    }
)
_MAPPINGS = frozenset({dict, collections.OrderedDict})
_SEQUENCES = frozenset({list, tuple, set})
_HINT = (
    "keep checkpoint state to state dicts, tensors, containers (dict, list, tuple, set) and scalars"
)


def check_storable(value: Any, where: str) -> None:
    """Raise ValueError naming the first value under ``where`` that a weights-only load
    would refuse or read back differently."""
    try:
        _check(value, where, set())
    except RecursionError:
        raise InvalidArgumentError(
            f"{where} is nested deeper than Python can walk (more than about "
            f"{sys.getrecursionlimit() // 2} levels); flatten it (e.g. join the deep keys)"
        ) from None


def _check(value: Any, where: str, path: set[int]) -> None:
    kind = type(value)
    if kind in _LEAVES:
        return
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise InvalidArgumentError(
                f"{where} is a meta tensor: it has no data to save, and would load as "
                "garbage; materialize it first (e.g. module.to_empty(device='cpu') and "
                "initialize it, or load real weights)"
            )
        return
    if kind in _MAPPINGS or kind in _SEQUENCES:
        if id(value) in path:
            raise InvalidArgumentError(f"{where} contains itself; a checkpoint must be a tree")
        path.add(id(value))
        if kind in _MAPPINGS:
            for key, item in value.items():
                if type(key) not in _LEAVES:
                    raise InvalidArgumentError(
                        f"{where} has a key of type {_name(type(key))}; use str or int keys"
                    )
                _check(item, f"{where}[{key!r}]", path)
        else:
            for index, item in enumerate(value):
                _check(item, f"{where}[{index}]", path)
        path.discard(id(value))
        return
    if callable(value):
        raise InvalidArgumentError(
            f"{where} is {_name(kind)} {getattr(value, '__qualname__', '')!s:.60}, code, not "
            "data: a checkpoint cannot hold it (torch.load(weights_only=True) refuses "
            "code); save its configuration or what it computes, and rebuild it on resume"
        )
    raise InvalidArgumentError(
        f"{where} is of type {_name(kind)}, which torch.load(weights_only=True) cannot read "
        f"back; {_HINT} (e.g. save its state_dict() or its fields)"
    )


def _name(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


#: What an absent (None) entry is stored as, so every save writes the same entries.
ABSENT = {"__dataflow_training__": "absent"}
_MAX_STEP = 2**63 - 1  # the ledger's step column is a 64-bit integer


def check_step(step: object) -> int:
    """``step``, checked: an int in [0, 2**63 - 1] (the ledger's step column)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidArgumentError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    if step > _MAX_STEP:
        raise InvalidArgumentError(f"step must fit in 64 bits (<= 2**63 - 1), got {step}")
    return step


def without_absent(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as saved, each ``ABSENT`` marker back to None."""
    return {k: None if isinstance(v, dict) and v == ABSENT else v for k, v in state.items()}
