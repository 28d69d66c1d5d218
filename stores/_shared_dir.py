"""Feature store on a directory that several processes (or hosts, over NFS) share.

Layout under the root::

    samples/<bucket 00..ff>/<name of the sample id>   the sample's current generation
    tmp/                                             files being written
    locks/<bucket>.lock                              flock per bucket, never deleted

Each put writes a new file (one per sample generation) and renames it over the
sample's name, so the name always holds one whole generation, and buckets are
fixed: a put costs the fsyncs of a plain atomic file write, no more.

File format (little endian)::

    b"DFFEAT02" | u64 header length | u64 generation | u64 header xxh3 | header JSON
    | zero pad | tensor bytes

The header is ``{"sample_id": ..., "data_bytes": ..., "tensors": {name: {"dtype",
"shape", "offset", "nbytes", "xxh3"}}}``. The data starts at the first 64-byte
aligned offset after the header; tensor offsets count from there, each 64-byte
aligned, tensors in name order (see :mod:`stores._tensors`). ``xxh3`` is the
XXH3-64 of a tensor's bytes (16 hex digits); the header xxh3 covers magic,
length, generation and header JSON. A header that fails its checksum, or names
another sample, is corruption; only an intact header of another generation
means the ref's generation is gone (stale).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
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
import xxhash

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    InvalidSampleIdError,
    StaleRefError,
    StoreError,
    StoreFullError,
)
from dataflow.interfaces import FeatureStore, StoredObject, StoreStats, fsync_path
from dataflow.model import FeatureSpec, SampleRef, validate_sample_id
from stores import _tensors
from stores._pool import ChunkPool

MAGIC = b"DFFEAT02"
_MAGIC_FAMILY = b"DFFEAT"
_PREFIX = struct.Struct("<8sQQQ")
_SUMMED = struct.Struct("<8sQQ")  # what the header xxh3 covers, with the header JSON
_SEALED = struct.Struct("<QQ")  # generation and header xxh3, written last, at offset 16
_HEADER_READ = 4096
_MAX_HEADER = 64 << 20
_BUCKETS = 256
_IOV_MAX = 512
_POOL_FROM = 4 << 20
_PLAIN_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_ESCAPE_RE = re.compile(r"[^A-Za-z0-9._-]|^\.")
_MAX_NAME = 200
_BUCKET_RE = re.compile(r"[0-9a-f]{2}")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Directories are opened relative to their parent's fd and never through a
# symlink, so a scan cannot be led out of the root.
#: The sample id under which ``scan`` lists an unfinished write, a file in tmp/ (with
#: generation 0, which no put hands out: generations are the wall clock in nanoseconds).
UNFINISHED_PREFIX = "tmp/"
_TMP_NAME_RE = re.compile(r"[0-9]+-[0-9]+-[0-9]+\.tmp")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_tmp_names = itertools.count()
log = logging.getLogger(__name__)


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


_FIX = "delete the file and put the sample again (regenerate it); refs to it cannot be read"


def _corrupt(path: str, sample_id: str | None, what: str) -> CorruptFeatureError:
    sample = "of an unknown sample" if sample_id is None else f"of sample {sample_id!r}"
    return CorruptFeatureError(f"{path} ({sample}): {what}; the file is corrupt: {_FIX}")


def _header_checksum(header: bytes, generation: int) -> int:
    """XXH3-64 of everything before the data but the checksum itself."""
    return xxhash.xxh3_64_intdigest(_SUMMED.pack(MAGIC, len(header), generation) + header)


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

    Each tensor's XXH3-64 checksum is in the header, which has a checksum of
    its own; a get checks the header and every tensor it reads, and raises
    CorruptFeatureError (naming sample, feature and file) on a mismatch.

    ``scan`` walks the bucket directories lazily (constant memory), through
    directory fds and without following symlinks; a StoredObject's
    ``created`` is its file's mtime. It lists the temporary files too, as
    samples ``tmp/NAME`` of generation 0: a put whose process died leaves one,
    which a collector (``dataflow gc``) removes after its grace period. Files
    that are corrupt, or that lie where their sample's file does not belong,
    are skipped with a logged warning: no ref can read them, and
    ``delete_stored`` could not name them.
    """

    #: Benchmarks only: False skips the checksums (none computed on put, none
    #: checked on get). What such a handle puts, a checking handle refuses.
    _checksums = True

    def __init__(self, root: str | os.PathLike[str], *, recycle_bytes: int = 512 << 20) -> None:
        root_path = Path(root).expanduser().resolve()
        super().__init__("dir://" + urllib.parse.quote(str(root_path)))
        self.root = root_path
        self._samples = str(root_path / "samples")
        self._tmp = str(root_path / "tmp")
        self._locks = str(root_path / "locks")
        if root_path.exists() and not root_path.is_dir():
            raise StoreError(
                f"the shared directory store's root {str(root_path)!r} is a file, not a "
                "directory: pass a directory (or a path that does not exist yet)"
            )
        try:
            for directory in (self._tmp, self._locks):
                os.makedirs(directory, exist_ok=True)
            created = False
            for bucket in range(_BUCKETS):
                with contextlib.suppress(FileExistsError):
                    os.makedirs(f"{self._samples}/{bucket:02x}")
                    created = True
            if created:
                fsync_path(self._samples, directory=True)
        except OSError as exc:
            raise StoreError(
                f"cannot lay out the shared directory store under {str(root_path)!r}: {exc}"
            ) from exc
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
        try:
            generation = self._put_file(sample_id, path, dense, specs)
        except OSError as exc:
            if exc.errno not in _DISK_FULL:
                raise
            raise StoreFullError(
                f"cannot put sample {sample_id!r} to {path}: the file system under "
                f"{self.root} is full ({exc.strerror}); nothing was stored and the sample's "
                "previous generation, if any, is intact: free space there (`dataflow gc` "
                "deletes released samples) and put it again"
            ) from exc
        return SampleRef(sample_id, self.uri, generation, specs, metadata)

    def _put_file(
        self,
        sample_id: str,
        path: str,
        dense: dict[str, torch.Tensor],
        specs: dict[str, FeatureSpec],
    ) -> int:
        """Write a new generation of ``sample_id`` and rename it over ``path``; its generation."""
        fd, tmp, header = self._write_tmp(sample_id, dense, specs)
        try:
            with self._locked(sample_id):
                current = self._current_generation(path, sample_id)
                generation = self._next_generation(current + 1)
                os.pwrite(fd, _SEALED.pack(generation, _header_checksum(header, generation)), 16)
                os.fsync(fd)
                self._rename_into_place(tmp, path, sample_id)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        fsync_path(os.path.dirname(path), directory=True)
        return generation

    def _rename_into_place(self, tmp: str, path: str, sample_id: str) -> None:
        """Rename ``tmp`` over ``path``, mending what a hand may have broken in the layout."""
        try:
            os.rename(tmp, path)
            return
        except FileNotFoundError:
            # Its bucket directory was removed: make it again, not fail every put after.
            if not os.path.exists(tmp):
                raise
            log.warning("%s: recreating the missing directory of %s", self.uri, path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fsync_path(self._samples, directory=True)
        except IsADirectoryError:
            # A directory where the sample's file belongs: removable only while empty
            # (rmdir refuses otherwise), so nothing anybody put there is lost.
            try:
                os.rmdir(path)
            except OSError as exc:
                raise CorruptFeatureError(
                    f"{path} (of sample {sample_id!r}) is a directory, not a sample file, and "
                    f"cannot be removed ({exc.strerror}): remove it and put the sample again"
                ) from None
            log.warning("%s: removed the empty directory %s to put %r", self.uri, path, sample_id)
        os.rename(tmp, path)

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        specs = {name: ref.specs[name] for name in names}
        spans = _tensors.layout(specs)
        end = _tensors.end_of(spans.values())
        if end < _POOL_FROM:
            out = {name: _tensors.empty(spec) for name, spec in specs.items()}
            self._get_into(ref, out)
            return out
        chunk = self._pool.lease(end)
        try:
            self._read_into(
                ref, {name: chunk.array[at : at + nbytes] for name, (at, nbytes) in spans.items()}
            )
        except BaseException:
            self._pool.release(chunk)
            raise
        return self._pool.views(chunk, {name: (spans[name][0], specs[name]) for name in names})

    def _get_into(self, ref: SampleRef, out: dict[str, torch.Tensor]) -> None:
        self._read_into(ref, {name: _tensors.byte_view(t).numpy() for name, t in out.items()})

    def _read_into(self, ref: SampleRef, targets: dict[str, Any]) -> None:
        """Read (and verify) each named feature of ``ref`` into its uint8 numpy array."""
        path = self._file(ref.sample_id)
        fd, header = self._open(ref, path)
        try:
            self._check_header(header, ref, list(targets), path)
            for name, target in targets.items():
                self._read_tensor(fd, target, header, ref, name, path)
        finally:
            os.close(fd)

    def _delete(self, ref: SampleRef) -> None:
        self._delete_generation(ref.sample_id, ref.generation)

    def _delete_stored(self, obj: StoredObject) -> bool:
        name = obj.sample_id.removeprefix(UNFINISHED_PREFIX)
        if obj.generation == 0 and _TMP_NAME_RE.fullmatch(name):
            try:
                os.unlink(f"{self._tmp}/{name}")
            except FileNotFoundError:
                return False
            return True
        return self._delete_generation(obj.sample_id, obj.generation)

    def _delete_generation(self, sample_id: str, generation: int) -> bool:
        path = self._file(sample_id)
        with self._locked(sample_id):
            if self._current_generation(path, sample_id) != generation:
                return False
            os.unlink(path)
            return True

    def _exists(self, ref: SampleRef) -> bool:
        current = self._current_generation(self._file(ref.sample_id), ref.sample_id)
        return current == ref.generation

    def _scan(self) -> Iterator[StoredObject]:
        yield from self._scan_samples()
        yield from self._scan_unfinished()

    def _stats(self) -> StoreStats:
        objects = nbytes = 0
        for obj in self._scan_samples():  # sample generations: not the writes under way
            objects, nbytes = objects + 1, nbytes + obj.nbytes
        return StoreStats(objects=objects, bytes=nbytes)

    def _scan_samples(self) -> Iterator[StoredObject]:
        samples = os.open(self._samples, _DIR_FLAGS)
        try:
            with os.scandir(samples) as buckets:
                for bucket in buckets:
                    if _BUCKET_RE.fullmatch(bucket.name) and bucket.is_dir(follow_symlinks=False):
                        yield from self._scan_bucket(samples, bucket.name)
        finally:
            os.close(samples)

    def _scan_unfinished(self) -> Iterator[StoredObject]:
        """The files in tmp/: writes in progress, or left by a put whose process died.

        Each is listed as sample ``tmp/NAME`` generation 0 (no ref names it), created
        when it was last written; ``delete_stored`` removes the file.
        """
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return
        for entry in entries:
            if not _TMP_NAME_RE.fullmatch(entry.name):
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            sample_id = UNFINISHED_PREFIX + entry.name
            yield StoredObject(sample_id, 0, stat.st_size, stat.st_mtime)

    def _scan_bucket(self, samples: int, bucket: str) -> Iterator[StoredObject]:
        try:
            fd = os.open(bucket, _DIR_FLAGS, dir_fd=samples)
        except OSError:  # replaced by a symlink or removed: not ours to list
            return
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_file(follow_symlinks=False):
                        obj = self._stored(fd, f"{self._samples}/{bucket}/{entry.name}")
                        if obj is not None:
                            yield obj
        finally:
            os.close(fd)

    def _stored(self, bucket_fd: int, path: str) -> StoredObject | None:
        """The StoredObject of the sample file at ``path``; None if gone or skipped."""
        try:
            fd = os.open(os.path.basename(path), _FILE_FLAGS, dir_fd=bucket_fd)
        except OSError:  # deleted while we scanned, or swapped for a symlink
            return None
        try:
            generation, header = self._read_header(fd, path, None)
            created = os.fstat(fd).st_mtime
            nbytes = sum(t["nbytes"] for t in header["tensors"].values())
            if not isinstance(nbytes, int) or nbytes < 0:
                raise TypeError(f"tensor sizes add up to {nbytes!r}")
        except (KeyError, TypeError) as exc:
            log.warning("scan of %s skips %s, its tensor table is bad: %s", self.uri, path, exc)
            return None
        except CorruptFeatureError as exc:
            log.warning("scan of %s skips a file no ref can read: %s", self.uri, exc)
            return None
        finally:
            os.close(fd)
        sample_id = header.get("sample_id")
        try:
            belongs = self._file(validate_sample_id(sample_id))
        except InvalidSampleIdError:
            belongs = "nowhere (not a valid sample id)"
        if belongs != path:
            log.warning(
                "scan of %s skips %s: its header names sample %r, whose file is %s",
                self.uri,
                path,
                sample_id,
                belongs,
            )
            return None
        return StoredObject(sample_id, generation, nbytes, created)

    def _close(self) -> None:
        self._pool.close()
        if self._pid == os.getpid():
            for fd in self._lock_fds.values():
                os.close(fd)
        self._lock_fds = {}

    # -- writing -----------------------------------------------------------
    def _write_tmp(
        self, sample_id: str, dense: dict[str, torch.Tensor], specs: dict[str, FeatureSpec]
    ) -> tuple[int, str, bytes]:
        """Write all but generation and header checksum to a new temporary file.

        Returns the open fd, the file's path and the header JSON.
        """
        spans = _tensors.layout(specs)
        data_bytes = _tensors.end_of(spans.values())
        data = {name: _tensors.byte_view(dense[name]).numpy() for name in specs}
        sums = {name: _tensors.checksum(data[name]) if self._checksums else None for name in data}
        header = self._header(sample_id, specs, spans, data_bytes, sums)
        start = _tensors.align(_PREFIX.size + len(header))
        pieces = [memoryview(_PREFIX.pack(MAGIC, len(header), 0, 0) + header)]
        position = _PREFIX.size + len(header)
        for name in sorted(specs):
            offset, nbytes = spans[name]
            pieces.append(memoryview(bytes(start + offset - position)))
            pieces.append(memoryview(data[name]))
            position = start + offset + nbytes
        pieces.append(memoryview(bytes(start + data_bytes - position)))
        tmp = f"{self._tmp}/{os.getpid()}-{threading.get_ident()}-{next(_tmp_names)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # tmp/ was removed: make it again, not fail every put after
            log.warning("%s: recreating the missing directory %s", self.uri, self._tmp)
            os.makedirs(self._tmp, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _writev_all(fd, pieces)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, tmp, header

    @staticmethod
    def _header(
        sample_id: str,
        specs: dict[str, FeatureSpec],
        spans: dict[str, tuple[int, int]],
        data_bytes: int,
        sums: dict[str, str | None],
    ) -> bytes:
        tensors = {
            name: {
                "dtype": _tensors.dtype_str(spec.dtype),
                "shape": list(spec.shape),
                "offset": spans[name][0],
                "nbytes": spans[name][1],
                "xxh3": sums[name],
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
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                except FileNotFoundError:  # locks/ was removed
                    os.makedirs(self._locks, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                self._lock_fds[bucket] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    # -- reading -----------------------------------------------------------
    @classmethod
    def _current_generation(cls, path: str, sample_id: str) -> int:
        """Generation in ``path``; 0 when there is none, or a corrupt one (so replaceable)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            return cls._read_sealed(fd, path, sample_id)[0]
        except CorruptFeatureError:
            return 0
        finally:
            os.close(fd)

    def _open(self, ref: SampleRef, path: str) -> tuple[int, dict[str, Any]]:
        """An fd of the file of ``ref``'s generation (the caller closes it), and its header."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._stale(ref, "deleted") from None
        try:
            generation, header = self._read_header(fd, path, ref.sample_id)
            # The header is intact and names this sample: another generation
            # was put. Usually a newer one; an older one only after a delete
            # and a put on a host whose clock is behind.
            if generation > ref.generation:
                raise self._stale(ref, f"superseded by generation {generation}")
            if generation < ref.generation:
                raise self._stale(ref, f"deleted, and put again since as generation {generation}")
        except BaseException:
            os.close(fd)
            raise
        return fd, header

    @staticmethod
    def _read_sealed(fd: int, path: str, sample_id: str | None) -> tuple[int, bytes, int]:
        """(generation, header JSON, where it ends) of a file whose header passes its checksum.

        ``sample_id`` (None: unknown) only names the sample in errors.
        """
        try:
            head = os.pread(fd, _HEADER_READ, 0)
        except IsADirectoryError:
            # A directory in place of the file (made by hand): corrupt, so that a get
            # names it and a trainer counts the sample lost, and a put may replace it.
            raise CorruptFeatureError(
                f"{path} should be the file of "
                f"{'a sample' if sample_id is None else f'sample {sample_id!r}'} but is a "
                "directory: remove it and put the sample again"
            ) from None
        if len(head) < _PREFIX.size:
            raise _corrupt(path, sample_id, f"truncated ({len(head)} bytes, no header)")
        magic, length, generation, written = _PREFIX.unpack_from(head)
        if magic != MAGIC and magic[:6] == _MAGIC_FAMILY:
            raise _corrupt(
                path,
                sample_id,
                f"file format version {magic[6:].decode(errors='replace')}, this dataflow reads "
                f"only version {MAGIC[6:].decode()} (files with checksums)",
            )
        if magic != MAGIC or length > _MAX_HEADER:
            raise _corrupt(path, sample_id, "not a dataflow feature file (bad magic or header)")
        end = _PREFIX.size + length
        if end > len(head):
            head += os.pread(fd, end - len(head), len(head))
        if end > len(head):
            raise _corrupt(path, sample_id, "truncated inside its header")
        raw = head[_PREFIX.size : end]
        if _header_checksum(raw, generation) != written:
            raise _corrupt(
                path,
                sample_id,
                "its header (sample id, generation, tensor table) fails its checksum",
            )
        return generation, raw, end

    @classmethod
    def _read_header(cls, fd: int, path: str, sample_id: str | None) -> tuple[int, dict[str, Any]]:
        """(generation, header) of an intact file of ``sample_id`` (None: of any sample)."""
        generation, raw, end = cls._read_sealed(fd, path, sample_id)
        try:
            header = json.loads(raw)
            if not isinstance(header["tensors"], dict) or not isinstance(header["data_bytes"], int):
                raise TypeError("bad field types")
        except (ValueError, KeyError, TypeError) as exc:
            raise _corrupt(path, sample_id, f"unreadable header: {exc}") from exc
        if sample_id is not None and header.get("sample_id") != sample_id:
            raise _corrupt(path, sample_id, f"its header names sample {header.get('sample_id')!r}")
        header["start"] = _tensors.align(end)
        size, actual = header["start"] + header["data_bytes"], os.fstat(fd).st_size
        if actual < size:
            raise _corrupt(path, sample_id, f"truncated: {actual} bytes, its header says {size}")
        return generation, header

    @staticmethod
    def _check_header(header: dict[str, Any], ref: SampleRef, names: list[str], path: str) -> None:
        for name in names:
            entry = header["tensors"].get(name)
            spec = ref.specs[name]
            if (
                not isinstance(entry, dict)
                or entry.get("dtype") != _tensors.dtype_str(spec.dtype)
                or entry.get("shape") != list(spec.shape)
            ):
                raise _corrupt(
                    path,
                    ref.sample_id,
                    f"feature {name!r} is {entry!r} on disk, the ref says "
                    f"{_tensors.dtype_str(spec.dtype)} {list(spec.shape)}",
                )
            nbytes, offset = _tensors.nbytes(spec), entry.get("offset")
            if (
                entry.get("nbytes") != nbytes
                or not isinstance(offset, int)
                or not 0 <= offset <= header["data_bytes"] - nbytes
            ):
                raise _corrupt(path, ref.sample_id, f"feature {name!r} has a bad extent {entry!r}")

    def _read_tensor(
        self, fd: int, target: Any, header: dict[str, Any], ref: SampleRef, name: str, path: str
    ) -> None:
        """Read feature ``name`` into ``target`` (a uint8 numpy array) and verify it."""
        entry = header["tensors"][name]
        offset = header["start"] + entry["offset"]
        view = memoryview(target)
        while view:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise _corrupt(path, ref.sample_id, f"truncated at byte {offset}")
            view, offset = view[got:], offset + got
        if self._checksums:
            _tensors.verify(
                target, entry.get("xxh3"), sample_id=ref.sample_id, name=name, where=path, fix=_FIX
            )

    def _stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )
