"""The round trips of one Mooncake store handle: records, heads and bytes, read and
written in batches, again while Mooncake asks for it (a lease that expired, a key
that another process is writing)."""

from __future__ import annotations

import contextlib
import time

from dataflow import CorruptFeatureError, StaleRefError, StoreError
from dataflow.model import SampleRef
from stores._mooncake_client import _Client
from stores._mooncake_codes import (
    _BUSY,
    BUFFER_TOO_SMALL,
    LEASE_EXPIRED,
    NOT_FOUND,
    NOT_READY,
    OK,
    _error,
)
from stores._mooncake_keys import KeyLayout
from stores._mooncake_records import _HEAD_CAP, _UNREADABLE, _decode_record, _Record

_READ_TRIES = 3


class _Io:
    """What every concern of a handle (put, get, delete, scan) reads and writes through.

    ``checksums`` and ``stage`` are the handle's switches: whether puts compute and
    gets check the tensors' checksums (benchmarks turn it off), and whether puts copy
    the tensors into registered memory first (RDMA reads nothing else).
    """

    def __init__(self, client: _Client, keys: KeyLayout, uri: str, *, stage: bool) -> None:
        self.client = client
        self.keys = keys
        self.uri = uri
        self.checksums = True
        self.stage = stage

    def stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )

    # -- reading -----------------------------------------------------------
    def read_small(self, keys: list[str]) -> list[bytes | int]:
        """Records (up to ``_HEAD_CAP`` bytes each) of ``keys`` in one batch: bytes, or the
        negative Mooncake code of a key that could not be read."""
        pool = self.client.pool
        chunk = pool.lease(len(keys) * _HEAD_CAP)
        try:
            ptrs = [chunk.ptr + i * _HEAD_CAP for i in range(len(keys))]
            codes = self.read_batch(keys, ptrs, [_HEAD_CAP] * len(keys))
            return [
                chunk.array[i * _HEAD_CAP : i * _HEAD_CAP + code].tobytes() if code >= 0 else code
                for i, code in enumerate(codes)
            ]
        finally:
            pool.release(chunk)

    def read_batch(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_get_into``, again while a read outlasted its lease (LEASE_EXPIRED).

        Mooncake grants a read lease (``-default_kv_lease_ttl``) and refuses
        the bytes when the transfer ended after it, since the object may have
        been removed meanwhile: read again. A lease shorter than a transfer
        fails every time; then say so.
        """
        for _ in range(_READ_TRIES):
            codes = self.client.call(self.client.raw.batch_get_into, keys, ptrs, sizes)
            if LEASE_EXPIRED not in codes:
                return codes
        key = keys[codes.index(LEASE_EXPIRED)]
        raise StoreError(
            f"reading {key} outlasted its read lease {_READ_TRIES} times (LEASE_EXPIRED): "
            "the master's lease (mooncake_master -default_kv_lease_ttl) is shorter than "
            f"a transfer of {sum(sizes)} bytes takes; give it a longer lease"
        )

    def read_heads(self, sample_ids: list[str]) -> list[_Record | None]:
        """The head of each sample in one batch: None where there is none, _UNREADABLE where
        it stays corrupt. Heads that are busy or do not decode are read once more alone."""
        keys = [self.keys.head(sample_id) for sample_id in sample_ids]
        out: list[_Record | None] = []
        for sample_id, key, got in zip(sample_ids, keys, self.read_small(keys), strict=True):
            if isinstance(got, bytes):
                with contextlib.suppress(CorruptFeatureError):
                    out.append(_decode_record(got, sample_id, key))
                    continue
            elif got == NOT_FOUND:
                out.append(None)
                continue
            elif got not in (NOT_READY, BUFFER_TOO_SMALL, LEASE_EXPIRED):
                raise _error(got, f"reading the head of {sample_id!r}")
            try:
                out.append(self.read_record(key, sample_id))
            except CorruptFeatureError:  # overwrite it: nothing else can read it
                out.append(_UNREADABLE)
        return out

    def read_record(self, key: str, sample_id: str) -> _Record | None:
        """The record (or head) at ``key``; None when there is none (or it stays not ready for 1 s).

        A record that does not decode is read once more before it counts as
        corrupt: a delete force-removes heads, and a reader racing that may see
        bytes of a removed object (see ``_Deletes.remove_generation``).
        """
        client = self.client
        pool, raw = client.pool, client.raw
        cap = _HEAD_CAP
        deadline, retried = time.monotonic() + 1.0, False
        while True:
            chunk = pool.lease(cap)
            try:
                code = client.call(raw.get_into, key, chunk.ptr, cap)
                data = chunk.array[:code].tobytes() if code >= 0 else b""
            finally:
                pool.release(chunk)
            if code >= 0:
                try:
                    return _decode_record(data, sample_id, key)
                except CorruptFeatureError:
                    if retried:
                        raise
                    retried = True
                    time.sleep(0.002)
            elif code == NOT_FOUND:
                return None
            elif code == NOT_READY:  # another process is writing it: wait a moment
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.002)
            elif code == LEASE_EXPIRED and time.monotonic() < deadline:
                continue  # see read_batch
            elif code == BUFFER_TOO_SMALL and cap == _HEAD_CAP:
                cap = max(raw.get_size(key), cap) * 2
            else:
                raise _error(code, f"reading {key}")

    # -- writing -----------------------------------------------------------
    def write(self, writes: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        """``batch_upsert_from`` of (key, address, size); the (key, code) of those that failed.

        Upsert, not put: a put of an existing key reports success and keeps the
        old bytes; the keys of a new generation are new anyway.
        """
        if not writes:
            return []
        keys, ptrs, sizes = (list(column) for column in zip(*writes, strict=True))
        client = self.client
        codes = client.call(client.raw.batch_upsert_from, keys, ptrs, sizes, client.config)
        return [(key, code) for key, code in zip(keys, codes, strict=True) if code != OK]

    def write_heads(self, heads: list[tuple[str, int, int]]) -> None:
        # Another process putting the same id right now holds its head for the
        # moment of its write (ILLEGAL_CLIENT, REPLICA_IS_NOT_READY): retry.
        deadline = time.monotonic() + 1.0
        while heads:
            failed = dict(self.write(heads))
            busy = [head for head in heads if failed.get(head[0]) in _BUSY]
            for key, code in failed.items():
                if code not in _BUSY or time.monotonic() > deadline:
                    raise _error(code, f"writing the head {key}")
            heads = busy
            if heads:
                time.sleep(0.002)

    def drop_head(self, sample_id: str, generation: int) -> bool:
        """Force-remove the head of ``sample_id`` while it names ``generation``; the caller
        holds the id's lock. True if it did.

        The head is read by every get, so it is nearly always under a lease; a
        queued removal could land after a later put made it name a newer
        generation. Forcing it right after the check keeps that race to one
        round trip (Mooncake has no compare-and-remove), and a reader racing
        the removal reads no head (or an unparseable one), which means "no
        newer generation".
        """
        key = self.keys.head(sample_id)
        try:
            head = self.read_record(key, sample_id)
        except CorruptFeatureError:  # we cannot tell whose it is: leave it
            return False
        if head is None or head.generation != generation:
            return False
        self.client.call(self.client.raw.remove, key, True)
        return True
