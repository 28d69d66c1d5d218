"""Feature store on a Mooncake distributed store (``mooncake.store``), zero-copy.

Keys of one sample generation (``/`` separated; ``@`` is in neither sample ids
nor feature names, so no key of one sample can be a key of another)::

    {namespace}/{sample_id}/g{generation}/{name}   raw bytes of one non-empty tensor
    {namespace}/{sample_id}/g{generation}/@        marker: claimed once, exclusively
    {namespace}/{sample_id}/@head                  JSON: the current generation and its names

Every Mooncake return code is translated into the dataflow error tree in
:func:`_error`, and nowhere else.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dataflow._contracts import FeatureSpec, FeatureStore, SampleRef, StoreStats
from dataflow._errors import (
    CorruptFeatureError,
    InvalidRefError,
    StaleRefError,
    StoreDependencyError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from stores import _tensors
from stores._pool import Chunk, ChunkPool
from stores._registry import MOONCAKE_HINT

OK, NOT_FOUND, ALREADY_EXISTS, BUFFER_TOO_SMALL, NOT_READY = 0, -704, -705, -600, -703
# What a write of a key that another client is writing at the same moment gets.
_BUSY = {-601, -703, -714}
_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
_UNAVAILABLE = {-103, -800, -900, -901, -1010}

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MARKER_BYTES = 8
_HEAD_CAP = 4096
_MiB = 1 << 20
_SIZE_RE = re.compile(r"(\d+)\s*([KMG]i?B?)?", re.IGNORECASE)


def _require_mooncake() -> ModuleType:
    try:
        import mooncake.store as mooncake_store
    except ImportError as exc:
        raise StoreDependencyError(
            f"the mooncake:// store needs mooncake.store ({exc}): {MOONCAKE_HINT}"
        ) from exc
    return mooncake_store


def _error(code: int, what: str) -> StoreError:
    name = f"{_NAMES.get(code, 'error')} ({code})"
    if code == -200:
        return StoreFullError(
            f"{what}: Mooncake has no space left, {name}; delete released samples or mount "
            "larger segments (segment_size)"
        )
    if code in _UNAVAILABLE:
        return StoreUnavailableError(f"{what}: Mooncake is unreachable or not ready, {name}")
    if code == NOT_FOUND:
        return StaleRefError(f"{what}: {name}")
    return StoreError(f"{what} failed: {name}")


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


def _split_host_port(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidRefError(f"{what} {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def _probe(address: str, what: str, timeout: float) -> None:
    # Mooncake's own setup retries an unreachable master for about 90 s; a
    # plain TCP connect answers in milliseconds and names the address.
    host, port = _split_host_port(address, what)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise StoreUnavailableError(
            f"cannot reach the Mooncake {what} at {address}: {exc}; is mooncake_master running "
            "there (see stores.mooncake_master.MooncakeMaster)?"
        ) from exc


def _local_address_towards(host: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # UDP: picks the route, sends nothing
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostname()


_generation_lock = threading.Lock()
_last_generation = 0


def _next_generation(floor: int) -> int:
    global _last_generation
    with _generation_lock:
        _last_generation = max(time.time_ns(), floor, _last_generation + 1)
        return _last_generation


# -- removals that wait for read leases --------------------------------------
class _Removals:
    """Removes keys; those still under a read lease are retried in the background.

    Mooncake refuses to remove an object for a lease time after any read
    (OBJECT_HAS_LEASE); waiting for it in ``delete`` would stall every consumer
    that deletes what it just read. We never probe before removing (a probe is
    a read and renews the lease), and the keys that must wait are retried with
    backoff by a daemon thread, and drained at close.
    """

    _BATCH = 1024

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._cond = threading.Condition()
        self._pending: dict[str, None] = {}
        self._thread: threading.Thread | None = None
        self._delay = 0.05
        self._stopped = False

    def remove(self, keys: list[str]) -> None:
        left = self._try(keys)
        if left:
            with self._cond:
                self._pending.update(dict.fromkeys(left))
                self._delay = 0.05
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="mooncake-removals", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()

    def is_pending(self, key: str) -> bool:
        with self._cond:
            return key in self._pending

    def pending(self, prefix: str = "") -> list[str]:
        with self._cond:
            return [k for k in self._pending if k.startswith(prefix)]

    def drain(self, prefix: str, timeout: float) -> list[str]:
        """Retry the pending keys under ``prefix`` until none is left or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            keys = self.pending(prefix)
            if keys:
                self._retry(keys)
                keys = self.pending(prefix)
            if not keys or time.monotonic() >= deadline:
                return keys
            time.sleep(0.05)

    def _try(self, keys: list[str]) -> list[str]:
        left = []
        for i in range(0, len(keys), self._BATCH):
            batch = keys[i : i + self._BATCH]
            codes = self._raw.batch_remove(batch)
            left += [k for k, c in zip(batch, codes, strict=True) if c not in (OK, NOT_FOUND)]
        return left

    def _retry(self, keys: list[str]) -> None:
        left = set(self._try(keys))
        with self._cond:
            for key in keys:
                if key not in left:
                    self._pending.pop(key, None)

    def stop(self) -> None:
        """End the retries (before the client closes); what is pending stays stored."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self._stopped:
                    self._thread = None
                    return
                self._cond.wait(self._delay)
                self._delay = min(self._delay * 2, 1.0)
                keys = [] if self._stopped else list(self._pending)
            if keys:
                self._retry(keys)


# -- one Mooncake client per process and cluster -----------------------------
@dataclass(frozen=True)
class _Settings:
    master: str
    metadata: str
    protocol: str
    device: str
    local_hostname: str
    segment_size: int
    buffer_size: int
    connect_timeout: float
    max_idle_bytes: int

    @property
    def key(self) -> tuple[str, ...]:
        return (self.master, self.metadata, self.protocol, self.device, self.local_hostname)


class _Client:
    def __init__(self, settings: _Settings) -> None:
        mooncake_store = _require_mooncake()
        _probe(settings.master, "master", settings.connect_timeout)
        parsed = urllib.parse.urlsplit(settings.metadata)
        if parsed.scheme in ("http", "https") and parsed.port:
            _probe(f"{parsed.hostname}:{parsed.port}", "metadata server", settings.connect_timeout)
        self.raw = mooncake_store.MooncakeDistributedStore()
        code = self.raw.setup(
            settings.local_hostname,
            settings.metadata,
            settings.segment_size,
            settings.buffer_size,
            settings.protocol,
            settings.device,
            settings.master,
        )
        if code != OK:
            raise StoreUnavailableError(
                f"Mooncake setup against master {settings.master} (metadata "
                f"{settings.metadata}, protocol {settings.protocol}) failed with code {code}"
            )
        self.config = mooncake_store.ReplicateConfig()
        self.config.replica_num = 1
        self.config.with_hard_pin = True  # never evicted: a ref must stay readable until deleted
        self.pool = ChunkPool(
            settings.max_idle_bytes, register=self._register, unregister=self._unregister
        )
        self.removals = _Removals(self.raw)
        # Puts and deletes of one sample id in this process take turns, so that
        # threads never race on its head; other processes still can (see _commit).
        self._id_locks = [threading.Lock() for _ in range(64)]
        self.users = 0

    def _register(self, chunk: Chunk) -> None:
        code = self.raw.register_buffer(chunk.ptr, chunk.size)
        if code != OK:
            raise _error(code, f"registering {chunk.size} bytes of memory")

    def _unregister(self, chunk: Chunk) -> None:
        self.raw.unregister_buffer(chunk.ptr)

    def id_lock(self, key: str) -> threading.Lock:
        return self._id_locks[hash(key) % len(self._id_locks)]

    def close(self, drain_timeout: float) -> list[str]:
        left = self.removals.drain("", drain_timeout)
        self.removals.stop()
        self.pool.close()
        self.raw.close()
        return left


_clients: dict[tuple[str, ...], _Client] = {}
_clients_lock = threading.Lock()


def _acquire(settings: _Settings) -> _Client:
    with _clients_lock:
        client = _clients.get(settings.key)
        if client is None:
            client = _clients[settings.key] = _Client(settings)
        client.users += 1
        return client


def _release(settings: _Settings, drain_timeout: float) -> list[str]:
    with _clients_lock:
        client = _clients[settings.key]
        client.users -= 1
        if client.users:
            return []
        del _clients[settings.key]
    return client.close(drain_timeout)


# -- the store ---------------------------------------------------------------
@dataclass(frozen=True)
class _Head:
    generation: int
    names: list[str]


class MooncakeFeatureStore(FeatureStore):
    """Features in a Mooncake cluster; URI
    ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

    One Mooncake object per non-empty tensor, hard-pinned. A get reads every
    object of the sample in one batch straight into registered memory that the
    returned tensors are views of (recycled when they are dropped); a put
    sends straight from the tensors over TCP, and over RDMA (which reads only
    registered memory) copies them into registered memory first.

    Generations are ``time_ns``-based, above the current one of the sample, and
    unique across processes because each put first claims its generation's
    marker key through a put session, which the master grants to one client
    only. A put makes its generation current (the head) and removes the one it
    superseded. Deletes never wait for read leases (see ``_Removals``).

    Handles in one process share one Mooncake client per cluster (the first
    handle's ``segment_size`` / ``buffer_size`` win). ``stats()`` counts what
    this handle put and has not deleted: Mooncake cannot list a namespace.
    """

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
        max_idle_bytes: int = 1 << 30,
        connect_timeout: float = 5.0,
        drain_timeout: float = 30.0,
    ) -> None:
        host, _ = _split_host_port(master, "master address")
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise InvalidRefError(f"namespace {namespace!r} must be 1-64 of [A-Za-z0-9_.-]")
        if protocol not in ("tcp", "rdma"):
            raise InvalidRefError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        metadata = metadata or f"http://{host}:8080/metadata"
        super().__init__(store_uri(master, metadata, protocol, namespace))
        self.namespace = namespace
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
        )
        self._client = _acquire(self._settings)
        # TCP transfers read any memory of this process, so puts send straight
        # from the tensors; RDMA reads only registered memory, so there puts
        # copy the tensors into the registered pool first.
        self._stage_puts = protocol != "tcp"
        self._lock = threading.Lock()
        self._live: dict[str, tuple[int, int]] = {}

    @classmethod
    def from_uri(cls, uri: str) -> MooncakeFeatureStore:
        """Open ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

        Optional tuning parameters (not part of the store's identity, so not
        in :attr:`uri`): ``local_hostname``, ``device``, ``segment_size`` and
        ``buffer_size`` (bytes, or 512M / 1G).
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
        """Marker first, then one key per named tensor."""
        prefix = f"{self.namespace}/{sample_id}/g{generation}"
        return [f"{prefix}/@", *(f"{prefix}/{name}" for name in names)]

    # -- hooks -------------------------------------------------------------
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        client = self._client
        specs = {name: FeatureSpec.of(t) for name, t in tensors.items()}
        spans = _tensors.layout(specs)
        names = [name for name in sorted(specs) if spans[name][1]]
        head_at = _tensors.end_of(spans.values()) if self._stage_puts else 0
        chunk = client.pool.lease(head_at + _HEAD_CAP)
        try:
            if self._stage_puts:
                for name in names:
                    offset, nbytes = spans[name]
                    target = chunk.tensor[offset : offset + nbytes].view(specs[name].dtype)
                    _tensors.copy(target.view(specs[name].shape), tensors[name])
                sources = [chunk.ptr + spans[name][0] for name in names]
            else:
                dense = [_tensors.dense(tensors[name]) for name in names]
                sources = [tensor.data_ptr() for tensor in dense]
            writes = [(n, p, spans[n][1]) for n, p in zip(names, sources, strict=True)]
            with client.id_lock(self._head_key(sample_id)):
                old = self._read_head(sample_id)
                generation = self._claim(sample_id, old.generation + 1 if old else 0)
                self._commit(sample_id, generation, writes, chunk, head_at, old is not None)
                if old is not None and old.generation != generation:
                    client.removals.remove(self._keys(sample_id, old.generation, old.names))
        finally:
            client.pool.release(chunk)
        with self._lock:
            current = self._live.get(sample_id)
            if current is None or current[0] < generation:
                self._live[sample_id] = (generation, sum(size for _, size in spans.values()))
        return SampleRef(sample_id, self.uri, generation, specs, metadata)

    def _commit(
        self,
        sample_id: str,
        generation: int,
        writes: list[tuple[str, int, int]],
        chunk: Chunk,
        head_at: int,
        replaces: bool,
    ) -> None:
        """Write the tensors (name, address, size) of a claimed generation; make it the head.

        A first head goes in the same batch as the tensors (nobody can hold a
        ref it would make stale); a head that ``replaces`` another is upserted
        only once the tensors are in. Two processes putting one id at once both
        succeed with their own generations; the head written last is current,
        and the other ref reads as superseded.
        """
        client = self._client
        names = [name for name, _, _ in writes]
        doc = {"sample_id": sample_id, "generation": generation, "names": names}
        head = json.dumps(doc).encode()
        if len(head) > _HEAD_CAP:
            raise InvalidRefError(f"{sample_id!r} has too many features for one head")
        chunk.array[head_at : head_at + len(head)] = np.frombuffer(head, np.uint8)
        keys = self._keys(sample_id, generation, names)
        batch = [(key, ptr, size) for key, (_, ptr, size) in zip(keys[1:], writes, strict=True)]
        head_write = (self._head_key(sample_id), chunk.ptr + head_at, len(head))
        try:
            failed = self._write(batch if replaces else [*batch, head_write])
            if failed and failed[0][0] != head_write[0]:
                raise _error(failed[0][1], f"writing {failed[0][0]} of {sample_id!r}")
            if replaces or failed:
                self._upsert_head(sample_id, head_write)
        except BaseException:
            client.removals.remove(keys)
            raise

    def _upsert_head(self, sample_id: str, head_write: tuple[str, int, int]) -> None:
        # Another process putting this id right now holds the head for the
        # moment of its write (ILLEGAL_CLIENT, REPLICA_IS_NOT_READY): retry.
        client, deadline = self._client, time.monotonic() + 1.0
        while True:
            code = client.raw.upsert_from(*head_write, client.config)
            if code == OK:
                return
            if code not in _BUSY or time.monotonic() > deadline:
                raise _error(code, f"writing the head of {sample_id!r}")
            time.sleep(0.002)

    def _claim(self, sample_id: str, floor: int) -> int:
        # A put session's start is the one Mooncake call that fails on an
        # existing key (a plain put of one returns success and keeps the old
        # bytes), so it is what makes a generation ours alone. The marker is
        # never read for its bytes, so the session ends without a transfer.
        raw, config = self._client.raw, self._client.config
        for _ in range(16):
            generation = _next_generation(floor)
            marker = self._keys(sample_id, generation, [])
            (code,) = raw.batch_put_session_start(marker, [_MARKER_BYTES], config)
            if code == ALREADY_EXISTS:
                floor = generation + 1
                continue
            if code != OK:
                raise _error(code, f"claiming a generation of {sample_id!r}")
            (code,) = raw.batch_put_session_end(marker)
            if code != OK:
                raw.batch_put_session_revoke(marker)
                raise _error(code, f"claiming a generation of {sample_id!r}")
            return generation
        raise StoreError(f"could not claim a free generation of {sample_id!r} in 16 tries")

    def _write(self, writes: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        """``batch_put_from`` of (key, address, size); the (key, code) of those that failed."""
        if not writes:
            return []
        keys, ptrs, sizes = (list(column) for column in zip(*writes, strict=True))
        codes = self._client.raw.batch_put_from(keys, ptrs, sizes, self._client.config)
        return [(key, code) for key, code in zip(keys, codes, strict=True) if code != OK]

    def _read_head(self, sample_id: str) -> _Head | None:
        pool, raw = self._client.pool, self._client.raw
        key, cap = self._head_key(sample_id), _HEAD_CAP
        deadline = time.monotonic() + 1.0
        while True:
            chunk = pool.lease(cap)
            try:
                code = raw.get_into(key, chunk.ptr, cap)
                if code >= 0:
                    return self._parse_head(chunk.array[:code].tobytes(), sample_id)
            finally:
                pool.release(chunk)
            if code == NOT_FOUND:
                return None
            if code == NOT_READY:  # another process is writing it: wait a moment
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.002)
            elif code == BUFFER_TOO_SMALL and cap == _HEAD_CAP:
                cap = max(raw.get_size(key), cap) * 2
            else:
                raise _error(code, f"reading the head of {sample_id!r}")

    @staticmethod
    def _parse_head(data: bytes, sample_id: str) -> _Head | None:
        # A head that does not parse, or names another sample, is one being
        # force-removed under a reader (see _delete): it says nothing.
        try:
            doc = json.loads(data)
            if doc["sample_id"] == sample_id and isinstance(doc["generation"], int):
                return _Head(doc["generation"], [str(n) for n in doc["names"]])
        except (ValueError, KeyError, TypeError):
            pass
        return None

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        specs = {name: ref.specs[name] for name in names}
        spans = _tensors.layout(specs)
        data = [name for name in sorted(specs) if spans[name][1]]
        head_at = _tensors.end_of(spans.values())
        chunk = self._fetch(ref, data, spans, head_at)
        views = {name: (spans[name][0], specs[name]) for name in names}
        return self._client.pool.views(chunk, views)

    def _fetch(
        self, ref: SampleRef, data: list[str], spans: dict[str, tuple[int, int]], head_at: int
    ) -> Chunk:
        """Read head, marker and ``data`` tensors of ``ref`` into one registered chunk."""
        client = self._client
        keys = [self._head_key(ref.sample_id), *self._keys(ref.sample_id, ref.generation, data)]
        if client.removals.is_pending(keys[1]):
            raise self._stale(ref, "deleted; its removal waits for a read lease")
        marker_at = head_at + _HEAD_CAP
        chunk = client.pool.lease(marker_at + _tensors.ALIGN)
        try:
            ptrs = [chunk.ptr + head_at, chunk.ptr + marker_at]
            ptrs += [chunk.ptr + spans[name][0] for name in data]
            sizes = [_HEAD_CAP, _tensors.ALIGN, *(spans[name][1] for name in data)]
            codes = client.raw.batch_get_into(keys, ptrs, sizes)
            head_code, marker_code = codes[0], codes[1]
            if head_code >= 0:
                head = self._parse_head(
                    chunk.array[head_at : head_at + head_code].tobytes(), ref.sample_id
                )
            elif head_code == BUFFER_TOO_SMALL:
                head = self._read_head(ref.sample_id)
            elif head_code in (NOT_FOUND, NOT_READY):  # none, or another put is writing it
                head = None
            else:
                raise _error(head_code, f"reading the head of {ref.sample_id!r}")
            if head is not None and head.generation != ref.generation:
                raise self._stale(ref, f"superseded by generation {head.generation}")
            if marker_code == NOT_FOUND or NOT_FOUND in codes[2:]:
                raise self._stale(ref, "deleted or superseded")
            if marker_code < 0:
                raise _error(marker_code, f"reading {keys[1]}")
            for key, code, size in zip(keys[2:], codes[2:], sizes[2:], strict=True):
                if code == BUFFER_TOO_SMALL or 0 <= code != size:
                    raise CorruptFeatureError(
                        f"{key}: read {code if code >= 0 else 'more than'} bytes, the ref's "
                        f"spec says {size}; the object does not match the ref"
                    )
                if code < 0:
                    raise _error(code, f"reading {key}")
        except BaseException:
            client.pool.release(chunk)
            raise
        return chunk

    def _delete(self, ref: SampleRef) -> None:
        client = self._client
        names = [name for name in sorted(ref.specs) if _tensors.nbytes(ref.specs[name])]
        keys = self._keys(ref.sample_id, ref.generation, names)
        if not client.removals.is_pending(keys[0]):
            client.removals.remove(keys)
        with client.id_lock(self._head_key(ref.sample_id)):
            head = self._read_head(ref.sample_id)
            # The head is read by every get, so it is nearly always under a
            # lease; a queued removal could land after a later put made it name
            # a newer generation. Forcing it right after the check keeps that
            # race to one round trip, and a reader racing the removal reads no
            # head (or an unparseable one), which means "no newer generation".
            if head is not None and head.generation == ref.generation:
                client.raw.remove(self._head_key(ref.sample_id), True)
        with self._lock:
            if self._live.get(ref.sample_id, (None,))[0] == ref.generation:
                del self._live[ref.sample_id]

    def _exists(self, ref: SampleRef) -> bool:
        try:
            chunk = self._fetch(ref, [], {}, 0)
        except StaleRefError:
            return False
        self._client.pool.release(chunk)
        return True

    def _stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(len(self._live), sum(size for _, size in self._live.values()))

    def _close(self) -> None:
        client = self._client
        left = client.removals.drain(f"{self.namespace}/", self.drain_timeout)
        left += _release(self._settings, self.drain_timeout)
        if left:
            warnings.warn(
                f"{self.uri}: {len(left)} Mooncake keys were still under a read lease after "
                f"{self.drain_timeout:g}s and stay stored, e.g. {left[:3]}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )
