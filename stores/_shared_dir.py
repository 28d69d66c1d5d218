"""Feature store on a directory that several processes (or hosts, over NFS) share.

Layout under the root::

    samples/<bucket 00..ff>/<name of the sample id>   the sample's current generation
    tmp/                                             files being written
    locks/<bucket>.lock                              flock per bucket, never deleted

Each put writes a new file (one per sample generation) and renames it over the
sample's name, so the name always holds one whole generation, and buckets are
fixed: a put costs the fsyncs of a plain atomic file write, no more.

File format (little endian)::

    b"DFFEAT01" | u64 header length | u64 generation | header JSON | zero pad | tensor bytes

The header is ``{"sample_id": ..., "data_bytes": ..., "tensors": {name: {"dtype",
"shape", "offset", "nbytes"}}}``. The data starts at the first 64-byte aligned
offset after the header; tensor offsets count from there, each 64-byte aligned,
tensors in name order (see :mod:`stores._tensors`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import struct
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dataflow._contracts import FeatureSpec, FeatureStore, SampleRef, StoreStats
from dataflow._durable import fsync_path
from dataflow._errors import CorruptFeatureError, InvalidRefError, StaleRefError
from stores import _tensors
from stores._pool import ChunkPool

MAGIC = b"DFFEAT01"
_PREFIX = struct.Struct("<8sQQ")
_HEADER_READ = 4096
_MAX_HEADER = 64 << 20
_BUCKETS = 256
_IOV_MAX = 512
_POOL_FROM = 4 << 20
_PLAIN_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_ESCAPE_RE = re.compile(r"[^A-Za-z0-9._-]|^\.")
_MAX_NAME = 200
_tmp_names = itertools.count()


def sample_file_name(sample_id: str) -> str:
    """The file name a (valid) sample id is stored under; injective over valid ids.

    ``/`` and ``:`` (and a leading ``.``) become ``%2F``, ``%3A`` (``%2E``);
    ``%`` never occurs in a valid id, so no two ids escape to the same name.
    Names longer than 200 characters become ``~`` + sha256 of the id, which no
    escaped name starts with; the header keeps the full id and reads check it.
    """
    if _PLAIN_RE.fullmatch(sample_id):
        escaped = sample_id
    else:
        escaped = _ESCAPE_RE.sub(lambda m: f"%{ord(m.group()):02X}", sample_id)
    if len(escaped) <= _MAX_NAME:
        return escaped
    return "~" + hashlib.sha256(sample_id.encode()).hexdigest()


def _bucket(sample_id: str) -> str:
    return f"{zlib.crc32(sample_id.encode()) % _BUCKETS:02x}"


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    buffers = [b for b in buffers if len(b)]
    while buffers:
        written = os.writev(fd, buffers[:_IOV_MAX])
        while buffers and written >= len(buffers[0]):
            written -= len(buffers.pop(0))
        if written:
            buffers[0] = buffers[0][written:]


class SharedDirFeatureStore(FeatureStore):
    """Features as files in a directory shared by processes; URI ``dir:///ABS/PATH``.

    Every put writes a new file to a temporary name, fsyncs it, renames it
    over the sample's file and fsyncs the directory: a reader sees a whole
    generation or none, also across a crash, and one that opened the previous
    generation keeps reading it whole. Reads go straight from the file into
    the memory of the returned tensors; for samples of 4 MiB and more that
    memory is recycled once the caller drops the tensors (up to
    ``recycle_bytes`` kept idle), which spares the page faults of fresh memory.

    Generations are ``max(time_ns, current + 1)``, chosen under the flock of
    the sample's bucket, so they are unique and increasing per id across
    processes; a delete takes the same lock and removes the file only while it
    still holds the ref's generation.
    """

    def __init__(self, root: str | os.PathLike[str], *, recycle_bytes: int = 512 << 20) -> None:
        root_path = Path(root).expanduser().resolve()
        super().__init__("dir://" + urllib.parse.quote(str(root_path)))
        self.root = root_path
        self._samples = str(root_path / "samples")
        self._tmp = str(root_path / "tmp")
        self._locks = str(root_path / "locks")
        for directory in (self._tmp, self._locks):
            os.makedirs(directory, exist_ok=True)
        created = False
        for bucket in range(_BUCKETS):
            with contextlib.suppress(FileExistsError):
                os.makedirs(f"{self._samples}/{bucket:02x}")
                created = True
        if created:
            fsync_path(self._samples, directory=True)
        self._pool = ChunkPool(recycle_bytes)
        self._last_generation = 0
        self._generation_lock = threading.Lock()
        self._lock_fds: dict[str, int] = {}
        self._bucket_locks = {f"{b:02x}": threading.Lock() for b in range(_BUCKETS)}
        self._pid = os.getpid()

    @classmethod
    def from_uri(cls, uri: str) -> SharedDirFeatureStore:
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != "dir" or parts.netloc or not parts.path.startswith("/"):
            raise InvalidRefError(f"{uri!r} is not a dir:// URI; use dir:///ABSOLUTE/PATH")
        if parts.query or parts.fragment:
            raise InvalidRefError(f"{uri!r}: dir:// URIs take no query or fragment")
        return cls(urllib.parse.unquote(parts.path))

    def path_for(self, sample_id: str) -> Path:
        """The file that holds the current generation of ``sample_id`` (it may be missing)."""
        return Path(self._file(sample_id))

    def _file(self, sample_id: str) -> str:
        return f"{self._samples}/{_bucket(sample_id)}/{sample_file_name(sample_id)}"

    # -- hooks -------------------------------------------------------------
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        dense = {name: _tensors.dense(t) for name, t in tensors.items()}
        specs = {name: FeatureSpec.of(t) for name, t in dense.items()}
        path = self._file(sample_id)
        fd, tmp = self._write_tmp(sample_id, dense, specs)
        try:
            with self._locked(sample_id):
                current = self._current_generation(path)
                generation = self._next_generation(current + 1)
                os.pwrite(fd, generation.to_bytes(8, "little"), 16)
                os.fsync(fd)
                os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        fsync_path(os.path.dirname(path), directory=True)
        return SampleRef(sample_id, self.uri, generation, specs, metadata)

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        path = self._file(ref.sample_id)
        with self._open(ref, path) as (fd, header):
            self._check_header(header, ref, names, path)
            specs = {name: ref.specs[name] for name in names}
            spans = _tensors.layout(specs)
            if _tensors.end_of(spans.values()) < _POOL_FROM:
                out = {name: _tensors.empty(spec) for name, spec in specs.items()}
                for name, tensor in out.items():
                    target = _tensors.byte_view(tensor).numpy()
                    self._read_into(fd, target, self._offset(header, name), path)
                return out
            chunk = self._pool.lease(_tensors.end_of(spans.values()))
            try:
                for name, (at, nbytes) in spans.items():
                    target = chunk.array[at : at + nbytes]
                    self._read_into(fd, target, self._offset(header, name), path)
            except BaseException:
                self._pool.release(chunk)
                raise
            return self._pool.views(chunk, {name: (spans[name][0], specs[name]) for name in names})

    def _delete(self, ref: SampleRef) -> None:
        path = self._file(ref.sample_id)
        with self._locked(ref.sample_id):
            if self._current_generation(path) == ref.generation:
                os.unlink(path)

    def _exists(self, ref: SampleRef) -> bool:
        return self._current_generation(self._file(ref.sample_id)) == ref.generation

    def _stats(self) -> StoreStats:
        objects = nbytes = 0
        for bucket in os.scandir(self._samples):
            for entry in os.scandir(bucket.path):
                try:
                    fd = os.open(entry.path, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # deleted while we scanned
                try:
                    header = self._read_header(fd, entry.path)[1]
                finally:
                    os.close(fd)
                objects += 1
                nbytes += sum(t["nbytes"] for t in header["tensors"].values())
        return StoreStats(objects=objects, bytes=nbytes)

    def _close(self) -> None:
        self._pool.close()
        if self._pid == os.getpid():
            for fd in self._lock_fds.values():
                os.close(fd)
        self._lock_fds = {}

    # -- writing -----------------------------------------------------------
    def _write_tmp(
        self, sample_id: str, dense: dict[str, torch.Tensor], specs: dict[str, FeatureSpec]
    ) -> tuple[int, str]:
        """Write everything but the generation to a new temporary file; (open fd, path)."""
        spans = _tensors.layout(specs)
        data_bytes = _tensors.end_of(spans.values())
        header = self._header(sample_id, specs, spans, data_bytes)
        start = _tensors.align(_PREFIX.size + len(header))
        pieces = [memoryview(_PREFIX.pack(MAGIC, len(header), 0) + header)]
        position = _PREFIX.size + len(header)
        for name in sorted(specs):
            offset, nbytes = spans[name]
            pieces.append(memoryview(bytes(start + offset - position)))
            pieces.append(memoryview(_tensors.byte_view(dense[name]).numpy()))
            position = start + offset + nbytes
        pieces.append(memoryview(bytes(start + data_bytes - position)))
        tmp = f"{self._tmp}/{os.getpid()}-{threading.get_ident()}-{next(_tmp_names)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _writev_all(fd, pieces)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, tmp

    @staticmethod
    def _header(
        sample_id: str,
        specs: dict[str, FeatureSpec],
        spans: dict[str, tuple[int, int]],
        data_bytes: int,
    ) -> bytes:
        tensors = {
            name: {
                "dtype": _tensors.dtype_str(spec.dtype),
                "shape": list(spec.shape),
                "offset": spans[name][0],
                "nbytes": spans[name][1],
            }
            for name, spec in specs.items()
        }
        doc = {"sample_id": sample_id, "data_bytes": data_bytes, "tensors": tensors}
        return json.dumps(doc, separators=(",", ":")).encode()

    def _next_generation(self, floor: int) -> int:
        with self._generation_lock:
            generation = max(time.time_ns(), floor, self._last_generation + 1)
            self._last_generation = generation
            return generation

    @contextlib.contextmanager
    def _locked(self, sample_id: str) -> Iterator[None]:
        # One fd per bucket and process, flocked, plus a thread lock per bucket:
        # a flock belongs to the open file, so it cannot keep apart our own
        # threads (they share the fd), and a forked child must open fds of its
        # own (the inherited ones share its parent's locks).
        if self._pid != os.getpid():
            self._lock_fds, self._pid = {}, os.getpid()
            self._bucket_locks = {b: threading.Lock() for b in self._bucket_locks}
        bucket = _bucket(sample_id)
        with self._bucket_locks[bucket]:
            fd = self._lock_fds.get(bucket)
            if fd is None:
                path = f"{self._locks}/{bucket}.lock"
                fd = self._lock_fds[bucket] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    # -- reading -----------------------------------------------------------
    @staticmethod
    def _current_generation(path: str) -> int:
        """Generation in ``path``; 0 when there is none (or it is unreadable, so replaceable)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            prefix = os.pread(fd, _PREFIX.size, 0)
        finally:
            os.close(fd)
        if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
            return 0
        return _PREFIX.unpack(prefix)[2]

    @contextlib.contextmanager
    def _open(self, ref: SampleRef, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._stale(ref, "deleted") from None
        try:
            generation, header = self._read_header(fd, path)
            if generation != ref.generation:
                raise self._stale(ref, f"superseded by generation {generation}")
            yield fd, header
        finally:
            os.close(fd)

    @staticmethod
    def _read_header(fd: int, path: str) -> tuple[int, dict[str, Any]]:
        head = os.pread(fd, _HEADER_READ, 0)
        if len(head) < _PREFIX.size:
            raise CorruptFeatureError(f"{path}: truncated ({len(head)} bytes, no header)")
        magic, length, generation = _PREFIX.unpack_from(head)
        if magic != MAGIC or length > _MAX_HEADER:
            raise CorruptFeatureError(f"{path}: not a dataflow feature file (bad magic or header)")
        end = _PREFIX.size + length
        if end > len(head):
            head += os.pread(fd, end - len(head), len(head))
        if end > len(head):
            raise CorruptFeatureError(f"{path}: truncated inside its header")
        try:
            header = json.loads(head[_PREFIX.size : end])
            if not isinstance(header["tensors"], dict) or not isinstance(header["data_bytes"], int):
                raise TypeError("bad field types")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFeatureError(f"{path}: unreadable header: {exc}") from exc
        header["start"] = _tensors.align(end)
        size, actual = header["start"] + header["data_bytes"], os.fstat(fd).st_size
        if actual < size:
            raise CorruptFeatureError(f"{path}: truncated: {actual} bytes, its header says {size}")
        return generation, header

    @staticmethod
    def _check_header(header: dict[str, Any], ref: SampleRef, names: list[str], path: str) -> None:
        if header.get("sample_id") != ref.sample_id:
            raise CorruptFeatureError(
                f"{path}: holds sample {header.get('sample_id')!r}, not {ref.sample_id!r}"
            )
        for name in names:
            entry = header["tensors"].get(name)
            spec = ref.specs[name]
            if (
                not isinstance(entry, dict)
                or entry.get("dtype") != _tensors.dtype_str(spec.dtype)
                or entry.get("shape") != list(spec.shape)
            ):
                raise CorruptFeatureError(
                    f"{path}: feature {name!r} is {entry!r} on disk, the ref says "
                    f"{_tensors.dtype_str(spec.dtype)} {list(spec.shape)}"
                )
            nbytes, offset = _tensors.nbytes(spec), entry.get("offset")
            if (
                entry.get("nbytes") != nbytes
                or not isinstance(offset, int)
                or not 0 <= offset <= header["data_bytes"] - nbytes
            ):
                raise CorruptFeatureError(f"{path}: feature {name!r} has a bad extent {entry!r}")

    @staticmethod
    def _offset(header: dict[str, Any], name: str) -> int:
        return header["start"] + header["tensors"][name]["offset"]

    @staticmethod
    def _read_into(fd: int, target: Any, offset: int, path: str) -> None:
        view = memoryview(target)
        while view:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise CorruptFeatureError(f"{path}: truncated at byte {offset}")
            view, offset = view[got:], offset + got

    def _stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )
