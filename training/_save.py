"""Saving a checkpoint: the phases of ``CheckpointManager.save`` (see ``training._checkpoint``)."""

from __future__ import annotations

import errno
import logging
import numbers
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dataflow import Consumer, InvalidArgumentError, PeerFailedError, StaleEpochError
from dataflow.interfaces import fsync_path
from dataflow.live import group_active
from training._config import COMPONENTS
from training._dist import agree
from training._errors import CheckpointError, _PeerCheckpointError
from training._layout import (
    FORMAT,
    MANIFEST_FILE,
    NO_MODEL_FILE,
    STATE_FILE,
    TMP_PREFIX,
    checkpoint_dir_name,
    file_digest,
    manifest_bytes,
    parse_dir_name,
    point,
    rank_file,
    read_manifest,
)
from training._storable import ABSENT, check_step, check_storable

log = logging.getLogger("training")

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def _check_resumed(consumer: Consumer) -> None:
    """Every rank: refuse before the first meeting a consumer that cannot record a checkpoint
    (its ``checkpoint`` would refuse on this rank alone, leaving the peers in its meeting)."""
    if consumer.epoch is None:
        raise InvalidArgumentError(
            f"consumer {consumer.consumer_id!r} has not resumed; call resume() before saving"
        )


def _check_current(consumer: Consumer) -> None:
    """Rank 0: refuse before writing anything when the run moved on (a newer trainer)."""
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


def _background_failed(job: dict[str, Any], error: BaseException) -> CheckpointError:
    """What every rank raises for a background save that failed (``error`` its cause)."""
    failed = CheckpointError(f"the background save at step {job['step']} failed: {error}")
    failed.__cause__ = error
    return failed


def _stage(value: Any) -> Any:
    """A copy whose tensors live in CPU memory of their own (for a background write)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _stage(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_stage(v) for v in value)
    return value


class _Saving:
    """``CheckpointManager.save`` and its phases (a part of the manager, not used alone)."""

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
            step = check_step(step)
            state = _check_state("state", state)
            rank_state = None if rank_state is None else _check_state("rank_state", rank_state)
            check_storable(state, "state")
            if rank_state is not None:
                check_storable(rank_state, "rank_state")
            checked_metrics = _check_metrics(metrics)
            self._check_components(state, rank_state)
            if self.consumer is not None:
                _check_resumed(self.consumer)
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
        self._record(job, *self._write_and_publish(job, group=None))
        return job["final"]

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
            digest, unpublished = self._write_and_publish(job, group=self._async_group)
        except BaseException as exc:  # surfaces on the caller's thread at the next call
            self._pending_result["error"] = exc
            return
        self._pending_result["digest"] = digest
        if unpublished is not None:
            self._pending_result["unpublished"] = _background_failed(job, unpublished)

    def _finish_pending(self) -> None:
        thread, self._pending = self._pending, None
        if thread is None:
            return
        thread.join()
        result, self._pending_result = self._pending_result, {}
        if "error" in result:  # a meeting raised it on every rank
            raise _background_failed(result["job"], result["error"])
        self._record(result["job"], result["digest"], result.get("unpublished"))

    def _write_and_publish(
        self, job: dict[str, Any], *, group: Any
    ) -> tuple[str | None, Exception | None]:
        """Phases 2 and 3: every rank's files (one meeting: rank 0 gathers their digests), then
        rank 0's manifest and rename. Returns the manifest's digest (rank 0) and rank 0's
        publish error, which ``_record`` makes every rank's at its next meeting."""
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
        if rank != 0:
            return None, None
        try:
            return self._publish(job, every_rank, world_size), None
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, _disk_full(exc, job["step"], tmp) or exc

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

    def _record(self, job: dict[str, Any], digest: str | None, error: Exception | None) -> None:
        """Phase 4: the ledger record, then rank 0's pointers, best record and retention; one
        meeting of the manager's own, the last (see docs/training.md, "Collectives").

        ``error`` is rank 0's publish error: it reaches the peers in the consumer's first
        meeting (raised by the ``before_checkpoint`` callback ``_raise_unpublished``), or,
        without a consumer, in the last meeting; either way nothing is recorded."""
        rank, _ = self._rank()
        final: Path = job["final"]
        if self.consumer is not None:
            self._unpublished = error
            try:
                # Fails on every rank or on none (it meets the other ranks twice).
                self.consumer.record_checkpoint(job["step"], str(final), digest=digest)
            except PeerFailedError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise _PeerCheckpointError(str(exc)) from exc
            finally:
                self._unpublished = None
        if rank == 0 and error is None:
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
        agree(error, None, **self._meeting(f"checkpoint save at step {job['step']}"))

    def _raise_unpublished(self) -> None:
        """The consumer's ``before_checkpoint`` callback: rank 0's publish error, raised in
        the consumer's first meeting, so that no meeting of the manager's own is needed."""
        error, self._unpublished = self._unpublished, None
        if error is not None:
            raise error
