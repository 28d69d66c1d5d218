"""Memory for the tensors a store returns, recycled once the caller drops them.

Fresh memory costs a page fault per page on first touch, which for large
samples takes longer than the read itself. A get leases a chunk, reads into
it, and returns tensors that are views of the chunk; when the last of them is
garbage collected the chunk goes back to the pool for the next get. Mooncake
also needs the memory registered with its transfer engine, once per chunk
rather than per call: ``register``/``unregister`` hooks do that.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from dataflow.model import FeatureSpec
from stores._tensors import nbytes

_MIN_CHUNK = 64 << 10
_MiB = 1 << 20


class Chunk:
    __slots__ = ("array", "ptr", "size", "tensor")

    def __init__(self, size: int) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8)  # 64-byte aligned
        self.array = self.tensor.numpy()
        self.ptr = self.tensor.data_ptr()
        self.size = size


def chunk_size(nbytes: int) -> int:
    """Powers of two up to 1 MiB, whole MiB above: at most 2x (small) or +1 MiB waste."""
    if nbytes <= _MiB:
        return max(_MIN_CHUNK, 1 << (max(nbytes, 1) - 1).bit_length())
    return -(-nbytes // _MiB) * _MiB


class ChunkPool:
    """Chunks lent out and taken back; at most ``max_idle_bytes`` kept while unused."""

    def __init__(
        self,
        max_idle_bytes: int,
        *,
        register: Callable[[Chunk], None] | None = None,
        unregister: Callable[[Chunk], None] | None = None,
    ) -> None:
        self._max_idle = max_idle_bytes
        self._register = register
        self._unregister = unregister
        self._lock = threading.RLock()  # finalizers may run inside our own calls
        self._free: list[Chunk] = []
        self._idle = 0
        self._owned: dict[int, Chunk] = {}
        self._closed = False

    def lease(self, nbytes: int) -> Chunk:
        """A chunk of at least ``nbytes``; give it back with :meth:`release` or :meth:`views`."""
        with self._lock:
            fits = [c for c in self._free if nbytes <= c.size <= max(2 * nbytes, _MIN_CHUNK)]
            if fits:
                chunk = min(fits, key=lambda c: c.size)
                self._free.remove(chunk)
                self._idle -= chunk.size
                return chunk
        chunk = Chunk(chunk_size(nbytes))
        if self._register is not None:
            self._register(chunk)
            with self._lock:
                self._owned[chunk.ptr] = chunk
        return chunk

    def release(self, chunk: Chunk) -> None:
        dropped = []
        with self._lock:
            if self._closed:
                return
            self._free.append(chunk)
            self._idle += chunk.size
            while self._idle > self._max_idle and self._free:
                old = self._free.pop(0)
                self._idle -= old.size
                self._owned.pop(old.ptr, None)
                dropped.append(old)
        if self._unregister is not None:
            for old in dropped:
                self._unregister(old)

    def views(self, chunk: Chunk, spans: dict[str, tuple[int, FeatureSpec]]) -> dict:
        """Tensors over ``chunk`` (name -> (offset, spec)); the chunk returns when all die.

        The finalizer hangs on a numpy view that only the tensors' shared
        storage keeps alive, so it fires after the last view of any of them.
        Results smaller than the smallest chunk are copied out instead, so
        that keeping many small results does not keep as many chunks.
        """
        used = max((offset + nbytes(spec) for offset, spec in spans.values()), default=0)
        if used < _MIN_CHUNK:
            out = {name: _view(chunk.tensor, o, s).clone() for name, (o, s) in spans.items()}
            self.release(chunk)
            return out
        array = chunk.array[:]
        weakref.finalize(array, self.release, chunk)
        base = torch.from_numpy(array)
        del array
        return {name: _view(base, offset, spec) for name, (offset, spec) in spans.items()}

    def close(self) -> None:
        """Drop the idle chunks; lent-out memory stays valid for its tensors."""
        with self._lock:
            self._closed = True
            owned, self._owned, self._free = list(self._owned.values()), {}, []
        if self._unregister is not None:
            for chunk in owned:
                self._unregister(chunk)


def _view(base: torch.Tensor, offset: int, spec: FeatureSpec) -> torch.Tensor:
    return base[offset : offset + nbytes(spec)].view(spec.dtype).view(spec.shape)
