"""Tensors as raw bytes, for the stores that keep bytes (shared directory, Mooncake).

A sample's tensors are laid out in name order, each at an offset aligned to
:data:`ALIGN` bytes, so that any dtype can be viewed in place and a reader
that knows the specs (the ref carries them) can compute the layout itself.
Each tensor's bytes get an XXH3-64 checksum (:func:`checksum`) that the stores
keep beside them and check on every read (:func:`verify`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from dataflow import CorruptFeatureError
from dataflow.interfaces import byte_view as byte_view  # the core's, for the stores
from dataflow.interfaces import copy as copy
from dataflow.model import FeatureSpec, dtype_name

#: Alignment of every tensor in a byte layout (a cache line; enough for any dtype).
ALIGN = 64


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous CPU tensor with plain bits (copies only when it must)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


def checksum(data: Any) -> str:
    """XXH3-64 of a buffer (the numpy view of a :func:`byte_view`, a slice of a chunk) as
    16 hex digits; it hashes the memory in place, without a copy."""
    return xxhash.xxh3_64_hexdigest(data)


def verify(data: Any, written: object, *, sample_id: str, name: str, where: str, fix: str) -> None:
    """Raise CorruptFeatureError unless ``data`` hashes to the ``written`` checksum.

    ``where`` names the file or key, ``fix`` says what the user should do about it.
    """
    if written is None:
        raise CorruptFeatureError(
            f"{where}: feature {name!r} of sample {sample_id!r} was stored without a "
            f"checksum (by a handle with checksums switched off), so it cannot be verified; {fix}"
        )
    got = checksum(data)
    if got != written:
        raise CorruptFeatureError(
            f"{where}: feature {name!r} of sample {sample_id!r} fails its checksum (xxh3 "
            f"{got}, {written} when it was put): its bytes changed after the put; {fix}"
        )


@functools.cache
def dtype_str(dtype: torch.dtype) -> str:
    """``dtype_name``, cached: headers name dtypes on every put and get."""
    return dtype_name(dtype)


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes(spec: FeatureSpec) -> int:
    """``spec.nbytes`` without allocating a tensor on every call."""
    return math.prod(spec.shape) * itemsize(spec.dtype)


def empty(spec: FeatureSpec) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype)


def layout(specs: Mapping[str, FeatureSpec], start: int = 0) -> dict[str, tuple[int, int]]:
    """``name -> (offset, nbytes)`` for ``specs`` packed in name order from ``start``.

    Name order (not insertion order) because a ref that went through JSON comes
    back with its specs sorted.
    """
    out: dict[str, tuple[int, int]] = {}
    offset = align(start)
    for name in sorted(specs):
        size = nbytes(specs[name])
        out[name] = (offset, size)
        offset = align(offset + size)
    return out


def end_of(spans: Iterable[tuple[int, int]], start: int = 0) -> int:
    """First aligned offset after every ``(offset, nbytes)`` span."""
    return align(max((offset + nbytes for offset, nbytes in spans), default=start))
