"""fsync helpers for atomic, durable writes (temp name, fsync, rename, fsync the directory).

Shared by the ledger's export, the shared-dir store and the checkpoint manager.
(``eval`` keeps its own copy: it depends on torch and the standard library only.)
"""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """fsync a file, or with ``directory=True`` a directory (so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every regular file and directory below ``root``, ``root`` last."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(folder, directory=True)
