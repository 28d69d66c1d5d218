"""The directories of a shared directory store, and the locks that order its writers.

Layout under the root::

    samples/all/<name of the sample id>              the sample's current generation
    tmp/                                             files being written (see below)
    locks/<bucket 00..ff>.lock                       flock per bucket, never deleted

Every sample file lies in one directory, so that a batch of puts (``put_many``) makes
its renames durable with one directory fsync. Stores made before spread their files
over 256 bucket directories, ``samples/<bucket 00..ff>/``, by the bucket of the sample
id (its lock's); a store with those (and no ``samples/all``) keeps that layout.
``samples/`` appears whole (made aside and renamed into place), so every process that
opens the root sees the same layout. The directory fsyncs of a batch of 64 were a
fifth of a producer's CPU on ext4 with the buckets (57 directories on average).

A new file is written unnamed (``O_TMPFILE``) in the directory it is to be linked
into, where the file system can (Linux: ext4, xfs, btrfs, tmpfs); elsewhere (NFS) and
to replace a sample's file, it is written to a temporary name in ``tmp/``. An unnamed
file that a crash interrupts vanishes with it; a named one is left for ``dataflow gc``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from dataflow import StoreError
from dataflow.interfaces import fsync_path

BUCKETS = 256
#: The one directory of the sample files (``samples/all``); bucket directories before.
ONE_DIR = "all"
_PLAIN_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_ESCAPE_RE = re.compile(r"[^A-Za-z0-9._-]|^\.")
_MAX_NAME = 200
#: The name of a file in tmp/ (``{pid}-{thread}-{count}.tmp``).
TMP_NAME_RE = re.compile(r"[0-9]+-[0-9]+-[0-9]+\.tmp")
_BUCKET_NAME_RE = re.compile(r"[0-9a-f]{2}")
#: Linux's flag for a file without a name until it is linked (0 where there is none).
_UNNAMED = getattr(os, "O_TMPFILE", 0)
#: What opening an unnamed file raises where the file system (or kernel) has none.
_NO_UNNAMED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
#: What a link raises on a file system without hard links.
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)
_tmp_names = itertools.count()
#: This process's id: ``os.getpid()`` is a syscall, and a put asked for it twice; a
#: forked child sets its own (``os.register_at_fork``, below).
_pid = os.getpid()
log = logging.getLogger("stores._shared_dir")  # the store's logger, as documented


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


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
    return f"{zlib.crc32(sample_id.encode()) % BUCKETS:02x}"


class _Directory:
    """The root of one store handle: its paths, its temporary files, its bucket locks."""

    def __init__(self, root: Path, uri: str) -> None:
        self.root = root
        self.uri = uri
        self.samples = str(root / "samples")
        self.tmp = str(root / "tmp")
        self.locks = str(root / "locks")
        #: The one directory of the sample files; None in a store of bucket directories.
        self.one: str | None = None
        self._lay_out()
        self._lock_fds: dict[str, int] = {}
        self._bucket_locks = {f"{b:02x}": threading.Lock() for b in range(BUCKETS)}
        self._pid = _pid
        #: /proc, through which an unnamed file is linked (``self/fd/N``, resolved at each
        #: link, so a forked child links its own fds); None: files are written named.
        self._proc = _open_proc()
        #: Whether new files are written unnamed (see the module).
        self.unnamed = self._proc is not None
        #: Whether new files are linked into place (False: the file system has no links).
        self.links = True

    def _lay_out(self) -> None:
        root = self.root
        if root.exists() and not root.is_dir():
            raise StoreError(
                f"the shared directory store's root {str(root)!r} is a file, not a "
                "directory: pass a directory (or a path that does not exist yet)"
            )
        try:
            for directory in (self.tmp, self.locks):
                os.makedirs(directory, exist_ok=True)
            if not os.path.isdir(self.samples):
                self._make_samples()
            one = f"{self.samples}/{ONE_DIR}"
            if not os.path.isdir(one) and not self._has_buckets():
                # samples/all removed by hand: its store had no bucket directories
                log.warning("%s: recreating the missing directory %s", self.uri, one)
                os.makedirs(one, exist_ok=True)
                fsync_path(self.samples, directory=True)
            if os.path.isdir(one):
                self.one = one
                return
            created = False  # a store of bucket directories (made before): mend it
            for bucket in range(BUCKETS):
                with contextlib.suppress(FileExistsError):
                    os.makedirs(f"{self.samples}/{bucket:02x}")
                    created = True
            if created:
                fsync_path(self.samples, directory=True)
        except OSError as exc:
            raise StoreError(
                f"cannot lay out the shared directory store under {str(root)!r}: {exc}"
            ) from exc

    def _has_buckets(self) -> bool:
        """Whether ``samples/`` holds a bucket directory (a store made before samples/all)."""
        with os.scandir(self.samples) as entries:
            return any(
                _BUCKET_NAME_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
                for e in entries
            )

    def _make_samples(self) -> None:
        """Make ``samples/`` with its one directory, aside, and rename it into place.

        So no process sees ``samples/`` without ``samples/all`` and takes the store
        for one of bucket directories; of processes that race, one rename wins.
        """
        aside = f"{self.root}/samples.{os.getpid()}-{threading.get_ident()}.new"
        os.makedirs(f"{aside}/{ONE_DIR}")
        fsync_path(aside, directory=True)
        try:
            os.rename(aside, self.samples)
        except OSError:  # another process made it first (ENOTEMPTY, EEXIST): take theirs
            os.rmdir(f"{aside}/{ONE_DIR}")
            os.rmdir(aside)
            if not os.path.isdir(self.samples):
                raise
        fsync_path(str(self.root), directory=True)

    def file(self, sample_id: str) -> str:
        """The path of the file that holds the current generation of ``sample_id``."""
        if self.one is not None:
            return f"{self.one}/{sample_file_name(sample_id)}"
        return f"{self.samples}/{_bucket(sample_id)}/{sample_file_name(sample_id)}"

    def open_new(self, folder: str) -> tuple[int, str | None]:
        """A new file to be linked into ``folder``, open for writing, and its temporary
        path: None where it has no name (an ``O_TMPFILE``, see the module)."""
        if self.unnamed:
            flags = os.O_WRONLY | _UNNAMED
            try:
                return os.open(folder, flags, 0o644), None
            except FileNotFoundError:
                self.mend(folder)
                return os.open(folder, flags, 0o644), None
            except OSError as exc:
                if exc.errno not in _NO_UNNAMED:
                    raise
                log.debug("%s: no unnamed files in %s (%s); naming them", self.uri, folder, exc)
                self.unnamed = False  # the fd stays open: another thread may be linking
        return self.open_tmp()

    def open_tmp(self) -> tuple[int, str]:
        """A new temporary file, open for writing, and its path."""
        tmp = self._tmp_name()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileNotFoundError:  # tmp/ was removed: make it again, not fail every put after
            self.mend(self.tmp)
            return os.open(tmp, flags, 0o644), tmp

    def _tmp_name(self) -> str:
        return f"{self.tmp}/{_pid}-{threading.get_ident()}-{next(_tmp_names)}.tmp"

    def link_new(self, fd: int, tmp: str | None, path: str) -> bool:
        """Link the new file (``fd``, named ``tmp`` or unnamed) as ``path`` unless something
        is there already (a link never replaces); whether it did. A named file keeps its
        temporary name too: the caller removes it. On a file system without hard links,
        False, and ``links`` is then False: puts rename, each under its lock."""
        if not self.links:
            return False
        try:
            self._link(fd, tmp, path)
        except FileExistsError:
            # Over NFS a link whose reply was lost is sent again, and then fails with
            # EEXIST although it was made: then the file there is this one.
            return tmp is not None and _same_file(tmp, path)
        except OSError as exc:
            if exc.errno in _NO_LINKS and tmp is not None:
                log.debug("%s: no hard links in %s (%s); renaming", self.uri, path, exc)
                self.links = False
                return False
            if not isinstance(exc, FileNotFoundError):
                raise
            # Its directory was removed: make it again, not fail every put after.
            folder = os.path.dirname(path)
            if os.path.isdir(folder):
                raise
            self.mend(folder)
            try:
                self._link(fd, tmp, path)
            except FileExistsError:
                return False
        return True

    def _link(self, fd: int, tmp: str | None, path: str) -> None:
        if tmp is None:
            os.link(f"self/fd/{fd}", path, src_dir_fd=self._proc, follow_symlinks=True)
        else:
            os.link(tmp, path)

    def name(self, fd: int) -> str:
        """Link the unnamed file ``fd`` into tmp/ (to rename it over a file); its path."""
        tmp = self._tmp_name()
        try:
            self._link(fd, None, tmp)
        except FileNotFoundError:
            self.mend(self.tmp)
            self._link(fd, None, tmp)
        return tmp

    def mend(self, folder: str) -> None:
        """Make ``folder`` (a directory of the layout that was removed) again."""
        log.warning("%s: recreating the missing directory %s", self.uri, folder)
        os.makedirs(folder, exist_ok=True)
        fsync_path(os.path.dirname(folder), directory=True)

    @contextlib.contextmanager
    def locked(self, sample_id: str) -> Iterator[None]:
        """Hold the lock of the bucket of ``sample_id``, against threads and processes."""
        unlock = self.lock(sample_id)
        try:
            yield
        finally:
            unlock()

    def lock(self, sample_id: str) -> Callable[[], None]:
        """Take the lock of ``locked`` (without a generator's cost, for each put); returns
        the function that releases it."""
        # One fd per bucket and process, flocked, plus a thread lock per bucket:
        # a flock belongs to the open file, so it cannot keep apart our own
        # threads (they share the fd), and a forked child must open fds of its
        # own (the inherited ones share its parent's locks).
        if self._pid != _pid:
            self._lock_fds, self._pid = {}, _pid
            self._bucket_locks = {b: threading.Lock() for b in self._bucket_locks}
        bucket = _bucket(sample_id)
        thread_lock = self._bucket_locks[bucket]
        thread_lock.acquire()
        try:
            fd = self._lock_fds.get(bucket)
            if fd is None:
                path = f"{self.locks}/{bucket}.lock"
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                except FileNotFoundError:  # locks/ was removed
                    os.makedirs(self.locks, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                self._lock_fds[bucket] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            thread_lock.release()
            raise

        def unlock() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                thread_lock.release()

        return unlock

    def close(self) -> None:
        """Close the lock files (a forked child leaves its parent's alone) and /proc."""
        if self._pid == _pid:
            for fd in self._lock_fds.values():
                os.close(fd)
        self._lock_fds = {}
        self._close_proc()

    def _close_proc(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            os.close(proc)


def _same_file(one: str, other: str) -> bool:
    try:
        return os.path.samefile(one, other)
    except OSError:
        return False


def _open_proc() -> int | None:
    """A directory fd of /proc, where unnamed files can be written; else None."""
    if not _UNNAMED:
        return None
    try:
        return os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # no /proc mounted (a bare container): files are written named
        return None
