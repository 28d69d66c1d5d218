"""CheckpointManager: per-rank, digest-checked checkpoints that the ledger records once durable.

The manager is this facade and three parts: ``training._save`` (``save`` and its
phases), ``training._load`` (``resume``, ``load`` and their checks) and
``training._retention`` (retention, rewind and the sweep). A save meets every rank
five times (``dataflow.live.agree``; docs/training.md, "Collectives of a save"), so
an error on any rank is raised on all of them:

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

import logging
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dataflow import Consumer, InvalidArgumentError
from training._best import BestRecord
from training._config import CheckpointConfig
from training._dist import agree
from training._errors import CheckpointError
from training._layout import SavedCheckpoint, parse_dir_name, read_manifest, run_dir_name
from training._load import _Loading
from training._retention import _Retention
from training._save import _check_metrics, _Saving

log = logging.getLogger("training")


class CheckpointManager(_Saving, _Loading, _Retention):
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
        #: Rank 0's publish error, for the consumer's meeting (``_raise_unpublished``).
        self._unpublished: Exception | None = None
        self._hooked: Consumer | None = None  # the consumer _raise_unpublished is hooked to
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
        if self._hooked is not consumer:
            consumer.before_checkpoint(self._raise_unpublished)
            self._hooked = consumer
        self._best  # noqa: B018 (reads the best record now: its warnings belong here)
