"""CheckpointManager: durable, atomic checkpoints that the ledger records only once on disk.

Layout under ``root``::

    step-00000008/             a published checkpoint; complete by construction
        state.pt               the state dict (``torch.save``; read with weights_only=True)
        manifest.json          {"step", "metrics", "time", "serial"}
    .tmp-step-00000012-<hex>/  a checkpoint being written
    .trash-<hex>/              a checkpoint on its way out

A save writes into a fresh ``.tmp-*`` directory, fsyncs every file and the
directory, renames it to ``step-XXXXXXXX`` and fsyncs ``root``; only then does
the consumer record the checkpoint in the ledger. A crash at any point leaves
either no checkpoint, or a complete one the ledger may not know about (it is
never resumed from, and a later save of that step replaces it): never a ledger
entry pointing at missing or partial files.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dataflow import Checkpoint, Consumer, ReconcilePlan, StaleEpochError
from dataflow._durable import fsync_path, fsync_tree
from training._config import CheckpointConfig

log = logging.getLogger("training")

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-step-"
_TRASH_PREFIX = ".trash-"


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint directory on disk, as its manifest describes it."""

    path: Path
    step: int
    metrics: dict[str, float] | None
    #: Unix time of the save.
    time: float
    #: Save order under the root: each save gets one more than the newest before it.
    serial: int = field(repr=False)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def _check_metrics(metrics: object) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"metrics must be a dict of name -> number or None, got {type(metrics).__name__}"
        )
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ValueError(f"metric names must be strs, got {name!r}")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {name!r} must be a number, got {value!r}")
        checked[name] = float(value)
    return checked


def _check_current(consumer: Consumer) -> None:
    """Refuse before writing anything when ``consumer`` cannot record a checkpoint."""
    if consumer.epoch is None:
        raise ValueError(
            f"consumer {consumer.consumer_id!r} has not resumed; call resume() before saving"
        )
    # Catch up with the log (the consumer's own writes do this too), so that a fenced-off
    # trainer learns it before it writes over a step directory of the live one.
    state = consumer.state
    state.apply_rows(consumer.ledger.rows(consumer.run_id, after_seq=state.head_seq))
    if state.epoch != consumer.epoch:
        raise StaleEpochError(
            f"{consumer.consumer_id!r} is at epoch {consumer.epoch} of run "
            f"{consumer.run_id!r}, but the run moved to epoch {state.epoch}: a newer trainer "
            "resumed; this one must stop (nothing was saved)"
        )


class CheckpointManager:
    """Saves and loads a trainer's state dict; tells the ledger once the files are durable.

    ``save`` validates, then writes, then calls ``consumer.checkpoint(step, path)``
    when a consumer is attached (``consumer=`` or ``resume``). With several ranks,
    every rank calls ``save``: rank 0 writes the (replicated) state, then all ranks
    meet in the ledger's checkpoint barrier, so rank 0 records the checkpoint only
    after every rank's acks up to ``step`` are in the ledger.

    The public methods do the guarding (validation, atomic publish, ledger
    ordering, retention); the private hooks ``_write(tmp_dir, state)`` and
    ``_read(path)`` only do the I/O, so a subclass can change the file format by
    overriding them. Overriding ``save`` or ``load`` instead would bypass the
    guards: a subclass could record a checkpoint whose files are not durable, or
    load without ``weights_only``.
    """

    def __init__(self, config: CheckpointConfig, *, consumer: Consumer | None = None) -> None:
        if not isinstance(config, CheckpointConfig):
            raise ValueError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        if consumer is not None and not isinstance(consumer, Consumer):
            raise ValueError(f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}")
        self.config = config
        self.root: Path = Path(config.root)
        self.consumer = consumer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # -- public, guarded ------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> Path:
        """Write ``state`` as the checkpoint of optimizer step ``step``; return its directory.

        ``state`` holds state dicts, tensors and Python scalars (what
        ``torch.load(weights_only=True)`` reads back). ``metrics`` (e.g. the eval
        metrics of this step) go into the manifest and rank checkpoints for
        ``best``. With a consumer attached, ``step`` must be later than the
        lineage's last checkpoint; this is checked before anything is written.
        """
        step = _check_step(step)
        if not isinstance(state, Mapping):
            raise ValueError(
                f"state must be a dict (of state dicts, tensors, scalars), "
                f"got {type(state).__name__}"
            )
        checked_metrics = _check_metrics(metrics)
        consumer = self.consumer
        path = self._step_dir(step)
        if consumer is not None:
            _check_current(consumer)
            floor = consumer.state.last_checkpoint_step
            if step <= floor:
                raise ValueError(
                    f"cannot save a checkpoint at step {step}: run {consumer.run_id!r} already "
                    f"has one at step {floor} in this lineage; checkpoint steps must increase"
                )
            if consumer.rank != 0:
                # Rank 0 writes; this rank only meets it in the ledger's barrier.
                consumer.checkpoint(step, str(path))
                return path
        self._publish(step, dict(state), checked_metrics)
        if consumer is not None:
            consumer.checkpoint(step, str(path))
        self._retain()
        return path

    def load(
        self, path_or_step: int | str | os.PathLike[str] | SavedCheckpoint | None = None
    ) -> dict:
        """The state dict of a checkpoint: the latest saved (None), a step, or a directory.

        Reads with ``torch.load(..., weights_only=True)``: tensors, containers and
        scalars only, never arbitrary pickled objects. Tensors load onto the CPU.
        """
        path = self._resolve(path_or_step)
        state = self._read(path)
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
        return state

    def resume(
        self, consumer: Consumer, checkpoint: int | str | Checkpoint | None = "latest"
    ) -> tuple[ReconcilePlan, dict | None]:
        """Resume ``consumer`` and load the state of the checkpoint it resumed from.

        ``checkpoint``: ``"latest"`` (the newest checkpoint of the ledger's current
        lineage, or from scratch), a step, a ``dataflow.Checkpoint``, or None (from
        scratch). Attaches ``consumer``, so later saves are recorded in its run.
        Returns the plan and the state dict (None when resuming from scratch).
        """
        if not isinstance(consumer, Consumer):
            raise ValueError(f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}")
        if not (checkpoint is None or checkpoint == "latest" or isinstance(checkpoint, Checkpoint)):
            _check_step(checkpoint)
        self.consumer = consumer
        plan = consumer.resume(checkpoint)
        if consumer.rank == 0:
            # The new epoch fenced off every older trainer: what they left half-written is garbage.
            self._sweep()
        if plan.checkpoint is None:
            return plan, None
        path = Path(plan.checkpoint.path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"run {consumer.run_id!r} resumed from its checkpoint at step "
                f"{plan.checkpoint.step}, but its directory {path} is gone; resume from "
                "another step, or None to start from scratch"
            )
        return plan, self.load(path)

    def saved(self) -> list[SavedCheckpoint]:
        """Every complete checkpoint under ``root``, oldest save first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            step = path.name.removeprefix(_PREFIX)
            if path.name.startswith(_PREFIX) and step.isdigit() and path.is_dir():
                saved = self._manifest(path)
                if saved is not None:
                    found.append(saved)
        return sorted(found, key=lambda c: (c.serial, c.step))

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
        name = self.config.best_metric
        sign = 1.0 if self.config.best_mode == "max" else -1.0
        ranked = [
            (sign * c.metrics[name], c.serial, c)
            for c in self.saved()
            if c.metrics and math.isfinite(c.metrics.get(name, math.nan))
        ]
        return max(ranked, key=lambda r: r[:2])[2] if ranked else None

    # -- hooks: the file format ---------------------------------------------------
    def _write(self, tmp_dir: Path, state: dict[str, Any]) -> None:
        """Write ``state`` into the fresh directory ``tmp_dir`` (fsync is done by ``save``)."""
        path = tmp_dir / STATE_FILE
        torch.save(state, path)
        # Refuse at save time what weights_only loading would refuse at resume time.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        if unsafe:
            raise ValueError(
                f"the state holds objects that torch.load(weights_only=True) refuses: "
                f"{sorted(unsafe)[:10]}; keep to state dicts, tensors, containers and scalars"
            )

    def _read(self, path: Path) -> Any:
        """The state stored in the checkpoint directory ``path``."""
        file = path / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no {STATE_FILE}")
        return torch.load(file, map_location="cpu", weights_only=True)

    # -- internals ----------------------------------------------------------------
    def _step_dir(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def _resolve(self, which: object) -> Path:
        if which is None:
            latest = self.latest()
            if latest is None:
                raise FileNotFoundError(f"no checkpoint under {self.root}")
            return latest.path
        if isinstance(which, SavedCheckpoint):
            which = which.path
        if isinstance(which, str | os.PathLike):
            path = Path(which)
            if not path.is_dir():
                raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
            return path
        step = _check_step(which)
        path = self._step_dir(step)
        if not path.is_dir():
            steps = [c.step for c in self.saved()]
            raise FileNotFoundError(
                f"no checkpoint at step {step} under {self.root}; saved steps: {steps[-20:]}"
            )
        return path

    def _manifest(self, path: Path) -> SavedCheckpoint | None:
        try:
            data = json.loads((path / MANIFEST_FILE).read_text())
            return SavedCheckpoint(
                path=path,
                step=int(data["step"]),
                metrics=data.get("metrics"),
                time=float(data["time"]),
                serial=int(data["serial"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping checkpoint %s: unreadable manifest (%s)", path, exc)
            return None

    def _publish(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        serial = max((c.serial for c in self.saved()), default=0) + 1
        tmp = self.root / f"{_TMP_PREFIX}{step:08d}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            self._write(tmp, state)
            manifest = {"step": step, "metrics": metrics, "time": time.time(), "serial": serial}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
            fsync_tree(tmp)
            target = self._step_dir(step)
            if target.exists():
                # Not in the current lineage (save checked the step against it): left by
                # a crash before the ledger recorded it, or abandoned by a resume from an
                # older checkpoint. Directories cannot be renamed over, so move it aside.
                log.info("replacing %s, which is not in the current lineage", target)
                self._discard(target)
            os.rename(tmp, target)
            fsync_path(self.root, directory=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _retain(self) -> None:
        k = self.config.keep_latest_k
        if k == 0:
            return
        saved = self.saved()
        keep = {c.path for c in saved[-k:]}
        best = self.best() if self.config.keep_best else None
        if best is not None:
            keep.add(best.path)
        for checkpoint in saved:
            if checkpoint.path not in keep:
                self._discard(checkpoint.path)

    def _discard(self, path: Path) -> None:
        # Renamed away first, so no reader ever sees a half-deleted checkpoint.
        trash = self.root / f"{_TRASH_PREFIX}{secrets.token_hex(4)}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self) -> None:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
