"""In-process feature store: tensors live in this process's memory."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    StaleRefError,
    StoreError,
    StoreFullError,
)
from dataflow.interfaces import FeatureStore, StoredObject, StoreStats
from dataflow.model import FeatureSpec, SampleRef

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

# One counter for every store of the process: a store closed and re-created
# under the same name must not hand out a generation that an old ref still names.
_generations = itertools.count(1)

_live: weakref.WeakValueDictionary[str, LocalFeatureStore] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


class LocalFeatureStore(FeatureStore):
    """Keeps features in process memory; for a single process (tests, notebooks, demos).

    ``put`` copies the tensors once (the store owns its memory); ``get`` returns
    the stored tensors themselves, without a copy, so its cost does not grow
    with the sample size. Treat what ``get`` returns as read-only.

    ``max_bytes`` bounds the resident tensor bytes; a put beyond it raises
    StoreFullError (a MemoryError). Stores are named (``mem://NAME``); at most
    one live store per name exists in a process (a second one raises
    StoreError), and ``stores.open_store("mem://NAME")`` returns it, or
    creates it when none is live. A closed store gives its name back.
    ``scan`` lists a snapshot taken under the store's lock.
    """

    def __init__(self, name: str | None = None, *, max_bytes: int | None = None) -> None:
        name = uuid.uuid4().hex[:12] if name is None else name
        if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
            raise InvalidRefError(f"store name {name!r} must be 1+ characters from [A-Za-z0-9._-]")
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
        ):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        super().__init__(f"mem://{name}")
        self.name = name
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # sample id -> (generation, tensors, tensor bytes, when it was put)
        self._objects: dict[str, tuple[int, dict[str, torch.Tensor], int, float]] = {}
        self._bytes = 0
        with _live_lock:
            if _live.get(name) is not None:
                raise StoreError(
                    f"a LocalFeatureStore named {name!r} is already live in this process; "
                    f"share it through stores.open_store('mem://{name}') or close it first"
                )
            _live[name] = self

    @classmethod
    def from_uri(cls, uri: str) -> LocalFeatureStore:
        """The live store named by ``mem://NAME``, created when none is live."""
        name = uri.removeprefix("mem://")
        if not uri.startswith("mem://") or "/" in name or "?" in name:
            raise InvalidRefError(f"{uri!r} is not a mem:// URI; use mem://NAME")
        with _live_lock:
            store = _live.get(name)
        if store is not None:
            return store
        try:
            return cls(name)
        except StoreError:  # another thread created it meanwhile
            return cls.from_uri(uri)

    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        # empty_like + copy_ rather than clone: one copy that also materialises
        # conj/neg views and expanded (stride-0) inputs into dense memory.
        owned = {
            name: torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t.detach())
            for name, t in tensors.items()
        }
        size = sum(t.numel() * t.element_size() for t in owned.values())
        with self._lock:
            old = self._objects.get(sample_id)
            freed = old[2] if old else 0
            if self.max_bytes is not None and self._bytes - freed + size > self.max_bytes:
                raise StoreFullError(
                    f"putting {sample_id!r} ({size} bytes) would exceed max_bytes="
                    f"{self.max_bytes} ({self._bytes} in use); delete released samples first"
                )
            generation = next(_generations)
            self._objects[sample_id] = (generation, owned, size, time.time())
            self._bytes += size - freed
        specs = {name: FeatureSpec.of(t) for name, t in owned.items()}
        return SampleRef(sample_id, self.uri, generation, specs, metadata)

    def _lookup(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        entry = self._objects.get(ref.sample_id)
        if entry is None or entry[0] != ref.generation:
            raise StaleRefError(
                f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} "
                "(deleted or superseded)"
            )
        return entry[1]

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        with self._lock:
            stored = self._lookup(ref)
        out = {}
        for name in names:
            tensor, spec = stored.get(name), ref.specs[name]
            if tensor is None or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                # A ref made by hand, or of another store: its specs are not what was put.
                raise CorruptFeatureError(
                    f"{self.uri}: feature {name!r} of sample {ref.sample_id!r} generation "
                    f"{ref.generation} is not what the ref describes ({spec.dtype}, "
                    f"{list(spec.shape)}): the ref was not made by this store's put"
                )
            out[name] = tensor
        return out

    def _delete(self, ref: SampleRef) -> None:
        self._delete_generation(ref.sample_id, ref.generation)

    def _delete_stored(self, obj: StoredObject) -> bool:
        return self._delete_generation(obj.sample_id, obj.generation)

    def _delete_generation(self, sample_id: str, generation: int) -> bool:
        with self._lock:
            entry = self._objects.get(sample_id)
            if entry is None or entry[0] != generation:
                return False
            del self._objects[sample_id]
            self._bytes -= entry[2]
            return True

    def _exists(self, ref: SampleRef) -> bool:
        with self._lock:
            entry = self._objects.get(ref.sample_id)
            return entry is not None and entry[0] == ref.generation

    def _scan(self) -> Iterator[StoredObject]:
        with self._lock:
            entries = [(sid, e[0], e[2], e[3]) for sid, e in self._objects.items()]
        return (StoredObject(*entry) for entry in entries)

    def _stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(objects=len(self._objects), bytes=self._bytes)

    def _close(self) -> None:
        with _live_lock:
            if _live.get(self.name) is self:
                del _live[self.name]
        with self._lock:
            self._objects.clear()
            self._bytes = 0
