"""Gets from a Mooncake store: the head and tensors of samples read in one batch, checked."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataflow import CorruptFeatureError, StaleRefError
from dataflow.model import FeatureSpec, SampleRef
from stores import _tensors
from stores._mooncake_codes import BUFFER_TOO_SMALL, NOT_FOUND, NOT_READY, _error
from stores._mooncake_io import _Io
from stores._mooncake_records import (
    _FIX,
    _HEAD_CAP,
    _decode_record,
    _Record,
    _spec_doc,
    _specs_differ,
)
from stores._pool import Chunk, _view

#: The most bytes one read of get_many_into asks the pool for (more makes several reads).
_MANY_BYTES = 64 << 20

# A read of one sample: the ref, its non-empty tensors to read, where each goes, the head's place.
Read = tuple[SampleRef, Sequence[str], Mapping[str, tuple[int, int]], int]


@dataclass(frozen=True)
class _ReadLayout:
    """Where a get of some features puts each in its chunk; shared by every get of the
    same features (``_read_layout`` caches it), so never changed."""

    spans: Mapping[str, tuple[int, int]]  # name -> (offset, nbytes), in name order
    data: tuple[str, ...]  # the non-empty tensors, by name: one object each
    head_at: int  # where the head goes, after the tensors
    views: Mapping[str, tuple[int, FeatureSpec]]  # what the get returns, in the asked order


@functools.lru_cache(maxsize=1024)
def _read_layout(wanted: tuple[tuple[str, FeatureSpec], ...]) -> _ReadLayout:
    """The layout of a get of ``wanted`` (name, spec) pairs; samples of one run share
    their specs, so most gets find it made."""
    specs = dict(wanted)
    spans = _tensors.layout(specs)
    data = tuple(name for name in sorted(specs) if spans[name][1])
    views = {name: (spans[name][0], spec) for name, spec in wanted}
    return _ReadLayout(spans, data, _tensors.end_of(spans.values()), views)


def _span(layout: _ReadLayout) -> int:
    """The bytes of a chunk that a read of ``layout`` takes, its head included."""
    return _tensors.align(layout.head_at + _HEAD_CAP)


def _chunk_bytes(
    chunk: Chunk, base: int, spans: Mapping[str, tuple[int, int]]
) -> Callable[[str], np.ndarray]:
    """The bytes of each tensor read into ``chunk`` at ``base``, by name."""

    def of(name: str) -> np.ndarray:
        at, size = spans[name]
        return chunk.array[base + at : base + at + size]

    return of


def _tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> Callable[[str], np.ndarray]:
    """The bytes of each of ``tensors`` (contiguous, on the CPU), by name."""
    return lambda name: _tensors.byte_view(tensors[name]).numpy()


class _Gets:
    """A get reads the sample's head and tensors in one batch straight into registered
    memory that the returned tensors are views of, and checks the head and every tensor."""

    def __init__(self, io: _Io) -> None:
        self._io = io

    def get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        read = _read_layout(tuple((name, ref.specs[name]) for name in names))
        chunk = self._fetch_many([(ref, read.data, read.spans, read.head_at)])[0]
        return self._io.client.pool.views(chunk, read.views)

    def exists(self, ref: SampleRef) -> bool:
        try:
            chunk = self._fetch_many([(ref, [], {}, 0)])[0]
        except (StaleRefError, CorruptFeatureError):  # a corrupt head: nothing is readable
            return False
        self._io.client.pool.release(chunk)
        return True

    def get_many_into(self, items: list[tuple[SampleRef, dict[str, torch.Tensor]]]) -> None:
        # One batch for every head and tensor of the items. Over TCP Mooncake writes
        # into any memory, so the tensors go straight into the given ones and only the
        # heads into a registered chunk; RDMA reads only registered memory, so there
        # everything goes into one chunk and is copied out (the chunk is leased once
        # per batch size and reused). A batch ends before it would ask the pool for
        # more than _MANY_BYTES, and before a sample id it already reads: the client
        # fills only one buffer of a key that a batch names twice.
        groups: list[list[tuple[SampleRef, dict[str, torch.Tensor], _ReadLayout]]] = []
        size, ids = 0, set()
        for ref, out in items:
            layout = _read_layout(tuple((name, ref.specs[name]) for name in out))
            if not groups or size + _span(layout) > _MANY_BYTES or ref.sample_id in ids:
                groups.append([])
                size, ids = 0, set()
            groups[-1].append((ref, out, layout))
            size += _span(layout)
            ids.add(ref.sample_id)
        pool = self._io.client.pool
        for group in groups:
            reads = [(ref, layout.data, layout.spans, layout.head_at) for ref, _, layout in group]
            if not self._io.stage:  # TCP
                chunk, _ = self._fetch_many(reads, into=[out for _, out, _ in group])
                pool.release(chunk)
                continue
            chunk, bases = self._fetch_many(reads)
            try:
                for (_, out, layout), base in zip(group, bases, strict=True):
                    for name, target in out.items():
                        offset, spec = layout.views[name]
                        _tensors.copy(target, _view(chunk.tensor, base + offset, spec))
            finally:
                pool.release(chunk)

    def _fetch_many(
        self, reads: list[Read], into: list[dict[str, torch.Tensor]] | None = None
    ) -> tuple[Chunk, list[int]]:
        """Read the head and the ``data`` tensors of each ``(ref, data, spans, head_at)`` into
        one registered chunk, in one batch; the chunk and where each ref's layout starts.
        With ``into`` (TCP only), each read's tensors go into its dict's tensors instead,
        and the chunk holds the heads alone.

        Each ref is checked as a get checks it; the first that fails raises."""
        io = self._io
        client = io.client
        bases, total, keys = [], 0, []
        for ref, data, _spans, head_at in reads:
            record, *data_keys = io.keys.generation(ref.sample_id, ref.generation, list(data))
            if client.removals.is_pending(record):
                raise io.stale(ref, "deleted; its removal waits for a read lease")
            keys += [io.keys.head(ref.sample_id), *data_keys]
            bases.append(total)
            total += _HEAD_CAP if into is not None else _tensors.align(head_at + _HEAD_CAP)
        chunk = client.pool.lease(total)
        try:
            ptrs: list[int] = []
            sizes: list[int] = []
            heads: list[int] = []  # where each head goes in the chunk
            found: list[Callable[[str], np.ndarray]] = []  # where each read's tensors go
            for i, (_ref, data, spans, head_at) in enumerate(reads):
                base = bases[i]
                heads.append(base if into is not None else base + head_at)
                ptrs.append(chunk.ptr + heads[-1])
                if into is None:
                    ptrs += [chunk.ptr + base + spans[name][0] for name in data]
                    found.append(_chunk_bytes(chunk, base, spans))
                else:
                    ptrs += [into[i][name].data_ptr() for name in data]
                    found.append(_tensor_bytes(into[i]))
                sizes.append(_HEAD_CAP)
                sizes += [spans[name][1] for name in data]
            codes = io.read_batch(keys, ptrs, sizes)
            at = 0
            for i, (ref, data, _spans, _head_at) in enumerate(reads):
                n = 1 + len(data)
                self._check_fetched(
                    ref, data, chunk.array[heads[i] : heads[i] + _HEAD_CAP], keys[at : at + n],
                    codes[at : at + n], sizes[at : at + n], found[i],
                )  # fmt: skip
                at += n
        except BaseException:
            client.pool.release(chunk)
            raise
        return chunk, bases

    def _check_fetched(
        self,
        ref: SampleRef,
        data: Sequence[str],
        head_bytes: np.ndarray,
        keys: list[str],
        codes: list[int],
        sizes: list[int],
        tensor_bytes: Callable[[str], np.ndarray],
    ) -> None:
        """Raise unless ``ref``'s head (read into ``head_bytes``) and its ``data`` tensors
        (``tensor_bytes(name)``: the bytes read for a tensor) are its own."""
        io = self._io
        head_code = codes[0]
        head = None
        if head_code >= 0:
            with contextlib.suppress(CorruptFeatureError):  # read_record reads it again
                head = _decode_record(head_bytes[:head_code].tobytes(), ref.sample_id, keys[0])
        elif head_code not in (BUFFER_TOO_SMALL, NOT_READY, NOT_FOUND):
            raise _error(head_code, f"reading the head of {ref.sample_id!r}")
        if head is None and head_code != NOT_FOUND:
            head = io.read_record(keys[0], ref.sample_id)
        # Only the generation the head names is readable: no head means
        # deleted; a newer one, superseded; an older one, that this
        # generation never became current (its put died or lost a race
        # with another process's put), or was deleted and the id put
        # again by a client whose block of generations is older.
        if head is None:
            raise io.stale(ref, "deleted")
        if head.generation > ref.generation:
            raise io.stale(ref, f"superseded by generation {head.generation}")
        if head.generation < ref.generation:
            raise io.stale(ref, f"not current: the head names {head.generation}")
        if NOT_FOUND in codes[1:]:
            raise io.stale(ref, "deleted or superseded")
        for key, code, size in zip(keys[1:], codes[1:], sizes[1:], strict=True):
            if code == BUFFER_TOO_SMALL or 0 <= code != size:
                raise CorruptFeatureError(
                    f"{key}: read {code if code >= 0 else 'more than'} bytes, the ref's "
                    f"spec says {size}; the object does not match the ref"
                )
            if code < 0:
                raise _error(code, f"reading {key}")
        if head.specs is not None and head.specs != _spec_doc(ref.specs):
            raise _specs_differ(ref, head.specs, keys[0])  # the same bytes as another tensor
        if io.checksums:
            _verify(ref, head, data, keys[1:], tensor_bytes)


def _verify(
    ref: SampleRef,
    head: _Record,
    data: Sequence[str],
    keys: list[str],
    tensor_bytes: Callable[[str], np.ndarray],
) -> None:
    """Check the tensors ``data`` (``tensor_bytes(name)``) against the head's checksums."""
    for name, key in zip(data, keys, strict=True):
        if name not in head.checksums:
            raise CorruptFeatureError(
                f"{key}: the head of sample {ref.sample_id!r} generation {ref.generation} "
                f"lists features {head.names}, not {name!r}; {_FIX}"
            )
        _tensors.verify(
            tensor_bytes(name),
            head.checksums[name],
            sample_id=ref.sample_id,
            name=name,
            where=f"Mooncake key {key}",
            fix=_FIX,
        )
