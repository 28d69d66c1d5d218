"""The on-disk layout of checkpoints: names, manifests, digests, pointers.

::

    {root}/{run}/step-00000008-epoch-3/   one checkpoint (``step-00000008`` without a ledger)
        manifest.json                      every file below with its size and sha256
        state.pt                           rank 0's state (model, optimizer, ...)
        rank-00000.pt, rank-00001.pt, ...  each rank's own state, when it gave one
        NO_MODEL                           present when the run's components leave the model out
    {root}/{run}/.tmp-*                    a save in progress; .trash-* a removal in progress
    {root}/{run}-latest, {run}-best        relative symlinks (plain pointer files where
                                           symlinks are unsupported)
    {root}/{run}.best_meta.json            run, metric, mode, score and step of the best
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataflow import InvalidArgumentError
from dataflow.interfaces import fsync_path
from training._errors import CheckpointNotFoundError, CorruptCheckpointError, _ReplacedError

FORMAT = 2
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.pt"
NO_MODEL_FILE = "NO_MODEL"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_DIR_RE = re.compile(r"^step-(\d{8,})(?:-epoch-(\d+))?$")
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def run_dir_name(run_id: str) -> str:
    """``run_id`` as one safe path component: never a separator, ``..``, or a pointer's name."""
    escaped = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in run_id)
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    for suffix in ("-latest", "-best", ".best_meta.json"):  # what sits beside the runs
        if escaped.endswith(suffix):
            escaped = escaped[: -len(suffix)] + f"%{ord(suffix[0]):02X}" + suffix[1:]
    return escaped


def checkpoint_dir_name(step: int, epoch: int | None) -> str:
    return f"step-{step:08d}" if epoch is None else f"step-{step:08d}-epoch-{epoch}"


def parse_dir_name(name: str) -> tuple[int, int | None] | None:
    match = _DIR_RE.match(name)
    if match is None:
        return None
    return int(match[1]), None if match[2] is None else int(match[2])


#: What tells one file from another at a path: device, inode, size, modification time.
Identity = tuple[int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_digest(path: Path) -> dict[str, Any]:
    return _digest_and_identity(path)[0]


def _digest_and_identity(path: Path) -> tuple[dict[str, Any], Identity | None]:
    """The size and sha256 of the file at ``path``, and the identity of the file hashed;
    None when the path named another file after the hash than before it (replaced
    meanwhile). Identities by path, not fstat: overlayfs answers those two differently."""
    before = identity(os.stat(path))
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    after = identity(os.stat(path))
    return {"size": after[2], "sha256": digest}, after if after == before else None


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint directory on disk, as its manifest describes it."""

    path: Path
    step: int
    metrics: dict[str, float] | None
    #: Unix time of the save.
    time: float
    #: Save order under the run's directory: each save gets one more than the newest before.
    serial: int = field(repr=False)
    #: The consumer epoch (lineage node) that saved it; None without a ledger.
    epoch: int | None = None
    world_size: int = field(default=1, repr=False)
    #: The declared components, None when the run declared none.
    components: tuple[str, ...] | None = field(default=None, repr=False)
    #: The sha256 of manifest.json: what the ledger records.
    digest: str = field(default="", repr=False)
    manifest: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def has_rank_state(self) -> bool:
        return rank_file(0) in self.manifest.get("files", {})


def read_manifest(
    path: Path, *, expected_digest: str | None = None, listed: bool = False
) -> SavedCheckpoint:
    """The checkpoint in directory ``path``; its manifest checked against ``expected_digest``
    (the ledger's record, or with ``listed`` the digest of a ``SavedCheckpoint`` listed
    before: the directory must still hold that save)."""
    file = path / MANIFEST_FILE
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        if not path.is_dir():
            raise CheckpointNotFoundError(
                f"checkpoint directory {str(path)!r} does not exist"
            ) from None
        raise CorruptCheckpointError(f"checkpoint {path} has no {MANIFEST_FILE}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if expected_digest is not None and digest != expected_digest:
        if listed:
            raise CorruptCheckpointError(
                f"{file} changed since this SavedCheckpoint was listed (sha256 {digest[:16]}..., "
                f"listed {expected_digest[:16]}...): the step was saved again, or the files "
                "replaced; list the checkpoints again (saved(), latest(), best())"
            )
        raise CorruptCheckpointError(
            f"{file} does not match the ledger's record (sha256 {digest[:16]}..., recorded "
            f"{expected_digest[:16]}...): this directory holds other bytes than the checkpoint "
            "the ledger recorded; resume from another checkpoint"
        )
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise InvalidArgumentError("not a JSON object")
        _check_self_digest(data, file)
        if data.get("format") != FORMAT:
            raise InvalidArgumentError(f"format {data.get('format')!r}, expected {FORMAT}")
        files = data["files"]
        if not isinstance(files, dict):
            raise InvalidArgumentError("files is not an object")
        components = data.get("components")
        return SavedCheckpoint(
            path=path,
            step=int(data["step"]),
            metrics=data.get("metrics"),
            time=float(data["time"]),
            serial=int(data["serial"]),
            epoch=None if data.get("epoch") is None else int(data["epoch"]),
            world_size=int(data["world_size"]),
            components=None if components is None else tuple(components),
            digest=digest,
            manifest=data,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{file} is unreadable: {exc}") from None


#: The manifest's key for the sha256 of its own JSON without that key.
SELF_DIGEST = "self_sha256"


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """``manifest`` as the bytes of manifest.json, with the sha256 of its own content.

    The ledger records the digest of the whole file; the self digest catches a
    damaged manifest where no ledger is asked (``load(step)``, ``best``, ``saved()``).
    """
    body = {k: v for k, v in manifest.items() if k != SELF_DIGEST}
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    return _canonical({**body, SELF_DIGEST: digest})


def _canonical(data: dict[str, Any]) -> bytes:
    # Floats round-trip through repr, so a parsed manifest serializes to the same bytes.
    return (json.dumps(data, indent=1) + "\n").encode()


def _check_self_digest(data: dict[str, Any], file: Path) -> None:
    recorded = data.pop(SELF_DIGEST, None)
    if recorded is None:
        return  # written before manifests carried one
    actual = hashlib.sha256(_canonical(data)).hexdigest()
    if actual != recorded:
        raise CorruptCheckpointError(
            f"{file} is corrupt: its content does not match its own sha256 (recorded "
            f"{str(recorded)[:16]}..., content {actual[:16]}...): resume from another checkpoint"
        )


def verify_files(saved: SavedCheckpoint, names: list[str] | None = None) -> dict[Path, Identity]:
    """Check ``names`` (default: every file of the manifest) against their sizes and digests;
    the identity of each file checked, by path (a read by path compares it: see
    ``CheckpointManager._read_checked``)."""
    files = saved.manifest["files"]
    checked: dict[Path, Identity] = {}
    for name in files if names is None else names:
        expected = files.get(name)
        if expected is None:
            raise CorruptCheckpointError(f"checkpoint {saved.path} lists no {name}")
        file = saved.path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint {saved.path} is missing {name}")
        actual, checked_as = _digest_and_identity(file)
        if checked_as is None:
            raise _ReplacedError(
                f"{file} was replaced while its digest was checked (the step saved again "
                "meanwhile?); load again"
            )
        checked[file] = checked_as
        if actual != expected:
            raise CorruptCheckpointError(
                f"{file} is corrupt: size {actual['size']}, sha256 {actual['sha256'][:16]}..., "
                f"but the manifest lists size {expected['size']}, sha256 "
                f"{expected['sha256'][:16]}..."
            )
    components = saved.components
    if components is not None and "model" not in components and NO_MODEL_FILE not in files:
        raise CorruptCheckpointError(
            f"checkpoint {saved.path} holds no model and no {NO_MODEL_FILE} marker: a checkpoint "
            "without weights is valid only when its run left the model out on purpose"
        )
    return checked


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` durably: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent, directory=True)


def point(link: Path, target: Path) -> None:
    """Make ``link`` a relative symlink to ``target`` (a pointer file where symlinks fail)."""
    relative = os.path.relpath(target, link.parent)
    tmp = link.with_name(f".{link.name}.{secrets.token_hex(4)}.tmp")
    try:
        os.symlink(relative, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):
        write_atomic(link, (relative + "\n").encode())
        return
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(link.parent, directory=True)


def unpoint(link: Path) -> None:
    if link.is_symlink() or link.is_file():
        link.unlink()
        fsync_path(link.parent, directory=True)
