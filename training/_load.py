"""Loading a checkpoint: ``CheckpointManager.resume``, ``load`` and the checks before them."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataflow import (
    Checkpoint,
    Consumer,
    InvalidArgumentError,
    ReconcilePlan,
    UnknownCheckpointError,
)
from training._dist import agree
from training._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    _ReplacedError,
)
from training._layout import (
    MANIFEST_FILE,
    NO_MODEL_FILE,
    STATE_FILE,
    Identity,
    SavedCheckpoint,
    identity,
    rank_file,
    read_manifest,
    verify_files,
)
from training._storable import check_step, without_absent

log = logging.getLogger("training")

Which = int | str | os.PathLike[str] | SavedCheckpoint | Checkpoint | None


class _Loading:
    """``CheckpointManager.resume``, ``load`` and ``load_rank_state`` (a part of the manager)."""

    def resume(
        self,
        consumer: Consumer,
        checkpoint: int | str | Checkpoint | None = "latest",
        *,
        check: Callable[[dict, dict | None], object] | None = None,
        allow_resize: bool = False,
    ) -> tuple[ReconcilePlan, dict | None]:
        """Resume ``consumer`` from ``checkpoint`` and load its state (every rank calls it).

        ``checkpoint``: ``"latest"`` (the newest intact checkpoint of the ledger's
        current lineage, or from scratch when it has none), a step, a
        ``dataflow.Checkpoint``, or None (from scratch). Before the resume event
        is appended, rank 0 checks the directory's manifest against the digest
        the ledger recorded and every file against the manifest, and each other
        rank checks the files it will load: a missing, moved-away or corrupt
        checkpoint fails here and fences off nobody. ``"latest"`` falls back to
        the next older intact checkpoint of the lineage, with a warning.
        ``check(state, rank_state)``, when given, runs on every rank with the
        loaded state and that rank's own state (None when the checkpoint has
        none), also before the resume event: raise there to refuse a checkpoint
        that does not fit this run (the error is raised on every rank).

        A checkpoint holding the state of another number of ranks is refused
        (``IncompatibleCheckpointError``, no fallback with ``"latest"``) unless
        ``allow_resize``: then the ledger re-splits what remains over the
        consumer's ``world_size`` ranks, and rank ``r`` gets the saved state of
        rank ``r`` where the checkpoint has one, else None (in ``check`` too).
        ``resumed_from`` tells the world size the checkpoint was saved with.
        Returns the plan and the state (None from scratch); a rank's own state
        is ``load_rank_state(plan.checkpoint, rank=...)``.
        """
        if check is not None and not callable(check):
            raise InvalidArgumentError(f"check must be callable, got {type(check).__name__}")
        if not isinstance(allow_resize, bool):
            raise InvalidArgumentError(f"allow_resize must be a bool, got {allow_resize!r}")
        if not isinstance(consumer, Consumer):
            raise InvalidArgumentError(
                f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}"
            )
        if not (checkpoint is None or checkpoint == "latest" or isinstance(checkpoint, Checkpoint)):
            check_step(checkpoint)
        self._finish_pending()
        self._attach(consumer)
        rank = consumer.rank
        meeting = self._meeting("resume")
        error, chosen = None, None
        if rank == 0:
            try:
                chosen = self._choose(consumer, checkpoint, allow_resize=allow_resize)
            except Exception as exc:
                error = exc
        chosen = agree(error, chosen, **meeting)[0]
        state = None
        self._resumed_from = None
        try:
            if chosen is not None:
                saved = read_manifest(Path(chosen["path"]), expected_digest=chosen["digest"])
                if rank != 0:
                    self._checked.update(verify_files(saved, self._files_of_rank(saved, rank)))
                state = self._load_state(saved)
                self._resumed_from = saved
                if check is not None:
                    own = None
                    if _holds_rank(saved, rank):
                        own = without_absent(self._read_checked(saved, rank_file(rank)))
                    check(state, own)
        except Exception as exc:
            error = exc
        try:
            agree(error, None, **meeting)
        except BaseException:
            self._resumed_from = None
            raise
        plan = consumer.resume(_checkpoint_by_seq(consumer, chosen) if rank == 0 else checkpoint)
        if rank == 0:
            # The new epoch fenced off every older trainer: what they left is garbage.
            self._sweep(consumer)
        return plan, state

    @property
    def resumed_from(self) -> SavedCheckpoint | None:
        """The checkpoint the last ``resume`` loaded, as its manifest describes it (step,
        ``world_size``, ...); None before a resume, from scratch, or after a refused one.
        Set before ``check`` runs, so a check can compare the saved world size."""
        return self._resumed_from

    def load(self, which: Which = None) -> dict:
        """The state (rank 0's ``state``) of a checkpoint of this run, after checking its files.

        ``which``: None or ``"latest"`` (the most recent save; when corrupt, the next
        older intact one, with a warning), ``"best"``, a step (its most recent save),
        a directory, a ``SavedCheckpoint`` (its directory must still hold the save it was
        listed with: ``CorruptCheckpointError`` once the step was saved again) or a
        ``dataflow.Checkpoint`` (checked against the digest the ledger recorded). Reads
        with ``weights_only=True``, onto the CPU.
        """
        return self._loaded(which, None, self._load_state)

    def load_rank_state(self, which: Which = None, *, rank: int) -> dict:
        """Rank ``rank``'s own state in a checkpoint (``which`` as for ``load``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
        return self._loaded(
            which, rank, lambda saved: without_absent(self._read_checked(saved, rank_file(rank)))
        )

    def _loaded(
        self, which: Which, rank: int | None, read: Callable[[SavedCheckpoint], dict]
    ) -> dict:
        """``read`` of the checkpoint ``which`` names, found and checked again (up to
        ``_LOAD_TRIES`` times) while a save replaces it meanwhile. A ``SavedCheckpoint`` or
        ``dataflow.Checkpoint`` names one save: that one, or an error."""
        tries = 1 if isinstance(which, SavedCheckpoint | Checkpoint) else _LOAD_TRIES
        for _ in range(tries - 1):
            with contextlib.suppress(_ReplacedError):
                return read(self._find(which, rank=rank))
        return read(self._find(which, rank=rank))

    def _choose(
        self, consumer: Consumer, which: object, *, allow_resize: bool
    ) -> dict[str, Any] | None:
        """Rank 0: the recorded checkpoint to resume from, its directory checked."""
        state = consumer.state
        state.apply_rows(consumer.ledger.rows(consumer.run_id, after_seq=state.head_seq))
        removed = state.removed_checkpoints
        if which is None:
            return None
        if which == "latest":
            candidates = [c for c in reversed(state.lineage_checkpoints()) if c.seq not in removed]
            if not candidates:
                return None
        elif isinstance(which, Checkpoint):
            candidates = [which]
        else:
            found = state.checkpoint_for(which)
            if found is None:
                gone = [c for c in state.checkpoints if c.step == which and c.seq in removed]
                steps = sorted({c.step for c in state.checkpoints if c.seq not in removed})
                why = f" (removed: {removed[gone[-1].seq]})" if gone else ""
                raise UnknownCheckpointError(
                    f"run {consumer.run_id!r} has no checkpoint at step {which} to resume "
                    f"from{why}; resumable steps: {steps[-20:]} (None starts from scratch)"
                )
            candidates = [found]
        for c in candidates:
            if c not in state.checkpoints:
                raise UnknownCheckpointError(f"{c} is not recorded in run {consumer.run_id!r}")
            if c.seq in removed:
                raise UnknownCheckpointError(
                    f"the checkpoint at step {c.step} of run {consumer.run_id!r} was removed "
                    f"({removed[c.seq]}); resume from another one"
                )
        errors = []
        for c in candidates:
            try:
                saved = read_manifest(self._locate(c), expected_digest=c.digest)
                self._checked.update(verify_files(saved))
            except CheckpointError as exc:
                if which != "latest":
                    raise
                warnings.warn(
                    f"not resuming from the checkpoint at step {c.step}: {exc}", stacklevel=3
                )
                errors.append(exc)
                continue
            # Not a damaged checkpoint, so no fallback: an older one of the same lineage
            # would silently throw the progress since away.
            self._check_world_size(saved, allow_resize=allow_resize)
            return {"seq": c.seq, "path": str(saved.path), "digest": c.digest}
        gone = all(isinstance(e, CheckpointNotFoundError) for e in errors)
        raise (CheckpointNotFoundError if gone else CorruptCheckpointError)(
            f"no intact checkpoint in the lineage of run {consumer.run_id!r}: "
            + "; ".join(str(e) for e in errors)
        )

    def _check_world_size(self, saved: SavedCheckpoint, *, allow_resize: bool) -> None:
        _, world_size = self._rank()
        if saved.has_rank_state and saved.world_size != world_size and not allow_resize:
            raise IncompatibleCheckpointError(
                f"checkpoint {saved.path} holds the state of {saved.world_size} ranks; this "
                f"run resumes with {world_size}. To re-split the run over {world_size} ranks, "
                "pass allow_resize=True (TrainerConfig(allow_resize=True) for a Trainer; "
                'docs/operations.md, "Resizing a run")'
            )

    def _locate(self, checkpoint: Checkpoint) -> Path:
        """The recorded directory, or one of that name under this root (the root was moved)."""
        recorded = Path(checkpoint.path)
        for path in (recorded, self.run_dir / recorded.name):
            if (path / MANIFEST_FILE).is_file():
                return path
        raise CheckpointNotFoundError(
            f"the checkpoint at step {checkpoint.step} of run {self.run_id!r} was recorded at "
            f"{recorded}, which is gone (also not under {self.run_dir}); resume from another "
            "checkpoint, or None to start from scratch"
        )

    def _find(self, which: object, *, rank: int | None) -> SavedCheckpoint:
        if which is None or which == "latest":
            candidates = list(reversed(self.saved()))
            if not candidates:
                raise CheckpointNotFoundError(
                    f"no checkpoint of run {self.run_id!r} under {self.root}"
                )
            for saved in candidates:
                try:
                    self._checked.update(verify_files(saved, self._files_for(saved, rank)))
                except _ReplacedError:
                    raise
                except CheckpointError as exc:
                    if _manifest_changed(saved):  # saved again since it was listed
                        raise _ReplacedError(str(exc)) from exc
                    warnings.warn(f"skipping checkpoint {saved.path}: {exc}", stacklevel=3)
                    continue
                return saved
            raise CorruptCheckpointError(
                f"no intact checkpoint of run {self.run_id!r} under {self.root}"
            )
        if which == "best":
            saved = self.best()
            if saved is None:
                raise CheckpointNotFoundError(
                    f"no checkpoint of run {self.run_id!r} has the metric "
                    f"{self.config.best_metric!r}"
                )
        elif isinstance(which, SavedCheckpoint):
            saved = read_manifest(which.path, expected_digest=which.digest or None, listed=True)
        elif isinstance(which, Checkpoint):
            saved = read_manifest(self._locate(which), expected_digest=which.digest)
        elif isinstance(which, str | os.PathLike):
            saved = read_manifest(Path(which))
        else:
            step = check_step(which)
            matches = [c for c in self.saved() if c.step == step]
            if not matches:
                steps = [c.step for c in self.saved()]
                raise CheckpointNotFoundError(
                    f"no checkpoint at step {step} of run {self.run_id!r}; saved: {steps[-20:]}"
                )
            saved = matches[-1]
        self._checked.update(verify_files(saved, self._files_for(saved, rank)))
        return saved

    def _files_for(self, saved: SavedCheckpoint, rank: int | None) -> list[str]:
        """The files a load reads: rank 0's state (``rank`` None), or one rank's own file."""
        if rank is None:
            names = [STATE_FILE]
            if NO_MODEL_FILE in saved.manifest["files"]:
                names.append(NO_MODEL_FILE)
            return names
        if not saved.has_rank_state:
            raise CheckpointError(f"checkpoint {saved.path} holds no per-rank state")
        if rank >= saved.world_size:
            raise CheckpointError(
                f"checkpoint {saved.path} holds the state of {saved.world_size} ranks, "
                f"not of rank {rank}"
            )
        return [rank_file(rank)]

    def _files_of_rank(self, saved: SavedCheckpoint, rank: int) -> list[str]:
        """Every file ``rank`` reads on resume: the shared state, and its own when saved."""
        names = self._files_for(saved, None)
        return names + (self._files_for(saved, rank) if _holds_rank(saved, rank) else [])

    def _load_state(self, saved: SavedCheckpoint) -> dict:
        return without_absent(self._read_checked(saved, STATE_FILE))

    @property
    def _checked(self) -> dict[Path, Identity]:
        """The identity of each file whose digest a load in this thread checked, until it
        is read (per thread: loads in other threads check and read files of their own)."""
        checked: dict[Path, Identity] | None = getattr(self._loading, "checked", None)
        if checked is None:
            checked = self._loading.checked = {}
        return checked

    def _read_checked(self, saved: SavedCheckpoint, name: str) -> dict:
        """``_read`` of a file whose digest was just checked, refused unless the file read is
        the file checked (without a ledger, a step saved again replaces its directory)."""
        file = saved.path / name
        checked = self._checked.pop(file, None)
        try:
            state = self._read(file)
            now = identity(os.stat(file))
        except FileNotFoundError:
            raise _ReplacedError(
                f"{file} is gone since its digest was checked: the step was saved again or the "
                "checkpoint removed meanwhile; load again"
            ) from None
        if checked is not None and now != checked:
            raise _ReplacedError(
                f"{file} was replaced after its digest was checked (the step saved again "
                "meanwhile?): what was read may not be what was checked; load again"
            )
        if not isinstance(state, dict):
            raise CorruptCheckpointError(
                f"{saved.path / name} holds a {type(state).__name__}, not a state dict"
            )
        return state


#: Loads that found their checkpoint replaced meanwhile, before one gives up ("load again").
_LOAD_TRIES = 3


def _manifest_changed(saved: SavedCheckpoint) -> bool:
    """Whether ``saved``'s directory holds another save than when it was listed (or none)."""
    try:
        return read_manifest(saved.path).digest != saved.digest
    except CheckpointError:
        return True


def _holds_rank(saved: SavedCheckpoint, rank: int) -> bool:
    """Whether ``saved`` has a file of ``rank``'s own (not after a resize to more ranks)."""
    return saved.has_rank_state and rank < saved.world_size


def _checkpoint_by_seq(consumer: Consumer, chosen: dict[str, Any] | None) -> Checkpoint | None:
    if chosen is None:
        return None
    return next(c for c in consumer.state.checkpoints if c.seq == chosen["seq"])
