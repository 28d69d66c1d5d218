"""What a shared directory store lists: its sample files, then its unfinished writes.

Directories are opened relative to their parent's fd and never through a
symlink, so a scan cannot be led out of the root.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator

from dataflow import CorruptFeatureError, InvalidSampleIdError
from dataflow.interfaces import StoredObject
from dataflow.model import validate_sample_id
from stores._shared_dir_format import read_header
from stores._shared_dir_layout import ONE_DIR, TMP_NAME_RE, _Directory

#: The sample id under which ``scan`` lists an unfinished write, a file in tmp/ (with
#: generation 0, which no put hands out: generations are the wall clock in nanoseconds).
UNFINISHED_PREFIX = "tmp/"
_BUCKET_RE = re.compile(rf"[0-9a-f]{{2}}|{ONE_DIR}")  # the directories of sample files
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
log = logging.getLogger("stores._shared_dir")  # the store's logger, as documented


class _Scan:
    """Lazy listings (constant memory) of a store's directory."""

    def __init__(self, directory: _Directory) -> None:
        self._dir = directory

    def samples(self) -> Iterator[StoredObject]:
        """The sample files, bucket by bucket; corrupt or misplaced ones skipped and logged."""
        samples = os.open(self._dir.samples, _DIR_FLAGS)
        try:
            with os.scandir(samples) as buckets:
                for bucket in buckets:
                    if _BUCKET_RE.fullmatch(bucket.name) and bucket.is_dir(follow_symlinks=False):
                        yield from self._bucket(samples, bucket.name)
        finally:
            os.close(samples)

    def unfinished(self) -> Iterator[StoredObject]:
        """The files in tmp/: writes in progress, or left by a put whose process died.

        Each is listed as sample ``tmp/NAME`` generation 0 (no ref names it), created
        when it was last written; ``delete_stored`` removes the file.
        """
        try:
            entries = list(os.scandir(self._dir.tmp))
        except FileNotFoundError:
            return
        for entry in entries:
            if not TMP_NAME_RE.fullmatch(entry.name):
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            sample_id = UNFINISHED_PREFIX + entry.name
            yield StoredObject(sample_id, 0, stat.st_size, stat.st_mtime)

    def _bucket(self, samples: int, bucket: str) -> Iterator[StoredObject]:
        try:
            fd = os.open(bucket, _DIR_FLAGS, dir_fd=samples)
        except OSError:  # replaced by a symlink or removed: not ours to list
            return
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_file(follow_symlinks=False):
                        obj = self._stored(fd, f"{self._dir.samples}/{bucket}/{entry.name}")
                        if obj is not None:
                            yield obj
        finally:
            os.close(fd)

    def _stored(self, bucket_fd: int, path: str) -> StoredObject | None:
        """The StoredObject of the sample file at ``path``; None if gone or skipped."""
        uri = self._dir.uri
        try:
            fd = os.open(os.path.basename(path), _FILE_FLAGS, dir_fd=bucket_fd)
        except OSError:  # deleted while we scanned, or swapped for a symlink
            return None
        try:
            generation, header = read_header(fd, path, None)
            created = os.fstat(fd).st_mtime
            nbytes = sum(t["nbytes"] for t in header["tensors"].values())
            if not isinstance(nbytes, int) or nbytes < 0:
                raise TypeError(f"tensor sizes add up to {nbytes!r}")
        except (KeyError, TypeError) as exc:
            log.warning("scan of %s skips %s, its tensor table is bad: %s", uri, path, exc)
            return None
        except CorruptFeatureError as exc:
            log.warning("scan of %s skips a file no ref can read: %s", uri, exc)
            return None
        finally:
            os.close(fd)
        sample_id = header.get("sample_id")
        try:
            belongs = self._dir.file(validate_sample_id(sample_id))
        except InvalidSampleIdError:
            belongs = "nowhere (not a valid sample id)"
        if belongs != path:
            log.warning(
                "scan of %s skips %s: its header names sample %r, whose file is %s",
                uri,
                path,
                sample_id,
                belongs,
            )
            return None
        return StoredObject(sample_id, generation, nbytes, created)
