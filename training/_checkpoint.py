"""CheckpointManager: per-rank, digest-checked checkpoints that the ledger records once durable.

A save is four meetings of every rank (see ``training._dist.agree``), so an
error on any rank is raised on all of them:

1. validate; rank 0 checks the ledger (fenced? step after the lineage's last?)
   and creates a fresh ``.tmp-*`` directory;
2. every rank writes and fsyncs its files (rank 0 ``state.pt``, each rank its
   ``rank-XXXXX.pt``) and reports their sizes and sha256 digests;
3. rank 0 writes ``manifest.json`` listing them, fsyncs, renames the directory
   to its final, lineage-unique name and fsyncs the parent;
4. the consumer records the checkpoint with the manifest's digest; then rank 0
   moves the pointers, the best record, and applies retention and rewind,
   recording every removal in the ledger before deleting.

A crash at any point leaves the previous checkpoints and either nothing new,
or a complete directory the ledger may not know (never resumed from, swept at
the next resume). ``resume`` checks the manifest against the ledger's digest
and every file against the manifest before the resume event is appended.
The layout is described in ``training._layout``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import numbers
import os
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dataflow import (
    Checkpoint,
    Consumer,
    InvalidArgumentError,
    ReconcilePlan,
    StaleEpochError,
    UnknownCheckpointError,
)
from dataflow.interfaces._durable import fsync_path
from dataflow.live._collectives import group_active
from training._best import BestRecord
from training._config import COMPONENTS, CheckpointConfig
from training._dist import agree
from training._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    _ReplacedError,
)
from training._layout import (
    FORMAT,
    MANIFEST_FILE,
    NO_MODEL_FILE,
    STATE_FILE,
    TMP_PREFIX,
    TRASH_PREFIX,
    Identity,
    SavedCheckpoint,
    checkpoint_dir_name,
    file_digest,
    identity,
    manifest_bytes,
    parse_dir_name,
    point,
    rank_file,
    read_manifest,
    run_dir_name,
    verify_files,
)
from training._storable import check_storable

log = logging.getLogger("training")

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

#: What an absent (None) entry is stored as, so every save writes the same entries.
ABSENT = {"__dataflow_training__": "absent"}
_MAX_STEP = 2**63 - 1  # the ledger's step column is a 64-bit integer
Which = int | str | os.PathLike[str] | SavedCheckpoint | Checkpoint | None


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidArgumentError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    if step > _MAX_STEP:
        raise InvalidArgumentError(f"step must fit in 64 bits (<= 2**63 - 1), got {step}")
    return step


def _check_metrics(metrics: object) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"metrics must be a dict of name -> number or None, got {type(metrics).__name__}"
        )
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"metric names must be strs, got {name!r}")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidArgumentError(f"metric {name!r} must be a number, got {value!r}")
        try:
            checked[name] = float(value)
        except OverflowError:
            raise InvalidArgumentError(
                f"metric {name!r} is too large for a float: {value!r:.40}"
            ) from None
    return checked


def _check_state(name: str, state: object) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"{name} must be a dict (of state dicts, tensors, scalars), got {type(state).__name__}"
        )
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise InvalidArgumentError(f"the keys of {name} must be strs, got {bad[:5]}")
    return dict(state)


def _check_current(consumer: Consumer) -> None:
    """Refuse before writing anything when ``consumer`` cannot record a checkpoint."""
    if consumer.epoch is None:
        raise InvalidArgumentError(
            f"consumer {consumer.consumer_id!r} has not resumed; call resume() before saving"
        )
    # Catch up with the log, so that a fenced-off trainer learns it before it writes.
    state = consumer.state
    state.apply_rows(consumer.ledger.rows(consumer.run_id, after_seq=state.head_seq))
    if state.epoch != consumer.epoch:
        raise StaleEpochError(
            f"{consumer.consumer_id!r} is at epoch {consumer.epoch} of run "
            f"{consumer.run_id!r}, but the run moved to epoch {state.epoch}: a newer trainer "
            "resumed; this one must stop (nothing was saved)"
        )


def _disk_full(exc: BaseException, step: int, where: Path) -> Exception | None:
    """A CheckpointError saying the disk is full, when ENOSPC (or EDQUOT) caused ``exc``.

    torch.save reports a failed write as a RuntimeError whose context holds the OSError.
    """
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            return CheckpointError(
                f"cannot save the checkpoint of step {step}: the disk is full writing "
                f"{cause.filename or where} ({cause.strerror}); nothing was published and the "
                f"earlier checkpoints are intact: free space under {where.parent} (a smaller "
                "keep_latest_k keeps fewer checkpoints) and save again"
            )
        cause = cause.__cause__ or cause.__context__
    return None


def _stage(value: Any) -> Any:
    """A copy whose tensors live in CPU memory of their own (for a background write)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _stage(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_stage(v) for v in value)
    return value


def _decode(state: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, dict) and v == ABSENT else v for k, v in state.items()}


class CheckpointManager:
    """Saves and loads a run's checkpoints; tells the ledger once every rank's files are durable.

    Every rank calls ``save``, ``resume``, ``is_best`` and ``wait`` together.
    The public methods do the guarding (validation, agreement between ranks,
    digests, atomic publish, ledger ordering, retention); the private hooks
    ``_write(file, obj)`` and ``_read(file)`` only do the I/O of one file, so
    a subclass can change the file format by overriding them.
    """

    def __init__(self, config: CheckpointConfig, *, consumer: Consumer | None = None) -> None:
        if not isinstance(config, CheckpointConfig):
            raise InvalidArgumentError(
                f"config must be a CheckpointConfig, got {type(config).__name__}"
            )
        self.config = config
        self.root: Path = Path(config.root)
        self.consumer: Consumer | None = None
        self.run_id: str | None = config.run_id
        self._known_entries: dict[str, frozenset[str]] | None = None
        self._best_record: BestRecord | None = None
        self._pending: threading.Thread | None = None
        self._pending_result: dict[str, Any] = {}
        self._async_group: Any = None
        self._resumed_from: SavedCheckpoint | None = None
        self._loading = threading.local()  # what a load of this thread checked
        if consumer is not None:
            self._attach(consumer)
        elif self.run_id is not None:
            self._best  # noqa: B018 (reads the best record now: its warnings belong here)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, run_id={self.run_id!r})"

    # -- where -------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """``{root}/{run_id}``: this run's checkpoints."""
        if self.run_id is None:
            raise InvalidArgumentError(
                "CheckpointConfig.run_id is None and no consumer is attached: pass "
                "CheckpointConfig(run_id=...) or a consumer"
            )
        return self.root / run_dir_name(self.run_id)

    def _pointer(self, name: str) -> Path:
        return self.root / f"{self.run_dir.name}-{name}"

    # -- public, guarded ----------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        rank_state: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> Path:
        """Write the checkpoint of optimizer step ``step`` on every rank; return its directory.

        Rank 0's ``state`` (the replicated state: model, optimizer, ...) goes into
        ``state.pt``; each rank's ``rank_state`` (its optimizer shard, RNG, data
        position) into its own ``rank-XXXXX.pt``. Values are state dicts, tensors
        and Python scalars (what ``torch.load(weights_only=True)`` reads back); a
        None entry is stored as a typed "absent" marker and loads as None. The
        checkpoint is published once every rank's files are durable, then the
        ledger records it with the manifest's digest. With a consumer, ``step``
        must be later than the lineage's last checkpoint; this is checked before
        anything is written. With ``async_save`` the files are written in the
        background and this returns at once; the ledger records the checkpoint
        at the next call (or ``wait()``), where a background error is raised.
        """
        self._finish_pending()
        rank, world_size = self._rank()
        error: Exception | None = None
        started: dict[str, Any] | None = None
        try:
            step = _check_step(step)
            state = _check_state("state", state)
            rank_state = None if rank_state is None else _check_state("rank_state", rank_state)
            check_storable(state, "state")
            if rank_state is not None:
                check_storable(rank_state, "rank_state")
            checked_metrics = _check_metrics(metrics)
            self._check_components(state, rank_state)
            if world_size > 1 and not group_active(world_size):
                raise InvalidArgumentError(
                    f"saving with world_size={world_size} needs torch.distributed initialized"
                )
            if rank == 0:
                started = self._start(step)
        except Exception as exc:
            error = exc
        try:
            started = agree(error, started, **self._meeting(f"checkpoint save at step {step}"))[0]
        except BaseException:
            if started is not None:  # another rank refused: rank 0's directory goes again
                shutil.rmtree(started["tmp"], ignore_errors=True)
            raise
        assert started is not None
        entries = self._entries(state, rank_state)
        state = {k: ABSENT if state.get(k) is None else state[k] for k in entries["state"]}
        if rank_state is not None:
            rank_state = {
                k: ABSENT if rank_state.get(k) is None else rank_state[k] for k in entries["rank"]
            }
        job = {
            "step": step,
            "tmp": Path(started["tmp"]),
            "final": Path(started["final"]),
            "serial": started["serial"],
            "metrics": checked_metrics,
            "entries": {k: sorted(v) for k, v in entries.items()},
        }
        if self.config.async_save:
            if group_active(world_size) and self._async_group is None:
                self._async_group = dist.new_group(backend="gloo")
            job["state"] = _stage(state) if rank == 0 else None
            job["rank_state"] = None if rank_state is None else _stage(rank_state)
            self._pending_result = {"job": job}
            self._pending = threading.Thread(
                target=self._background, args=(job,), name="checkpoint-save", daemon=True
            )
            self._pending.start()
            return job["final"]
        job["state"] = state if rank == 0 else None
        job["rank_state"] = rank_state
        digest = self._write_and_publish(job, group=None)
        self._record(job, digest)
        return job["final"]

    def wait(self) -> None:
        """Block until a background save is durable and recorded (every rank calls it);
        raise its error, if it failed. A no-op without a save in flight."""
        self._finish_pending()

    def close(self) -> None:
        """``wait()``; call it before the process exits, or the last async save is not recorded."""
        self._finish_pending()

    def is_best(self, metrics: Mapping[str, float] | None) -> bool:
        """Whether ``metrics`` beat every checkpoint saved so far (every rank calls it:
        rank 0 decides and the others take its verdict). Empty metrics never do."""
        rank, _ = self._rank()
        verdict, error = False, None
        if rank == 0:
            try:
                verdict = self._beats_best(_check_metrics(metrics), strict=True)
            except Exception as exc:
                error = exc
        return bool(agree(error, verdict, **self._meeting("best-checkpoint decision"))[0])

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
            _check_step(checkpoint)
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
                        own = _decode(self._read_checked(saved, rank_file(rank)))
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
            which, rank, lambda saved: _decode(self._read_checked(saved, rank_file(rank)))
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

    def saved(self) -> list[SavedCheckpoint]:
        """Every published checkpoint of this run, oldest save first (files not yet checked).

        A directory whose manifest is of another run, or of another step or epoch than its
        name says (copied or renamed in by hand), is skipped with a warning, so ``load``
        and ``latest`` never return it.
        """
        run_dir = self.run_dir
        if not run_dir.is_dir():
            return []
        found = []
        for path in run_dir.iterdir():
            parsed = parse_dir_name(path.name)
            if parsed is None or not path.is_dir():
                continue
            try:
                saved = read_manifest(path)
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            why = self._foreign(saved, *parsed)
            if why is not None:
                # A directory copied or renamed in by hand: loading it would hand this run
                # another run's (or another step's) weights without a word.
                warnings.warn(f"skipping checkpoint {path}: {why}", stacklevel=2)
                continue
            found.append(saved)
        return sorted(found, key=lambda c: (c.serial, c.step))

    def _foreign(self, saved: SavedCheckpoint, step: int, epoch: int | None) -> str | None:
        """Why the manifest in ``saved.path`` is not this run's checkpoint of that name."""
        run_id = saved.manifest.get("run_id")
        if run_id != self.run_id:
            return (
                f"its manifest belongs to run {run_id!r}, not {self.run_id!r}; move it back "
                "to its own run's directory"
            )
        if saved.step != step:
            return (
                f"its manifest is of step {saved.step}, but the directory is named for step "
                f"{step}; it was renamed or copied in by hand"
            )
        if epoch is not None and saved.epoch != epoch:
            return (
                f"its manifest is of epoch {saved.epoch}, but the directory is named for "
                f"epoch {epoch}; it was renamed or copied in by hand"
            )
        return None

    def latest(self) -> SavedCheckpoint | None:
        """The most recently saved checkpoint (not the highest step: after a resume from an
        older checkpoint, the new saves are the latest), or None."""
        saved = self.saved()
        return saved[-1] if saved else None

    def best(self) -> SavedCheckpoint | None:
        """The checkpoint with the best ``best_metric``; None when none has it.

        Checkpoints saved without metrics, with an empty dict (an eval that saw
        nothing), without ``best_metric`` or with a non-finite value never win.
        Ties go to the latest save.
        """
        return self._best_of(self.saved())

    def _best_of(self, saved: list[SavedCheckpoint]) -> SavedCheckpoint | None:
        ranked = [(self._best.score(c.metrics), c.serial, c) for c in saved]
        ranked = [r for r in ranked if r[0] is not None]
        return max(ranked, key=lambda r: r[:2])[2] if ranked else None

    # -- hooks: the file format -----------------------------------------------------------
    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        """Write ``obj`` to the new file ``file`` (fsync and digests are done by ``save``)."""
        # Through a Python file, so that a failed write (ENOSPC) keeps its errno: torch.save
        # to a path reports only "file write failed".
        with open(file, "wb") as f:
            torch.save(obj, f)
        # Refuse at save time what weights_only loading would refuse at resume time.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        if unsafe:
            raise InvalidArgumentError(
                f"the state holds objects that torch.load(weights_only=True) refuses: "
                f"{sorted(unsafe)[:10]}; keep to state dicts, tensors, containers and scalars"
            )

    def _read(self, file: Path) -> Any:
        """What ``_write`` wrote to ``file``."""
        return torch.load(file, map_location="cpu", weights_only=True)

    # -- save internals -----------------------------------------------------------------
    def _rank(self) -> tuple[int, int]:
        if self.consumer is not None:
            return self.consumer.rank, self.consumer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _meeting(self, what: str, group: Any = None) -> dict[str, Any]:
        rank, world_size = self._rank()
        return {"world_size": world_size, "rank": rank, "what": what, "group": group}

    def _check_components(self, state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        declared = self.config.components
        if declared is None:
            return
        keys = set(state) | set(rank_state or ())
        missing = [c for c in declared if c not in keys]
        if missing:
            raise InvalidArgumentError(
                f"components {missing} are declared in CheckpointConfig.components but missing "
                f"from state and rank_state (keys: {sorted(keys)}); pass them, or set them to "
                "None when absent"
            )
        undeclared = sorted(k for k in keys & set(COMPONENTS) if k not in declared)
        if undeclared:
            raise InvalidArgumentError(
                f"state holds {undeclared}, which CheckpointConfig.components={declared} "
                "leaves out; declare them, or drop them from the state"
            )

    def _entries(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None
    ) -> dict[str, frozenset[str]]:
        """This save's entries: its keys plus every entry an earlier save of the run had."""
        if self._known_entries is None:
            latest = self.latest()
            known = latest.manifest.get("entries", {}) if latest is not None else {}
            self._known_entries = {
                "state": frozenset(known.get("state", ())),
                "rank": frozenset(known.get("rank", ())),
            }
        entries = {
            "state": self._known_entries["state"] | frozenset(state),
            "rank": self._known_entries["rank"] | frozenset(rank_state or ()),
        }
        self._known_entries = entries
        return entries

    def _start(self, step: int) -> dict[str, Any]:
        """Rank 0: check the ledger, make the temporary directory, name the final one."""
        consumer = self.consumer
        epoch = None
        if consumer is not None:
            _check_current(consumer)
            floor = consumer.state.last_checkpoint_step
            if step <= floor:
                raise InvalidArgumentError(
                    f"cannot save a checkpoint at step {step}: run {consumer.run_id!r} already "
                    f"has one at step {floor} in this lineage; checkpoint steps must increase"
                )
            epoch = consumer.epoch
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        serial = max((c.serial for c in self.saved()), default=0) + 1
        name = checkpoint_dir_name(step, epoch)
        tmp = run_dir / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return {"tmp": str(tmp), "final": str(run_dir / name), "serial": serial}

    def _background(self, job: dict[str, Any]) -> None:
        try:
            self._pending_result["digest"] = self._write_and_publish(job, group=self._async_group)
        except BaseException as exc:  # surfaces on the caller's thread at the next call
            self._pending_result["error"] = exc

    def _finish_pending(self) -> None:
        thread, self._pending = self._pending, None
        if thread is None:
            return
        thread.join()
        result, self._pending_result = self._pending_result, {}
        if "error" in result:
            raise CheckpointError(
                f"the background save at step {result['job']['step']} failed: {result['error']}"
            ) from result["error"]
        self._record(result["job"], result["digest"])

    def _write_and_publish(self, job: dict[str, Any], *, group: Any) -> str:
        """Phases 2 and 3: every rank's files, then rank 0's manifest and rename."""
        rank, world_size = self._rank()
        tmp: Path = job["tmp"]
        meeting = self._meeting(f"checkpoint save at step {job['step']}", group)
        error, files = None, {}
        try:
            files = self._write_files(job, rank)
        except Exception as exc:
            error = _disk_full(exc, job["step"], tmp) or exc
        try:
            every_rank = agree(error, files, **meeting)
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        error, digest = None, ""
        if rank == 0:
            try:
                digest = self._publish(job, every_rank, world_size)
            except Exception as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                error = _disk_full(exc, job["step"], tmp) or exc
        return str(agree(error, digest, **meeting)[0])

    def _write_files(self, job: dict[str, Any], rank: int) -> dict[str, Any]:
        tmp: Path = job["tmp"]
        written = []
        if rank == 0:
            self._write(tmp / STATE_FILE, job["state"])
            written.append(STATE_FILE)
            components = self.config.components
            if components is not None and "model" not in components:
                (tmp / NO_MODEL_FILE).write_text(
                    "This checkpoint holds no model on purpose: CheckpointConfig.components "
                    f"= {list(components)}; the weights are kept elsewhere.\n"
                )
                written.append(NO_MODEL_FILE)
        if job["rank_state"] is not None:
            self._write(tmp / rank_file(rank), job["rank_state"])
            written.append(rank_file(rank))
        files = {}
        for name in written:
            fsync_path(tmp / name)
            files[name] = file_digest(tmp / name)
        return files

    def _publish(self, job: dict[str, Any], every_rank: list[Any], world_size: int) -> str:
        tmp: Path = job["tmp"]
        final: Path = job["final"]
        files: dict[str, Any] = {}
        for part in every_rank:
            files.update(part)
        with_rank_state = [rank_file(r) in files for r in range(world_size)]
        if any(with_rank_state) and not all(with_rank_state):
            missing = [r for r, has in enumerate(with_rank_state) if not has]
            raise InvalidArgumentError(
                f"ranks {missing} passed no rank_state while others did: every rank passes "
                "one, or none does"
            )
        components = self.config.components
        manifest = {
            "format": FORMAT,
            "run_id": self.run_id,
            "step": job["step"],
            "epoch": parse_dir_name(final.name)[1],  # type: ignore[index]
            "time": time.time(),
            "serial": job["serial"],
            "world_size": world_size,
            "components": None if components is None else list(components),
            "entries": job["entries"],
            "metrics": job["metrics"],
            "files": dict(sorted(files.items())),
        }
        raw = manifest_bytes(manifest)
        with open(tmp / MANIFEST_FILE, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp, directory=True)
        if final.exists():
            # Only without a ledger (a name with the epoch is never reused): the same
            # step saved again. Directories cannot be renamed over, so move it aside.
            log.info("replacing %s", final)
            self._discard(final)
        os.rename(tmp, final)
        fsync_path(final.parent, directory=True)
        return read_manifest(final).digest

    def _record(self, job: dict[str, Any], digest: str) -> None:
        """Phase 4: the ledger record, then rank 0's pointers, best record and retention."""
        rank, _ = self._rank()
        final: Path = job["final"]
        meeting = self._meeting(f"checkpoint save at step {job['step']}")
        error = None
        try:
            if self.consumer is not None:
                self.consumer.checkpoint(job["step"], str(final), digest=digest)
        except Exception as exc:
            error = exc
        agree(error, None, **meeting)
        if rank == 0:
            try:
                point(self._pointer("latest"), final)
                if self._best.path == final:
                    # The same step saved again (no ledger): the record scored the files
                    # this save replaced, so the manifests decide afresh.
                    self._best.set(self.best())
                elif self._beats_best(job["metrics"], strict=False):
                    self._best.set(read_manifest(final))
                self._retain(final, job["step"])
            except Exception as exc:
                error = exc
        agree(error, None, **meeting)

    # -- best -----------------------------------------------------------------------------
    @property
    def _best(self) -> BestRecord:
        if self._best_record is None or self._best_record.run_id != self.run_id:
            self._best_record = BestRecord(
                root=self.root,
                name=self.run_dir.name,  # raises without a run id
                run_id=self.run_id,  # type: ignore[arg-type]
                metric=self.config.best_metric,
                mode=self.config.best_mode,
            )
        return self._best_record

    def _beats_best(self, metrics: Mapping[str, float] | None, *, strict: bool) -> bool:
        return self._best.beats(metrics, scan=self.best, strict=strict)

    # -- retention and rewind ----------------------------------------------------------
    def _retain(self, just_written: Path, step: int) -> None:
        saved = self.saved()
        doomed: dict[Path, str] = {}
        consumer = self.consumer
        if consumer is not None:
            lineage = {Path(c.path).name for c in consumer.state.lineage_checkpoints()}
            for c in saved:
                # Only checkpoints of some lineage (named with their epoch) are rewound:
                # one saved without a ledger belongs to none, so retention alone decides.
                abandoned = c.epoch is not None and c.path.name not in lineage
                if c.step >= step and c.path != just_written and abandoned:
                    doomed[c.path] = "rewind"
        k = self.config.keep_latest_k
        if k:
            survivors = [c for c in saved if c.path not in doomed]
            keep = {c.path for c in survivors[-k:]} | {just_written}
            best = self._best_of(saved) if self.config.keep_best else None
            if best is not None and best.path not in doomed:
                keep.add(best.path)
            doomed.update({c.path: "retention" for c in survivors if c.path not in keep})
        if not doomed:
            return
        self._remove(doomed)
        best_path = self._best.path
        if best_path is None or best_path in doomed:
            self._best.set(self._best_of([c for c in saved if c.path not in doomed]))

    def _remove(self, doomed: dict[Path, str]) -> None:
        consumer = self.consumer
        if consumer is not None:
            recorded = {Path(c.path).name: c for c in consumer.state.checkpoints}
            for reason in sorted(set(doomed.values())):
                names = [p.name for p, why in doomed.items() if why == reason]
                known = [recorded[n] for n in names if n in recorded]
                if known:
                    # In the ledger before the files go: a crash in between leaves files
                    # nobody resumes from (swept later), never a record of missing files.
                    consumer.remove_checkpoints(known, reason=reason)
        for path in doomed:
            log.info("removing checkpoint %s (%s)", path, doomed[path])
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Renamed away first, so no reader ever sees a half-deleted checkpoint.
        trash = path.parent / f"{TRASH_PREFIX}{secrets.token_hex(4)}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self, consumer: Consumer) -> None:
        """Rank 0 after a resume: drop temporary and trash directories, and directories of
        older epochs the ledger never recorded or recorded as removed.

        Garbage collection, so it never fails the resume: the other ranks have returned
        from theirs already. What it cannot remove is logged, and the next resume tries
        again."""
        run_dir = self.run_dir
        if not run_dir.is_dir():
            return
        state = consumer.state
        recorded = {
            Path(c.path).name for c in state.checkpoints if c.seq not in state.removed_checkpoints
        }
        try:
            entries = list(run_dir.iterdir())
        except OSError as exc:
            log.warning("could not list %s (%s); the next resume sweeps it", run_dir, exc)
            return
        for path in entries:
            if path.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                continue
            parsed = parse_dir_name(path.name)
            stale = parsed is not None and parsed[1] is not None and parsed[1] < state.epoch
            if stale and path.name not in recorded:
                log.info("removing %s: no checkpoint the ledger can resume from", path)
                try:
                    self._discard(path)
                except OSError as exc:
                    log.warning("could not remove %s (%s); the next resume tries again", path, exc)

    # -- load internals -------------------------------------------------------------------
    def _attach(self, consumer: Consumer) -> None:
        if not isinstance(consumer, Consumer):
            raise InvalidArgumentError(
                f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}"
            )
        if self.consumer is not None and self.consumer.run_id != consumer.run_id:
            raise InvalidArgumentError(
                f"this manager is attached to run {self.consumer.run_id!r}, not {consumer.run_id!r}"
            )
        if self.run_id is not None and self.run_id != consumer.run_id:
            raise InvalidArgumentError(
                f"CheckpointConfig.run_id={self.run_id!r} but the consumer is in run "
                f"{consumer.run_id!r}: leave run_id out to take the consumer's"
            )
        self.consumer = consumer
        self.run_id = consumer.run_id
        self._best  # noqa: B018 (reads the best record now: its warnings belong here)

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
            step = _check_step(which)
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
        return _decode(self._read_checked(saved, STATE_FILE))

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
