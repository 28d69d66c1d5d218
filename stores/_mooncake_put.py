"""Puts to a Mooncake store: a batch of samples in as many round trips as one."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataflow import InvalidRefError
from dataflow.model import FeatureSpec, SampleRef
from stores import _tensors
from stores._mooncake_codes import _BUSY, _error
from stores._mooncake_io import _Io
from stores._mooncake_records import _HEAD_CAP, _UNREADABLE, _encode_record, _Record
from stores._pool import Chunk

Item = tuple[str, dict[str, torch.Tensor], dict[str, Any]]


@dataclass
class _Put:
    """One sample of a put batch, ready to send: everything but its generation."""

    sample_id: str
    specs: dict[str, FeatureSpec]
    names: list[str]  # the non-empty tensors, by name: one object each
    sources: list[int]  # their addresses, in the order of names
    sizes: list[int]  # their sizes in bytes, in the order of names
    sums: dict[str, str | None]
    nbytes: int
    keep: list[torch.Tensor]  # what keeps the sources alive (dense tensors)
    staged: Chunk | None = None  # the registered copy an RDMA put sends from


def _distinct_runs(items: list[Any]) -> Iterator[list[Any]]:
    """``items`` cut into runs in which no sample id repeats (a repeat starts the next run)."""
    run: list[Any] = []
    seen: set[str] = set()
    for item in items:
        if item[0] in seen:
            yield run
            run, seen = [], set()
        run.append(item)
        seen.add(item[0])
    if run:
        yield run


class _Puts:
    """A put reads the sample's head, takes a generation above it, writes tensors and
    record (and the head, when the sample has none yet) in one batch, then makes the
    new head current and removes the generation it superseded."""

    def __init__(self, io: _Io) -> None:
        self._io = io

    def put_batch(self, items: list[Item]) -> list[SampleRef]:
        """Put samples of distinct ids; ``_commit`` does the round trips."""
        io = self._io
        client = io.client
        puts: list[_Put] = []
        try:
            for sample_id, tensors, _ in items:
                puts.append(self._prepare(sample_id, tensors))
            with client.id_locks(io.keys.head(put.sample_id) for put in puts):
                generations = self._commit(puts)
        finally:
            for put in puts:
                if put.staged is not None:
                    client.pool.release(put.staged)
        return [
            SampleRef(put.sample_id, io.uri, generation, put.specs, metadata)
            for put, generation, (_, _, metadata) in zip(puts, generations, items, strict=True)
        ]

    def _prepare(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> _Put:
        """Dense bytes, sizes and checksums of one sample, before any round trip."""
        specs = {name: FeatureSpec.of(t) for name, t in tensors.items()}
        if self._io.stage:
            return self._stage(sample_id, tensors, specs)
        checksums = self._io.checksums
        names, sources, sizes, keep = [], [], [], []
        sums: dict[str, str | None] = {}
        for name in sorted(specs):
            tensor = _tensors.dense(tensors[name])
            size = tensor.nbytes
            if size:  # an empty tensor gets no object: its spec says all there is
                names.append(name)
                sources.append(tensor.data_ptr())
                sizes.append(size)
                keep.append(tensor)
                data = _tensors.byte_view(tensor).numpy()
                sums[name] = _tensors.checksum(data) if checksums else None
        return _Put(sample_id, specs, names, sources, sizes, sums, sum(sizes), keep)

    def _stage(
        self, sample_id: str, tensors: dict[str, torch.Tensor], specs: dict[str, FeatureSpec]
    ) -> _Put:
        """``_prepare`` over RDMA: the tensors copied into registered memory, sent from there."""
        spans = _tensors.layout(specs)
        names = [name for name in sorted(specs) if spans[name][1]]
        sizes = [spans[name][1] for name in names]
        if not names:
            return _Put(sample_id, specs, [], [], [], {}, 0, [])
        pool = self._io.client.pool
        chunk = pool.lease(_tensors.end_of(spans.values()))
        sources, sums = [], {}
        try:
            for name in names:
                offset, nbytes = spans[name]
                target = chunk.tensor[offset : offset + nbytes].view(specs[name].dtype)
                _tensors.copy(target.view(specs[name].shape), tensors[name])
                sources.append(chunk.ptr + offset)
                data = chunk.array[offset : offset + nbytes]
                sums[name] = _tensors.checksum(data) if self._io.checksums else None
        except BaseException:
            pool.release(chunk)
            raise
        return _Put(sample_id, specs, names, sources, sizes, sums, sum(sizes), [], chunk)

    def _commit(self, puts: list[_Put]) -> list[int]:
        """Store a batch of samples of distinct ids (their locks held); their generations.

        Round trips: one batch reads the heads; one batch writes every tensor
        and record, and the head of each sample that has none yet (nobody can
        hold a ref that it would make stale); the heads that replace others
        go in a second batch, only once the tensors are in, so that a put that
        fails never leaves a head naming missing bytes. Then the superseded
        generations are removed (queued while read leases last).

        Another process may put one of these ids at the same moment: both puts
        succeed, the head written last is current, and the other's generation
        is left unreadable (its objects go with a delete of its ref, or with a
        ``delete_stored`` of what ``scan`` lists).
        """
        io = self._io
        client, keys = io.client, io.keys
        olds = io.read_heads([put.sample_id for put in puts])
        floors = [old.generation + 1 if old is not None else 0 for old in olds]
        generations = client.generations(keys.namespace).take(floors)
        created = time.time()
        records = [
            _encode_record(put.sample_id, generation, created, put.nbytes, put.sums, put.specs)
            for put, generation in zip(puts, generations, strict=True)
        ]
        for put, record in zip(puts, records, strict=True):
            if len(record) > _HEAD_CAP:  # before anything is written
                raise InvalidRefError(
                    f"{put.sample_id!r} has too many features for its record ({_HEAD_CAP} bytes)"
                )
        offsets = list(itertools.accumulate((_tensors.align(len(r)) for r in records), initial=0))
        chunk = client.pool.lease(offsets[-1])
        try:
            writes, first, replacing = [], [], []
            for put, generation, old, record, at in zip(
                puts, generations, olds, records, offsets, strict=False
            ):
                chunk.array[at : at + len(record)] = np.frombuffer(record, np.uint8)
                put_keys = keys.generation(put.sample_id, generation, put.names)
                writes.append((put_keys[0], chunk.ptr + at, len(record)))
                writes += zip(put_keys[1:], put.sources, put.sizes, strict=True)
                head = (keys.head(put.sample_id), chunk.ptr + at, len(record))
                (first if old is None else replacing).append(head)
            heads = {head[0]: head for head in first + replacing}
            failed = io.write(writes + first)
            for key, code in failed:
                if key not in heads or code not in _BUSY:
                    raise _error(code, f"writing {key}")
            # A head busy with another process's write, and the ones that replace others.
            io.write_heads([heads[key] for key, _ in failed] + replacing)
        except BaseException:
            self._undo(puts, generations, olds)
            raise
        finally:
            client.pool.release(chunk)
        superseded = [
            keys.generation(put.sample_id, old.generation, old.names)
            for put, old in zip(puts, olds, strict=True)
            if old is not None and old is not _UNREADABLE
        ]
        if superseded:
            client.removals.remove_generations(superseded)
        return generations

    def _undo(self, puts: list[_Put], generations: list[int], olds: list[_Record | None]) -> None:
        """Remove what a failed ``_commit`` wrote (the ids' locks are held).

        A sample whose head already names its new generation loses its head,
        and the generation that head superseded goes too: as after put + delete.
        """
        io = self._io
        removals, keys = io.client.removals, io.keys
        for put, generation, old in zip(puts, generations, olds, strict=False):
            dropped = io.drop_head(put.sample_id, generation)
            removals.remove_generations([keys.generation(put.sample_id, generation, put.names)])
            if dropped and old not in (None, _UNREADABLE):
                removals.remove_generations(
                    [keys.generation(put.sample_id, old.generation, old.names)]
                )
