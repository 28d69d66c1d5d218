"""Feature store on a directory that several processes (or hosts, over NFS) share.

Each put writes a new file (one per sample generation) and renames it over the
sample's name, so the name always holds one whole generation. The directory
layout and its locks are in :mod:`stores._shared_dir_layout`, the file format
in :mod:`stores._shared_dir_format`, the listing in :mod:`stores._shared_dir_scan`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    StaleRefError,
    StoreError,
    StoreFullError,
)
from dataflow.interfaces import FeatureStore, StoredObject, StoreStats, fsync_path
from dataflow.model import FeatureSpec, SampleRef
from stores import _tensors
from stores._pool import ChunkPool
from stores._shared_dir_format import (
    FileLayout,
    array_of,
    check_header,
    current_generation,
    file_generation,
    file_pieces,
    pwrite_all,
    read_header,
    read_tensor,
    sealed_head,
    writev_all,
)
from stores._shared_dir_layout import TMP_NAME_RE, _Directory
from stores._shared_dir_scan import UNFINISHED_PREFIX, _Scan

_POOL_FROM = 4 << 20
#: Layouts kept per store handle (one per set of specs put; cleared when full).
_LAYOUTS = 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: A replacing put reads what is at the sample's file at most this often (see _replace).
_TRIES = 8
log = logging.getLogger(__name__)
_new, _set = object.__new__, object.__setattr__


def _checked_ref(
    sample_id: str, store: str, generation: int, specs: dict[str, FeatureSpec], metadata: Any
) -> SampleRef:
    """``SampleRef(sample_id, store, generation, specs, metadata)`` for a put's own values,
    without its checks: ``FeatureStore.put``/``put_many`` checked the id, the names and the
    metadata (a plain JSON copy) before the hook, the specs are ``FeatureSpec.of`` a
    tensor and the generation a positive int. The checks were a tenth of a put's CPU."""
    # Attribute by attribute: ref.__dict__ would make each ref carry a dict object (one
    # more for the garbage collector) where Python keeps its values inline.
    ref = _new(SampleRef)
    _set(ref, "sample_id", sample_id)
    _set(ref, "store", store)
    _set(ref, "generation", generation)
    _set(ref, "specs", specs)
    _set(ref, "metadata", metadata)
    return ref


class SharedDirFeatureStore(FeatureStore):
    """Features as files in a directory shared by processes; URI ``dir:///ABS/PATH``.

    Every put writes a new file (unnamed, or to a temporary name), fsyncs it,
    links it as the sample's file (or renames it over the one there) and fsyncs
    the directory: a reader sees a whole generation or none, also across a
    crash, and one that opened the previous generation keeps reading it whole.
    Reads go straight from the file into the memory of the returned tensors;
    for samples of 4 MiB and more that memory is recycled once the caller
    drops the tensors (up to ``recycle_bytes`` kept idle), which spares the
    page faults of fresh memory.

    Generations are unique and increasing per id across processes: a new
    sample's file is linked into place, which fails where any file is; one that
    replaces a file is ``max(time_ns, current + 1)``, chosen under the flock of
    the sample's bucket. A delete takes the same lock and removes the file
    only while it still holds the ref's generation.

    Each tensor's XXH3-64 checksum is in the header, which has a checksum of
    its own; a get checks the header and every tensor it reads, and raises
    CorruptFeatureError (naming sample, feature and file) on a mismatch.

    ``scan`` walks the bucket directories lazily (constant memory), through
    directory fds and without following symlinks; a StoredObject's
    ``created`` is its file's mtime. It lists the temporary files too, as
    samples ``tmp/NAME`` of generation 0: a put whose process died may leave one
    (a file system without unnamed files, see ``_shared_dir_layout``, or a
    replacement), which a collector (``dataflow gc``) removes after its grace period. Files
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
        self._dir = _Directory(root_path, self.uri)
        self._listing = _Scan(self._dir)
        self._pool = ChunkPool(recycle_bytes)
        self._last_generation = 0
        self._generation_lock = threading.Lock()
        self._layouts: dict[Any, FileLayout] = {}

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
        return self._dir.file(sample_id)

    # -- hooks -------------------------------------------------------------
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        ref, folder = self._put_unsynced(sample_id, tensors, metadata)
        fsync_path(folder, directory=True)
        return ref

    def _put_many(
        self, items: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]
    ) -> list[SampleRef]:
        # Each file is fsynced before it is linked (or renamed) into place, as in a put;
        # the links are made durable together, one fsync per directory the batch
        # touched, before this returns (so before a producer commits any of the refs).
        # A crash before then may lose some of the links: nothing is committed yet, and
        # a lost one leaves nothing (an unnamed file) or a temporary file for `dataflow gc`.
        folders: dict[str, None] = {}

        def put_each() -> Iterator[list[SampleRef]]:
            for item in items:
                ref, folder = self._put_unsynced(*item)
                folders[folder] = None
                yield [ref]
            for folder in folders:
                fsync_path(folder, directory=True)
            yield []

        return self._all_or_none(put_each())

    def _put_unsynced(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> tuple[SampleRef, str]:
        """A put but for the fsync of its directory: its ref, and that directory."""
        layout = self._layout(tensors)
        arrays = [array_of(tensors[name]) for name in layout.names]
        path = self._file(sample_id)
        try:
            generation = self._put_file(sample_id, path, layout, arrays)
        except OSError as exc:
            if exc.errno not in _DISK_FULL:
                raise
            raise StoreFullError(
                f"cannot put sample {sample_id!r} to {path}: the file system under "
                f"{self.root} is full ({exc.strerror}); nothing was stored and the sample's "
                "previous generation, if any, is intact: free space there (`dataflow gc` "
                "deletes released samples) and put it again"
            ) from exc
        ref = _checked_ref(sample_id, self.uri, generation, dict(layout.specs), metadata)
        return ref, path.rpartition("/")[0]  # its directory

    def _layout(self, tensors: dict[str, torch.Tensor]) -> FileLayout:
        """The file layout of samples of ``tensors``' names, shapes and dtypes."""
        key = tuple([(name, t.shape, t.dtype) for name, t in tensors.items()])
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = FileLayout(key, self._checksums)
        return layout

    def _put_file(self, sample_id: str, path: str, layout: FileLayout, arrays: list[Any]) -> int:
        """Write a new generation of ``sample_id`` as the file ``path``; its generation.

        The file is written whole and fsynced, then linked into place, without a lock: a
        link never replaces a file, so it makes only a sample that has none (a producer's
        usual put), and any generation is then larger than none. Where a file is there,
        the new one replaces it under the lock of the sample's bucket (:meth:`_replace`).
        The caller fsyncs the directory of ``path`` (once for a batch of puts).
        """
        header, body, size = file_pieces(sample_id, arrays, layout)
        generation = self._next_generation(1)
        fd, tmp = self._dir.open_new(path.rpartition("/")[0])
        try:
            writev_all(fd, [sealed_head(header, generation), *body], size)
            os.fsync(fd)
            if not self._dir.link_new(fd, tmp, path):
                generation = self._replace(sample_id, path, (header, generation), fd, tmp)
        finally:
            os.close(fd)
            if tmp is not None:  # linked (it keeps that name too), or failed: not renamed
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return generation

    def _replace(
        self, sample_id: str, path: str, written: tuple[bytes, int], fd: int, tmp: str | None
    ) -> int:
        """Put the file ``fd`` (named ``tmp``, or unnamed; ``written``: its header JSON and
        generation) in place of what is at ``path``, with a generation larger than that
        one's (the file's own where it is, else a new one, written over it); the generation.

        Under the bucket's lock, which every replacement and delete of the sample takes:
        the file read stays until this replaces it. Only a put without the lock can
        come between, where nothing was (the link then fails, and this reads again).
        """
        header, generation = written
        unlock = self._dir.lock(sample_id)
        try:
            for _ in range(_TRIES):
                present, current = file_generation(path, sample_id)
                if current >= generation:
                    generation = self._next_generation(current + 1)
                    pwrite_all(fd, sealed_head(header, generation), 0)
                    os.fsync(fd)
                if not present and self._dir.links:
                    if self._dir.link_new(fd, tmp, path):
                        return generation
                    if self._dir.links:
                        continue
                named = self._dir.name(fd) if tmp is None else tmp
                try:
                    self._rename_into_place(named, path, sample_id)
                except BaseException:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(named)
                    raise
                return generation
        finally:
            unlock()
        raise StoreError(
            f"cannot put sample {sample_id!r} to {path}: its file appeared and vanished "
            f"{_TRIES} times while this put held its lock (something other than this store "
            "removes files there); nothing was stored: stop that, then put it again"
        )

    def _rename_into_place(self, tmp: str, path: str, sample_id: str) -> None:
        """Rename ``tmp`` over ``path``, mending what a hand may have broken in the layout."""
        try:
            os.rename(tmp, path)
            return
        except FileNotFoundError:
            # Its directory was removed: make it again, not fail every put after.
            if not os.path.exists(tmp):
                raise
            self._dir.mend(os.path.dirname(path))
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
            check_header(header, ref, list(targets), path)
            for name, target in targets.items():
                read_tensor(fd, target, header, ref, name, path, checksums=self._checksums)
        finally:
            os.close(fd)

    def _delete(self, ref: SampleRef) -> None:
        self._delete_generation(ref.sample_id, ref.generation)

    def _delete_stored(self, obj: StoredObject) -> bool:
        name = obj.sample_id.removeprefix(UNFINISHED_PREFIX)
        if obj.generation == 0 and TMP_NAME_RE.fullmatch(name):
            try:
                os.unlink(f"{self._dir.tmp}/{name}")
            except FileNotFoundError:
                return False
            return True
        return self._delete_generation(obj.sample_id, obj.generation)

    def _delete_generation(self, sample_id: str, generation: int) -> bool:
        path = self._file(sample_id)
        with self._dir.locked(sample_id):
            if current_generation(path, sample_id) != generation:
                return False
            os.unlink(path)
            return True

    def _exists(self, ref: SampleRef) -> bool:
        current = current_generation(self._file(ref.sample_id), ref.sample_id)
        return current == ref.generation

    def _scan(self) -> Iterator[StoredObject]:
        yield from self._listing.samples()
        yield from self._listing.unfinished()

    def _stats(self) -> StoreStats:
        objects = nbytes = 0
        for obj in self._listing.samples():  # sample generations: not the writes under way
            objects, nbytes = objects + 1, nbytes + obj.nbytes
        return StoreStats(objects=objects, bytes=nbytes)

    def _close(self) -> None:
        self._pool.close()
        self._dir.close()

    # -- writing -----------------------------------------------------------
    def _next_generation(self, floor: int) -> int:
        with self._generation_lock:
            generation = max(time.time_ns(), floor, self._last_generation + 1)
            self._last_generation = generation
            return generation

    # -- reading -----------------------------------------------------------
    def _open(self, ref: SampleRef, path: str) -> tuple[int, dict[str, Any]]:
        """An fd of the file of ``ref``'s generation (the caller closes it), and its header."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._stale(ref, "deleted") from None
        try:
            generation, header = read_header(fd, path, ref.sample_id)
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

    def _stale(self, ref: SampleRef, why: str) -> StaleRefError:
        return StaleRefError(
            f"{self.uri} has no generation {ref.generation} of {ref.sample_id!r} ({why})"
        )
