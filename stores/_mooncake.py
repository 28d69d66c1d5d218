"""Feature store on a Mooncake distributed store (``mooncake.store``), zero-copy.

Keys (``/`` separated; ``@`` is in neither sample ids nor feature names, so no
key of one sample can be a key of another, nor of the namespace's own)::

    {namespace}/{sample_id}/g{generation}/{name}   raw bytes of one non-empty tensor
    {namespace}/{sample_id}/g{generation}/@        the generation's record
    {namespace}/{sample_id}/@head                  the current generation's record, again
    {namespace}/@generations/{base}                claim of generations base .. base + 2**20 - 1

A record is ``b"DFHEAD02" | u64 xxh3 of the JSON (little endian) | JSON``, the
JSON ``{"sample_id", "generation", "created", "nbytes", "xxh3": {name: 16 hex
digits}}``: when it was put (seconds since the epoch), its tensor bytes, and
the XXH3-64 of each non-empty tensor's bytes. Every get reads the head with the
tensors and checks both: a head that fails its checksum, or names another
sample, is corruption; an intact head of another generation makes the ref
stale. ``scan`` reads the generations' records (and lists what a removal
killed midway left); a removal takes the head, then the tensors, then the
record, so that a crash at any moment leaves something ``scan`` lists.

Every Mooncake return code is translated into the dataflow error tree in
:func:`stores._mooncake_codes._error`, and nowhere else; the client and its
generation numbers are in :mod:`stores._mooncake_client`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import re
import socket
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    InvalidSampleIdError,
    StaleRefError,
    StoreError,
    StoreUnavailableError,
)
from dataflow.interfaces import FeatureStore, StoredObject
from dataflow.model import FeatureSpec, SampleRef, validate_sample_id
from stores import _tensors
from stores._mooncake_client import _OPENER, _acquire, _release, _Settings, _split_host_port
from stores._mooncake_codes import (
    _BUSY,
    BUFFER_TOO_SMALL,
    LEASE_EXPIRED,
    NOT_FOUND,
    NOT_READY,
    OK,
    _error,
)
from stores._pool import Chunk, _view

_READ_TRIES = 3
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEAD_CAP = 16384
#: The most bytes one read of get_many_into asks the pool for (more makes several reads).
_MANY_BYTES = 64 << 20
_HEAD_MAGIC = b"DFHEAD02"
_HEAD_FAMILY = b"DFHEAD"
_HEAD_SUM = struct.Struct("<Q")
_SCAN_BATCH = 128
#: Port of the master's HTTP server (``mooncake_master -metrics_port``) by default.
ADMIN_PORT = 9003
_GENERATION_KEY_RE = re.compile(r"(.+)/g(0|[1-9][0-9]{0,19})/(@|[A-Za-z0-9_.-]{1,128})")
_HEAD_KEY_RE = re.compile(r"(.+)/@head")
# What a regex (ECMAScript, Mooncake's remove_by_regex) must escape of a key's characters.
_REGEX_SPECIAL = re.compile(r"[.^$*+?()\[\]{}|\\]")
_FIX = "delete the sample (store.delete(ref)) and put it again (regenerate it)"
_MiB = 1 << 20
_SIZE_RE = re.compile(r"(\d+)\s*([KMG]i?B?)?", re.IGNORECASE)
log = logging.getLogger(__name__)


def store_uri(master: str, metadata: str, protocol: str, namespace: str) -> str:
    """The canonical ``mooncake://`` URI (identity only: no tuning knobs)."""
    query = urllib.parse.urlencode(
        {"metadata": metadata, "protocol": protocol, "namespace": namespace},
        quote_via=urllib.parse.quote,
        safe="",
    )
    return f"mooncake://{master}?{query}"


def _parse_size(text: str, what: str) -> int:
    match = _SIZE_RE.fullmatch(text.strip())
    if not match:
        raise InvalidRefError(f"{what}={text!r} is not a size like 536870912, 512M or 1GiB")
    unit = (match.group(2) or "")[:1].upper()
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]


def _parse_key(key: str, start: int) -> tuple[str, str, int]:
    """What the key of a namespace (from ``start`` on) is: ``("record" | "tensor" | "head",
    sample_id, generation)`` (generation -1 for a head); ``("", "", -1)`` for anything
    else (a claim of generations, or a key that no dataflow writes)."""
    match = _GENERATION_KEY_RE.fullmatch(key, start)
    head = None if match else _HEAD_KEY_RE.fullmatch(key, start)
    found = match or head
    if found is None:
        return "", "", -1
    try:
        sample_id = validate_sample_id(found.group(1))
    except InvalidSampleIdError:
        return "", "", -1
    if head is not None:
        return "head", sample_id, -1
    kind = "record" if match.group(3) == "@" else "tensor"
    return kind, sample_id, int(match.group(2))


def _local_address_towards(host: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # UDP: picks the route, sends nothing
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostname()


# -- records ------------------------------------------------------------------
# Made once: json.dumps with options builds an encoder on every call.
_RECORD_ENCODER = json.JSONEncoder(separators=(",", ":"))
_RECORD_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class _Record:
    """What a generation's record (and the head, a copy of the current one) says."""

    generation: int
    created: float  # seconds since the epoch
    nbytes: int  # tensor bytes
    checksums: dict[str, str | None]  # name -> xxh3 of each non-empty tensor, by name
    # name -> [dtype, shape] of every feature (_spec_doc); None in heads written before
    # dataflow recorded them, which are read unchecked.
    specs: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.checksums)


def _spec_doc(specs: Mapping[str, FeatureSpec]) -> dict[str, Any]:
    """``specs`` as a record holds them (and as JSON reads them back: lists). Every
    read compares a ref's with its head's; samples of one run share their specs, so
    most reads find it made (never change what it returns)."""
    return _spec_doc_of(tuple(specs.items()))


@functools.lru_cache(maxsize=1024)
def _spec_doc_of(items: tuple[tuple[str, FeatureSpec], ...]) -> dict[str, Any]:
    return {
        name: [_tensors.dtype_str(spec.dtype), list(spec.shape)] for name, spec in sorted(items)
    }


def _encode_record(
    sample_id: str,
    generation: int,
    created: float,
    nbytes: int,
    sums: dict[str, str | None],
    specs: Mapping[str, FeatureSpec],
) -> bytes:
    doc = {
        "sample_id": sample_id,
        "generation": generation,
        "created": created,
        "nbytes": nbytes,
        "xxh3": sums,
        "specs": _spec_doc(specs),
    }
    body = _RECORD_ENCODER.encode(doc).encode()
    return _HEAD_MAGIC + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body)) + body


def _decode_record(data: bytes, sample_id: str, key: str) -> _Record:
    """The record in ``data``; CorruptFeatureError unless it is intact and of ``sample_id``."""

    def corrupt(what: str) -> CorruptFeatureError:
        whose = "the head" if key.endswith("/@head") else "the record"
        return CorruptFeatureError(
            f"{key} ({whose} of sample {sample_id!r}): {what}; it is corrupt: {_FIX}"
        )

    magic, body = data[:8], data[16:]
    if magic != _HEAD_MAGIC:
        if magic[:6] == _HEAD_FAMILY or data[:1] == b"{":
            version = magic[6:].decode(errors="replace") if magic[:6] == _HEAD_FAMILY else "01"
            raise corrupt(
                f"head format version {version}, this dataflow reads only version "
                f"{_HEAD_MAGIC[6:].decode()} (heads with checksums)"
            )
        raise corrupt(f"not a dataflow head ({len(data)} bytes, bad magic)")
    if len(data) < 16 or _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body)) != data[8:16]:
        raise corrupt("it fails its checksum")
    try:
        doc = _RECORD_DECODER.decode(body.decode())
        generation, checksums = doc["generation"], doc["xxh3"]
        created, nbytes, specs = doc["created"], doc["nbytes"], doc.get("specs")
        if not (
            isinstance(generation, int)
            and isinstance(checksums, dict)
            and isinstance(created, (int, float))
            and isinstance(nbytes, int)
            and (specs is None or isinstance(specs, dict))
        ):
            raise TypeError("bad field types")
    except (ValueError, KeyError, TypeError) as exc:
        raise corrupt(f"unreadable: {exc}") from exc
    if doc.get("sample_id") != sample_id:
        raise corrupt(f"it names sample {doc.get('sample_id')!r}")
    sums = {str(name): value for name, value in checksums.items()}
    return _Record(generation, float(created), nbytes, sums, specs)


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


def _specs_differ(ref: SampleRef, stored: dict[str, Any], key: str) -> CorruptFeatureError:
    """The error for a ref whose specs are not those its sample was put with."""
    said = _spec_doc(ref.specs)
    name = next(n for n in sorted({*said, *stored}) if said.get(n) != stored.get(n))
    has = "not stored" if name not in stored else "{} {}".format(*stored[name])
    says = "no such feature" if name not in said else "{} {}".format(*said[name])
    return CorruptFeatureError(
        f"{key}: feature {name!r} of sample {ref.sample_id!r} is {has}, the ref says {says}: "
        "the ref does not describe what was put; read it through the ref that put returned"
    )


# -- the store ---------------------------------------------------------------
_UNREADABLE = _Record(-1, 0.0, 0, {})  # a head that stays corrupt: replaced, nothing to remove


class MooncakeFeatureStore(FeatureStore):
    """Features in a Mooncake cluster; URI
    ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

    One Mooncake object per non-empty tensor, hard-pinned. A get reads the
    sample's head and tensors in one batch straight into registered memory
    that the returned tensors are views of (recycled when they are dropped); a
    put sends straight from the tensors over TCP, and over RDMA (which reads
    only registered memory) copies them into registered memory first.

    A put reads the sample's head, takes a generation above it from a block
    of generations that this client claimed from the master (unique across
    processes, see ``_Generations``), writes tensors and record in one batch
    (with the head, when the sample has none yet), then makes the new head
    current and removes the generation it superseded. ``put_many`` does the
    same for a whole batch in as many round trips. Deletes never wait for read
    leases (see ``_Removals``).

    Two processes that put one id at once both succeed with their own
    generations: the head written last is current, the other ref reads as
    stale, and its objects stay stored until its ref is deleted or a
    ``delete_stored`` of what ``scan`` listed frees them.

    ``scan`` lists the namespace from the master's key list (its HTTP server:
    ``admin``, by default port 9003 of the master's host) and reads the record
    of each generation in batches. Handles in one process share one Mooncake
    client per cluster (the first handle's ``segment_size`` / ``buffer_size``
    win). ``stats()`` counts what ``scan`` lists: the namespace's generations,
    whichever process put them (it counted only this handle's puts).

    The head holds the XXH3-64 of every tensor and a checksum of its own; a get
    checks the head and every tensor it reads, and raises CorruptFeatureError
    (naming sample, feature and key) on a mismatch.

    A master that restarts loses every object: what was put before reads as
    stale. Calls wait up to ``connect_timeout`` for a master that is down, and
    for one that restarted to take this client back (see ``_Client.call``).
    """

    #: Benchmarks only: False skips the checksums (none computed on put, none
    #: checked on get). What such a handle puts, a checking handle refuses.
    _checksums = True

    def __init__(
        self,
        master: str,
        *,
        metadata: str | None = None,
        protocol: str = "tcp",
        namespace: str = "dataflow",
        local_hostname: str | None = None,
        device: str = "",
        segment_size: int = 512 * _MiB,
        buffer_size: int = 16 * _MiB,
        admin: str | None = None,
        max_idle_bytes: int = 1 << 30,
        connect_timeout: float = 5.0,
        drain_timeout: float = 0.0,
    ) -> None:
        host, _ = _split_host_port(master, "master address")
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise InvalidRefError(f"namespace {namespace!r} must be 1-64 of [A-Za-z0-9_.-]")
        if protocol not in ("tcp", "rdma"):
            raise InvalidRefError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        metadata = metadata or f"http://{host}:8080/metadata"
        admin = admin or f"{master.rpartition(':')[0]}:{ADMIN_PORT}"
        _split_host_port(admin, "admin address")
        super().__init__(store_uri(master, metadata, protocol, namespace))
        self.namespace = namespace
        #: HOST:PORT of the master's HTTP server, where ``scan`` reads the key list.
        self.admin = admin
        self.drain_timeout = drain_timeout
        self._settings = _Settings(
            master=master,
            metadata=metadata,
            protocol=protocol,
            device=device,
            local_hostname=local_hostname or _local_address_towards(host),
            segment_size=segment_size,
            buffer_size=buffer_size,
            connect_timeout=connect_timeout,
            max_idle_bytes=max_idle_bytes,
            admin=admin,
        )
        self._client = _acquire(self._settings)
        # TCP transfers read any memory of this process, so puts send straight
        # from the tensors; RDMA reads only registered memory, so there puts
        # copy the tensors into the registered pool first.
        self._stage_puts = protocol != "tcp"

    @property
    def segment_size(self) -> int:
        """Bytes of memory this process's client lends the cluster (0: none)."""
        return self._settings.segment_size

    @property
    def open_uri(self) -> str:
        """``uri`` and ``admin``: what ``dataflow gc`` opens this store by (``scan`` needs it)."""
        return f"{self.uri}&admin={urllib.parse.quote(self.admin, safe='')}"

    @classmethod
    def from_uri(cls, uri: str) -> MooncakeFeatureStore:
        """Open ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

        Optional tuning parameters (not part of the store's identity, so not
        in :attr:`uri`): ``local_hostname``, ``device``, ``segment_size`` and
        ``buffer_size`` (bytes, or 512M / 1G), and ``admin`` (HOST:PORT of the
        master's HTTP server, for ``scan``).
        """
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != "mooncake" or not parts.netloc or parts.path not in ("", "/"):
            raise InvalidRefError(f"{uri!r} is not a mooncake://HOST:PORT?... URI")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
        allowed = {
            "metadata",
            "protocol",
            "namespace",
            "local_hostname",
            "device",
            "segment_size",
            "buffer_size",
            "admin",
        }
        unknown = sorted(set(query) - allowed)
        if unknown or any(len(v) != 1 for v in query.values()):
            got = unknown or query
            raise InvalidRefError(
                f"{uri!r}: each query parameter once, from {sorted(allowed)}; {got}"
            )
        args: dict[str, Any] = {k: v[0] for k, v in query.items()}
        for size in ("segment_size", "buffer_size"):
            if size in args:
                args[size] = _parse_size(args[size], size)
        return cls(parts.netloc, **args)

    # -- keys --------------------------------------------------------------
    def _head_key(self, sample_id: str) -> str:
        return f"{self.namespace}/{sample_id}/@head"

    def _keys(self, sample_id: str, generation: int, names: list[str]) -> list[str]:
        """The generation's record first, then one key per named tensor."""
        prefix = f"{self.namespace}/{sample_id}/g{generation}"
        return [f"{prefix}/@", *(f"{prefix}/{name}" for name in names)]

    # -- putting -----------------------------------------------------------
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        return self._put_batch([(sample_id, tensors, metadata)])[0]

    def _put_many(
        self, items: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]
    ) -> list[SampleRef]:
        return self._all_or_none(self._put_batch(run) for run in _distinct_runs(items))

    def _put_batch(
        self, items: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]
    ) -> list[SampleRef]:
        """Put samples of distinct ids; ``_commit`` does the round trips."""
        client = self._client
        puts: list[_Put] = []
        try:
            for sample_id, tensors, _ in items:
                puts.append(self._prepare(sample_id, tensors))
            with client.id_locks(self._head_key(put.sample_id) for put in puts):
                generations = self._commit(puts)
        finally:
            for put in puts:
                if put.staged is not None:
                    client.pool.release(put.staged)
        return [
            SampleRef(put.sample_id, self.uri, generation, put.specs, metadata)
            for put, generation, (_, _, metadata) in zip(puts, generations, items, strict=True)
        ]

    def _prepare(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> _Put:
        """Dense bytes, sizes and checksums of one sample, before any round trip."""
        specs = {name: FeatureSpec.of(t) for name, t in tensors.items()}
        if self._stage_puts:
            return self._stage(sample_id, tensors, specs)
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
                sums[name] = _tensors.checksum(data) if self._checksums else None
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
        chunk = self._client.pool.lease(_tensors.end_of(spans.values()))
        sources, sums = [], {}
        try:
            for name in names:
                offset, nbytes = spans[name]
                target = chunk.tensor[offset : offset + nbytes].view(specs[name].dtype)
                _tensors.copy(target.view(specs[name].shape), tensors[name])
                sources.append(chunk.ptr + offset)
                data = chunk.array[offset : offset + nbytes]
                sums[name] = _tensors.checksum(data) if self._checksums else None
        except BaseException:
            self._client.pool.release(chunk)
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
        client = self._client
        olds = self._read_heads([put.sample_id for put in puts])
        floors = [old.generation + 1 if old is not None else 0 for old in olds]
        generations = client.generations(self.namespace).take(floors)
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
                keys = self._keys(put.sample_id, generation, put.names)
                writes.append((keys[0], chunk.ptr + at, len(record)))
                writes += zip(keys[1:], put.sources, put.sizes, strict=True)
                head = (self._head_key(put.sample_id), chunk.ptr + at, len(record))
                (first if old is None else replacing).append(head)
            heads = {head[0]: head for head in first + replacing}
            failed = self._write(writes + first)
            for key, code in failed:
                if key not in heads or code not in _BUSY:
                    raise _error(code, f"writing {key}")
            # A head busy with another process's write, and the ones that replace others.
            self._write_heads([heads[key] for key, _ in failed] + replacing)
        except BaseException:
            self._undo(puts, generations, olds)
            raise
        finally:
            client.pool.release(chunk)
        superseded = [
            self._keys(put.sample_id, old.generation, old.names)
            for put, old in zip(puts, olds, strict=True)
            if old is not None and old is not _UNREADABLE
        ]
        if superseded:
            client.removals.remove_generations(superseded)
        return generations

    def _write(self, writes: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        """``batch_upsert_from`` of (key, address, size); the (key, code) of those that failed.

        Upsert, not put: a put of an existing key reports success and keeps the
        old bytes; the keys of a new generation are new anyway.
        """
        if not writes:
            return []
        keys, ptrs, sizes = (list(column) for column in zip(*writes, strict=True))
        client = self._client
        codes = client.call(client.raw.batch_upsert_from, keys, ptrs, sizes, client.config)
        return [(key, code) for key, code in zip(keys, codes, strict=True) if code != OK]

    def _write_heads(self, heads: list[tuple[str, int, int]]) -> None:
        # Another process putting the same id right now holds its head for the
        # moment of its write (ILLEGAL_CLIENT, REPLICA_IS_NOT_READY): retry.
        deadline = time.monotonic() + 1.0
        while heads:
            failed = dict(self._write(heads))
            busy = [head for head in heads if failed.get(head[0]) in _BUSY]
            for key, code in failed.items():
                if code not in _BUSY or time.monotonic() > deadline:
                    raise _error(code, f"writing the head {key}")
            heads = busy
            if heads:
                time.sleep(0.002)

    def _undo(self, puts: list[_Put], generations: list[int], olds: list[_Record | None]) -> None:
        """Remove what a failed ``_commit`` wrote (the ids' locks are held).

        A sample whose head already names its new generation loses its head,
        and the generation that head superseded goes too: as after put + delete.
        """
        removals = self._client.removals
        for put, generation, old in zip(puts, generations, olds, strict=False):
            dropped = self._drop_head(put.sample_id, generation)
            removals.remove_generations([self._keys(put.sample_id, generation, put.names)])
            if dropped and old not in (None, _UNREADABLE):
                removals.remove_generations([self._keys(put.sample_id, old.generation, old.names)])

    # -- reading -----------------------------------------------------------
    def _read_small(self, keys: list[str]) -> list[bytes | int]:
        """Records (up to ``_HEAD_CAP`` bytes each) of ``keys`` in one batch: bytes, or the
        negative Mooncake code of a key that could not be read."""
        pool = self._client.pool
        chunk = pool.lease(len(keys) * _HEAD_CAP)
        try:
            ptrs = [chunk.ptr + i * _HEAD_CAP for i in range(len(keys))]
            codes = self._read_batch(keys, ptrs, [_HEAD_CAP] * len(keys))
            return [
                chunk.array[i * _HEAD_CAP : i * _HEAD_CAP + code].tobytes() if code >= 0 else code
                for i, code in enumerate(codes)
            ]
        finally:
            pool.release(chunk)

    def _read_batch(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_get_into``, again while a read outlasted its lease (LEASE_EXPIRED).

        Mooncake grants a read lease (``-default_kv_lease_ttl``) and refuses
        the bytes when the transfer ended after it, since the object may have
        been removed meanwhile: read again. A lease shorter than a transfer
        fails every time; then say so.
        """
        for _ in range(_READ_TRIES):
            codes = self._client.call(self._client.raw.batch_get_into, keys, ptrs, sizes)
            if LEASE_EXPIRED not in codes:
                return codes
        key = keys[codes.index(LEASE_EXPIRED)]
        raise StoreError(
            f"reading {key} outlasted its read lease {_READ_TRIES} times (LEASE_EXPIRED): "
            "the master's lease (mooncake_master -default_kv_lease_ttl) is shorter than "
            f"a transfer of {sum(sizes)} bytes takes; give it a longer lease"
        )

    def _read_heads(self, sample_ids: list[str]) -> list[_Record | None]:
        """The head of each sample in one batch: None where there is none, _UNREADABLE where
        it stays corrupt. Heads that are busy or do not decode are read once more alone."""
        keys = [self._head_key(sample_id) for sample_id in sample_ids]
        out: list[_Record | None] = []
        for sample_id, key, got in zip(sample_ids, keys, self._read_small(keys), strict=True):
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
                out.append(self._read_record(key, sample_id))
            except CorruptFeatureError:  # overwrite it: nothing else can read it
                out.append(_UNREADABLE)
        return out

    def _read_record(self, key: str, sample_id: str) -> _Record | None:
        """The record (or head) at ``key``; None when there is none (or it stays not ready for 1 s).

        A record that does not decode is read once more before it counts as
        corrupt: a delete force-removes heads, and a reader racing that may see
        bytes of a removed object (see _remove_generation).
        """
        client = self._client
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
                continue  # see _read_batch
            elif code == BUFFER_TOO_SMALL and cap == _HEAD_CAP:
                cap = max(raw.get_size(key), cap) * 2
            else:
                raise _error(code, f"reading {key}")

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        read = _read_layout(tuple((name, ref.specs[name]) for name in names))
        chunk = self._fetch(ref, read.data, read.spans, read.head_at)
        return self._client.pool.views(chunk, read.views)

    def _get_many_into(self, items: list[tuple[SampleRef, dict[str, torch.Tensor]]]) -> None:
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
        for group in groups:
            reads = [(ref, layout.data, layout.spans, layout.head_at) for ref, _, layout in group]
            if not self._stage_puts:  # TCP
                chunk, _ = self._fetch_many(reads, into=[out for _, out, _ in group])
                self._client.pool.release(chunk)
                continue
            chunk, bases = self._fetch_many(reads)
            try:
                for (_, out, layout), base in zip(group, bases, strict=True):
                    for name, target in out.items():
                        offset, spec = layout.views[name]
                        _tensors.copy(target, _view(chunk.tensor, base + offset, spec))
            finally:
                self._client.pool.release(chunk)

    def _fetch(
        self,
        ref: SampleRef,
        data: Sequence[str],
        spans: Mapping[str, tuple[int, int]],
        head_at: int,
    ) -> Chunk:
        """Read the head and the ``data`` tensors of ``ref`` into one registered chunk."""
        return self._fetch_many([(ref, data, spans, head_at)])[0]

    def _fetch_many(
        self,
        reads: list[tuple[SampleRef, Sequence[str], Mapping[str, tuple[int, int]], int]],
        into: list[dict[str, torch.Tensor]] | None = None,
    ) -> tuple[Chunk, list[int]]:
        """Read the head and the ``data`` tensors of each ``(ref, data, spans, head_at)`` into
        one registered chunk, in one batch; the chunk and where each ref's layout starts.
        With ``into`` (TCP only), each read's tensors go into its dict's tensors instead,
        and the chunk holds the heads alone.

        Each ref is checked as a get checks it; the first that fails raises."""
        client = self._client
        bases, total, keys = [], 0, []
        for ref, data, _spans, head_at in reads:
            record, *data_keys = self._keys(ref.sample_id, ref.generation, list(data))
            if client.removals.is_pending(record):
                raise self._stale(ref, "deleted; its removal waits for a read lease")
            keys += [self._head_key(ref.sample_id), *data_keys]
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
            codes = self._read_batch(keys, ptrs, sizes)
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
        head_code = codes[0]
        head = None
        if head_code >= 0:
            with contextlib.suppress(CorruptFeatureError):  # _read_record reads it again
                head = _decode_record(head_bytes[:head_code].tobytes(), ref.sample_id, keys[0])
        elif head_code not in (BUFFER_TOO_SMALL, NOT_READY, NOT_FOUND):
            raise _error(head_code, f"reading the head of {ref.sample_id!r}")
        if head is None and head_code != NOT_FOUND:
            head = self._read_record(keys[0], ref.sample_id)
        # Only the generation the head names is readable: no head means
        # deleted; a newer one, superseded; an older one, that this
        # generation never became current (its put died or lost a race
        # with another process's put), or was deleted and the id put
        # again by a client whose block of generations is older.
        if head is None:
            raise self._stale(ref, "deleted")
        if head.generation > ref.generation:
            raise self._stale(ref, f"superseded by generation {head.generation}")
        if head.generation < ref.generation:
            raise self._stale(ref, f"not current: the head names {head.generation}")
        if NOT_FOUND in codes[1:]:
            raise self._stale(ref, "deleted or superseded")
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
        if self._checksums:
            self._verify(ref, head, data, keys[1:], tensor_bytes)

    @staticmethod
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
            written = head.checksums[name]
            _tensors.verify(
                tensor_bytes(name),
                written,
                sample_id=ref.sample_id,
                name=name,
                where=f"Mooncake key {key}",
                fix=_FIX,
            )

    def _exists(self, ref: SampleRef) -> bool:
        try:
            chunk = self._fetch(ref, [], {}, 0)
        except (StaleRefError, CorruptFeatureError):  # a corrupt head: nothing is readable
            return False
        self._client.pool.release(chunk)
        return True

    # -- deleting ----------------------------------------------------------
    def _delete(self, ref: SampleRef) -> None:
        names = [name for name in sorted(ref.specs) if _tensors.nbytes(ref.specs[name])]
        self._remove_generation(ref.sample_id, ref.generation, names)

    def _delete_stored(self, obj: StoredObject) -> bool:
        key = self._keys(obj.sample_id, obj.generation, [])[0]
        if self._client.removals.is_pending(key):
            return False  # this process is removing it already
        record = self._read_record(key, obj.sample_id)
        if record is None:
            return self._remove_leftovers(obj.sample_id, obj.generation)
        if record.generation != obj.generation:
            raise CorruptFeatureError(
                f"{key}: the record of sample {obj.sample_id!r} names generation "
                f"{record.generation}; it is corrupt: remove the keys under "
                f"{key.removesuffix('@')} from Mooncake by hand"
            )
        self._remove_generation(obj.sample_id, obj.generation, record.names)
        return True

    def _remove_generation(self, sample_id: str, generation: int, names: list[str]) -> None:
        """Remove the head while it names the generation, then its tensors, then its record.

        In that order, a process that dies at any moment of it leaves the
        record behind for as long as anything of the generation is stored:
        ``scan`` lists it, and a collector frees the rest (``dataflow gc``).
        """
        client = self._client
        keys = self._keys(sample_id, generation, names)
        with client.id_locks([self._head_key(sample_id)]):
            self._drop_head(sample_id, generation)
        if not client.removals.is_pending(keys[0]):
            client.removals.remove_generations([keys])

    def _remove_leftovers(self, sample_id: str, generation: int) -> bool:
        """Remove what is stored of a generation that has no record (what ``scan`` lists as a
        leftover): its tensors, and the head while it names it. Whether anything went.

        Tensors under a read lease stay, for a later collection to find again.
        """
        client = self._client
        with client.id_locks([self._head_key(sample_id)]):
            dropped = self._drop_head(sample_id, generation)
        prefix = self._keys(sample_id, generation, [])[0].removesuffix("@")
        escaped = _REGEX_SPECIAL.sub(lambda m: "\\" + m.group(), prefix)
        pattern = f"^{escaped}[^/@]+$"
        removed = client.call(client.raw.remove_by_regex, pattern, False)
        return dropped or removed > 0

    def _drop_head(self, sample_id: str, generation: int) -> bool:
        """Force-remove the head of ``sample_id`` while it names ``generation``; the caller
        holds the id's lock. True if it did.

        The head is read by every get, so it is nearly always under a lease; a
        queued removal could land after a later put made it name a newer
        generation. Forcing it right after the check keeps that race to one
        round trip (Mooncake has no compare-and-remove), and a reader racing
        the removal reads no head (or an unparseable one), which means "no
        newer generation".
        """
        key = self._head_key(sample_id)
        try:
            head = self._read_record(key, sample_id)
        except CorruptFeatureError:  # we cannot tell whose it is: leave it
            return False
        if head is None or head.generation != generation:
            return False
        self._client.call(self._client.raw.remove, key, True)
        return True

    # -- listing -----------------------------------------------------------
    def _scan(self) -> Iterator[StoredObject]:
        """The namespace's generations with a record, as the listing goes; then the
        leftovers: generations whose tensors are stored without a record, and heads
        stored without any generation of their sample (left by a process that died
        in a delete of an older dataflow, which removed the record first)."""
        prefix = f"{self.namespace}/"
        batch: list[tuple[str, str, int]] = []
        recorded: set[tuple[str, int]] = set()
        unrecorded: set[tuple[str, int]] = set()  # generations with tensors, as listed
        heads: set[str] = set()
        for key in self._all_keys():
            if not key.startswith(prefix) or self._client.removals.is_pending(key):
                continue  # not ours, or one that this process is removing
            kind, sample_id, generation = _parse_key(key, len(prefix))
            if kind == "record":
                recorded.add((sample_id, generation))
                batch.append((key, sample_id, generation))
                if len(batch) == _SCAN_BATCH:
                    yield from self._scan_records(batch)
                    batch = []
            elif kind == "tensor":
                unrecorded.add((sample_id, generation))
            elif kind == "head":
                heads.add(sample_id)
        yield from self._scan_records(batch)
        unrecorded -= recorded
        heads -= {sample_id for sample_id, _ in recorded | unrecorded}
        yield from self._scan_leftovers(sorted(unrecorded), sorted(heads))

    def _scan_leftovers(
        self, generations: list[tuple[str, int]], heads: list[str]
    ) -> Iterator[StoredObject]:
        """``generations`` whose records are still missing, and what ``heads`` name.

        Their size is unknown (0) and their time is when their block of generations was
        claimed (the generation is the wall clock in nanoseconds then, see
        ``_Generations``), which is never after their put.
        """
        now = time.time()
        for start in range(0, len(generations), _SCAN_BATCH):
            chunk = generations[start : start + _SCAN_BATCH]
            records = [self._keys(sample_id, generation, [])[0] for sample_id, generation in chunk]
            for (sample_id, generation), got in zip(chunk, self._read_small(records), strict=True):
                if got == NOT_FOUND:  # anything else: a put wrote it since the listing
                    yield StoredObject(sample_id, generation, 0, min(generation / 1e9, now))
        for start in range(0, len(heads), _SCAN_BATCH):
            sample_ids = heads[start : start + _SCAN_BATCH]
            for sample_id, head in zip(sample_ids, self._read_heads(sample_ids), strict=True):
                if head is not None and head is not _UNREADABLE:
                    yield StoredObject(sample_id, head.generation, 0, head.created)

    def _all_keys(self) -> Iterator[str]:
        """Every key of the cluster, one by one, as the master's HTTP server lists them."""
        url = f"http://{self.admin}/get_all_keys"
        where = (
            f"cannot list the keys of {self.uri} at {url}: scan() reads them from the "
            "master's HTTP server (mooncake_master -metrics_port, by default 9003); give "
            "its address as admin=HOST:PORT"
        )
        try:
            with _OPENER.open(url, timeout=self._settings.connect_timeout) as response:
                for line in response:
                    key = line.decode(errors="replace").strip()
                    if key:
                        yield key
        except OSError as exc:  # URLError and HTTPError are OSErrors
            raise StoreUnavailableError(f"{where} ({exc})") from exc

    def _scan_records(self, batch: list[tuple[str, str, int]]) -> Iterator[StoredObject]:
        if not batch:
            return
        for (key, sample_id, generation), got in zip(
            batch, self._read_small([key for key, _, _ in batch]), strict=True
        ):
            if got in (NOT_FOUND, NOT_READY):
                continue  # removed since the listing, or a put is writing it
            try:
                if not isinstance(got, bytes):
                    record = self._read_record(key, sample_id)
                    if record is None:
                        continue
                else:
                    try:
                        record = _decode_record(got, sample_id, key)
                    except CorruptFeatureError:
                        record = self._read_record(key, sample_id)  # once more, alone
                        if record is None:
                            continue
                if record.generation != generation:
                    raise CorruptFeatureError(f"{key}: it names generation {record.generation}")
            except CorruptFeatureError as exc:
                log.warning("scan of %s skips a record no delete can use: %s", self.uri, exc)
                continue
            yield StoredObject(sample_id, generation, record.nbytes, record.created)

    def _close(self) -> None:
        # Waiting out read leases (10 s by default) would stall every shutdown: what
        # a lease still holds stays stored with its record, for `dataflow gc`.
        left = self._client.removals.drain(f"{self.namespace}/", self.drain_timeout)
        left += _release(self._settings, 0.0)
        if left:
            log.info(
                "%s: %d Mooncake keys were under a read lease at close and stay stored "
                "until `dataflow gc` removes them, e.g. %s",
                self.uri,
                len(left),
                left[:3],
            )

    def _stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )
