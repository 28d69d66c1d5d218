"""EvalCache: one directory per eval identity, produced once, published atomically.

Layout under ``root``::

    <key>/                    published entries; complete by construction
    .locks/<key>.lock         flock()ed while an entry is produced or removed
    .staging/<key>.<random>/  where a producer writes before the rename to <key>/
    .trash/<key>.<random>/    an invalidated entry on its way out

Lock files are never deleted: unlinking a file another process is about to flock()
would let two processes hold "the" lock at once. ``flock`` needs a local (or
flock-aware) POSIX file system.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import secrets
import shutil
from collections.abc import Callable, Iterator

from eval._config import EvalConfig
from eval._errors import EvalError, short_repr

# Part of every key: bump it when what a key covers changes, so old entries stop matching.
_KEY_VERSION = 1


class EvalCache:
    """Directories of eval artifacts (e.g. tokenized eval sets), one per ``EvalConfig``.

    Entries are keyed by the sha256 of a canonical JSON encoding of
    ``config.identity()``, so ``micro_batch_size`` does not change the key and no two
    different identities can collide through a separator. Entries are produced under a
    per-key file lock and published by an atomic rename: concurrent processes run the
    producer once and all get the same directory.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root:
            raise EvalError(
                f"root is {short_repr(root)} ({type(root).__name__}); pass the cache "
                "directory as a non-empty str or pathlib.Path."
            )
        self.root = pathlib.Path(root)

    def key(self, config: EvalConfig) -> str:
        """The hex sha256 naming ``config``'s entry."""
        if not isinstance(config, EvalConfig):
            raise EvalError(f"config is a {type(config).__name__}; pass an EvalConfig.")
        document = {"eval_cache_key_version": _KEY_VERSION, "identity": config.identity()}
        encoded = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        # surrogatepass: a path decoded by os.fsdecode from bytes that are not UTF-8 keeps
        # them as lone surrogates; this encodes them too (injectively, so keys stay
        # distinct) and leaves every other string's bytes, and so every key, unchanged.
        return hashlib.sha256(encoded.encode("utf-8", "surrogatepass")).hexdigest()

    def path(self, config: EvalConfig) -> pathlib.Path:
        """Where ``config``'s entry is, or will be once produced."""
        return self.root / self.key(config)

    def contains(self, config: EvalConfig) -> bool:
        """Whether ``config``'s entry has been published."""
        return self.path(config).is_dir()

    def get_or_produce(
        self, config: EvalConfig, produce_fn: Callable[[pathlib.Path], object]
    ) -> pathlib.Path:
        """``config``'s entry, running ``produce_fn(staging_dir)`` first if it is missing.

        ``produce_fn`` fills the empty directory it is given; its return value is
        ignored. Once it returns, every file and directory is fsynced and the directory
        is renamed into place. If it raises, the staging directory is removed and the
        error propagates: no entry, no garbage.
        """
        if not callable(produce_fn):
            raise EvalError(
                f"produce_fn is a {type(produce_fn).__name__}, not callable; pass a function "
                "that writes the entry into the directory it is given."
            )
        key = self.key(config)
        entry = self.root / key
        if entry.is_dir():
            return entry
        with self._locked(key):
            if entry.is_dir():
                return entry  # another process produced it while we waited
            staging = self._fresh_dir(".staging", key)
            try:
                produce_fn(staging)
                _fsync_tree(staging)
                os.rename(staging, entry)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
                # Where flock is not honoured (some network file systems) a rival may
                # have published first: its entry is as good as ours.
                if entry.is_dir():
                    return entry
                raise
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            _fsync_dir(self.root)
        return entry

    def invalidate(self, config: EvalConfig) -> bool:
        """Remove ``config``'s entry; ``False`` if there was none.

        The entry is first renamed out of place (atomic: readers see it whole or not at
        all), then deleted.
        """
        key = self.key(config)
        entry = self.root / key
        with self._locked(key):
            if not entry.is_dir():
                return False
            trash = self._fresh_dir(".trash", key)
            os.rename(entry, trash / key)
            _fsync_dir(self.root)
            shutil.rmtree(trash)
        return True

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock, first sweeping what crashed holders of it left behind."""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Only a holder of this lock writes these, and the kernel drops a lock when
            # its process dies, so anything left here belongs to a dead process.
            for folder in (".staging", ".trash"):
                for leftover in (self.root / folder).glob(f"{key}.*"):
                    shutil.rmtree(leftover, ignore_errors=True)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _fresh_dir(self, folder: str, key: str) -> pathlib.Path:
        parent = self.root / folder
        parent.mkdir(parents=True, exist_ok=True)
        path = parent / f"{key}.{secrets.token_hex(8)}"
        path.mkdir()  # honours the umask, unlike tempfile.mkdtemp's 0o700
        return path


def _fsync_tree(root: pathlib.Path) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                _fsync(path, os.O_RDONLY)
        _fsync_dir(pathlib.Path(folder))


def _fsync_dir(path: pathlib.Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: str | os.PathLike[str], flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
