"""The Consumer's checkpoint records: a durable checkpoint in the ledger, and its removal.

The Consumer saves no files: the trainer makes a checkpoint's files durable,
then :meth:`Consumer.record_checkpoint` records them in the ledger (releasing
what they hold trained, per ``release_policy``), and a resume starts from a
recorded one. :meth:`Consumer.remove_checkpoints` records that a checkpoint's
files are going, so no resume picks it again.
"""

from __future__ import annotations

import os
import re
import types
import warnings
import weakref
from collections.abc import Callable, Iterable

from dataflow.live._collectives import agree, group_active
from dataflow.live._consumer_args import _check_int, _check_step
from dataflow.live._consumer_writes import _FencedWrites, _locked
from dataflow.model._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidCheckpointPathError,
    LedgerStateError,
    UnknownCheckpointError,
)
from dataflow.model._events import Kind, dump_payload
from dataflow.model._fold import Checkpoint
from dataflow.recorder._ledger import NewEvent

#: ``scheme://...``: a checkpoint on remote storage, which the ledger cannot look at.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _checkpoint_path(path: object) -> str:
    """``path`` as a str, refused when it cannot name a checkpoint (checked on every rank)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidCheckpointPathError(
            f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}"
        )
    if not path.isprintable():
        bad = next(c for c in path if not c.isprintable())
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r} holds the control character {bad!r}; pass the path "
            "the checkpoint's files were written to"
        )
    if _URI.match(path):
        if path.lower().startswith("file:"):
            raise InvalidCheckpointPathError(
                f"checkpoint path {path!r} is a file:// URI; pass the local path instead"
            )
        return path
    if ".." in path.replace("\\", "/").split("/"):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r} has a '..' part, so it may name a place other than it "
            "seems (through symbolic links); pass the checkpoint's path without '..', "
            "absolute or relative to the working directory"
        )
    return path


def _existing_checkpoint(path: str) -> str:
    """A local checkpoint path as it is recorded: existing, a file or directory, absolute."""
    if _URI.match(path):
        return path  # remote storage: recorded as given
    absolute = os.path.abspath(path)
    where = "" if absolute == path else f" (resolved to {absolute})"
    if not os.path.exists(absolute):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r}{where} does not exist; make the checkpoint's files "
            "durable first, then record it (name a checkpoint on remote storage by its "
            "URI, e.g. s3://bucket/step-100)"
        )
    if not (os.path.isfile(absolute) or os.path.isdir(absolute)):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r}{where} is neither a file nor a directory"
        )
    return absolute


class _CheckpointRecords(_FencedWrites):
    """Recording checkpoints (every rank meets; rank 0 appends), their removal, and the
    snapshots of the fold written at them."""

    #: before_checkpoint callbacks, each behind a function that returns it (None once a
    #: bound method's object is gone).
    _before_checkpoint: list[Callable[[], Callable[[], object] | None]]
    _snapshot_every: int | None = 50_000

    @property
    def snapshot_every(self) -> int | None:
        """Rank 0 stores a snapshot of its fold at a checkpoint once this many events
        came since the last one (None: never); a restart then folds only the tail."""
        return self._snapshot_every

    @snapshot_every.setter
    def snapshot_every(self, every: int | None) -> None:
        if every is not None:
            _check_int("snapshot_every", every, minimum=1)
        self._snapshot_every = every

    def before_checkpoint(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` at the start of every :meth:`record_checkpoint` of this
        consumer, before the ranks meet; an error it raises is raised by that
        ``record_checkpoint``, which then records nothing.

        For acks written behind the training loop: a ``FeatureLoader`` with ``prefetch``
        registers its ``flush``, so the acks it still holds are in the ledger before a
        checkpoint records what was trained, whoever records it. A bound
        method is held weakly (it stops being called once its object is gone).
        """
        if not callable(callback):
            raise ArgumentTypeError(
                f"before_checkpoint takes a callable, got {type(callback).__name__}"
            )
        held: Callable[[], Callable[[], object] | None] = (
            weakref.WeakMethod(callback)
            if isinstance(callback, types.MethodType)
            else lambda: callback
        )
        with self._lock:
            self._before_checkpoint.append(held)

    def record_checkpoint(
        self, step: int, path: str | os.PathLike[str], *, digest: str | None = None
    ) -> Checkpoint | None:
        """Record in the ledger a durable checkpoint at ``step``; release features per the
        policy. It saves nothing: the checkpoint's files are the trainer's to write.

        Call it after the checkpoint files are durable. Every rank calls it:
        the :meth:`before_checkpoint` callbacks run first, then with
        torch.distributed initialized the ranks meet, so rank 0 appends only
        once every rank's acks up to ``step`` are in the ledger, and meet again
        once it has. It fails on every rank or on none: the rank where it
        failed (a callback, or rank 0's write) raises that error, and the
        others raise :class:`PeerFailedError` rather than wait in a collective;
        then nothing is recorded, or (rank 0's write failing after it landed)
        the ledger says whether it was.
        ``digest`` (e.g. the sha256 of the checkpoint's manifest) is recorded
        so a resume can check it loads exactly these bytes. Returns the
        Checkpoint on rank 0, None elsewhere.

        ``path``: the checkpoint's file or directory. A local path must exist
        (rank 0 checks it) and must not have a ``..`` part; it is recorded as
        an absolute path, so a resume from another working directory finds
        it. A URI (``s3://bucket/step-100``) names a checkpoint on remote
        storage and is recorded as given. ``step`` counts optimizer steps
        (0: before the first) and must be above the lineage's newest
        checkpoint step.
        """
        _check_step("checkpoint", step, minimum=0)
        path = _checkpoint_path(path)
        if digest is not None and (not isinstance(digest, str) or not digest):
            raise InvalidArgumentError(
                f"checkpoint digest must be a non-empty str or None, got {digest!r}"
            )
        self._fencing_epoch()
        # Outside the lock: a loader's flush waits for its thread, which may be waiting
        # for this lock to lease.
        with self._lock:
            live = [(get, callback) for get in self._before_checkpoint if (callback := get())]
            self._before_checkpoint = [get for get, _ in live]
        error: Exception | None = None
        try:
            for _, callback in live:
                callback()
        except Exception as exc:
            error = exc
        return self._agree_on_checkpoint(step, path, digest, error)

    def checkpoint(
        self, step: int, path: str | os.PathLike[str], *, digest: str | None = None
    ) -> Checkpoint | None:
        """Deprecated alias of :meth:`record_checkpoint` (it records, it saves nothing)."""
        warnings.warn(
            "Consumer.checkpoint() is deprecated: call Consumer.record_checkpoint(), "
            "which records a checkpoint in the ledger (it saves nothing)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.record_checkpoint(step, path, digest=digest)

    @_locked
    def _agree_on_checkpoint(
        self, step: int, path: str, digest: str | None, error: Exception | None
    ) -> Checkpoint | None:
        """Every rank: meet (raising everywhere if ``error`` is on any rank), rank 0 appends,
        meet again (raising everywhere if that failed)."""
        distributed = group_active(self.world_size)
        what = f"checkpoint at step {step} of run {self.run_id!r}"
        if distributed:
            agree(error, what=what)
        elif error is not None:
            raise error
        recorded = None
        if self.rank == 0:
            try:
                recorded = self._append_checkpoint(step, path, digest)
            except Exception as exc:
                error = exc
        if distributed:
            agree(error, what=what)
        elif error is not None:
            raise error
        return recorded

    def _append_checkpoint(self, step: int, path: str, digest: str | None) -> Checkpoint:
        with self._write("checkpoint") as tx:
            floor = self.state.last_checkpoint_step
            if step <= floor:
                raise LedgerStateError(
                    f"checkpoint at step {step} in run {self.run_id!r}, but this lineage already "
                    f"has one at step {floor}: checkpoint steps must increase"
                )
            path = _existing_checkpoint(path)
            tx.append(
                [
                    NewEvent(
                        Kind.CHECKPOINT,
                        self.consumer_id,
                        epoch=tx.epoch,
                        step=step,
                        payload=dump_payload(
                            {"path": path} if digest is None else {"path": path, "digest": digest}
                        ),
                    )
                ]
            )
            self._sync(tx)
            release = (
                self.state.releasable_at(step) if self.release_policy == "on_checkpoint" else []
            )
            tx.append(self._release_events(release))
            self._sync(tx)
        self._delete_features(release)
        self._view.save_snapshot(self.snapshot_every)
        return self.state.checkpoints[-1]

    @_locked
    def remove_checkpoints(self, checkpoints: Iterable[Checkpoint], *, reason: str) -> None:
        """Record that these checkpoints' files are being deleted (rank 0, before deleting).

        Once recorded, a checkpoint is never chosen by ``resume`` again and a
        resume naming it fails before anything is written; ``replay`` lists it
        under ``removed_checkpoints``. Already removed ones are skipped.
        """
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError(f"reason must be a non-empty str, got {reason!r}")
        if self.rank != 0:
            raise LedgerStateError("only rank 0 records removed checkpoints")
        checkpoints = list(checkpoints)
        for c in checkpoints:
            if not isinstance(c, Checkpoint):
                raise InvalidArgumentError(f"expected dataflow.Checkpoint objects, got {c!r}")
        with self._write("checkpoint removal") as tx:
            events = []
            for c in checkpoints:
                if c not in self.state.checkpoints:
                    raise UnknownCheckpointError(f"{c} is not recorded in run {self.run_id!r}")
                if c.seq in self.state.removed_checkpoints:
                    continue
                payload = {"checkpoint_seq": c.seq, "step": c.step, "reason": reason}
                events.append(
                    NewEvent(
                        Kind.CHECKPOINT_REMOVED,
                        self.consumer_id,
                        epoch=tx.epoch,
                        step=c.step,
                        payload=dump_payload(payload),
                    )
                )
            tx.append(events)
            self._sync(tx)
