"""The configs of the training components: keyword-only, frozen, validated on creation."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path

from dataflow import InvalidArgumentError

BEST_MODES = ("max", "min")
#: What a checkpoint may hold, by name (``CheckpointConfig.components``).
COMPONENTS = ("model", "optimizer", "scheduler", "rng", "data", "trainer")


def _names(field: str, value: object) -> tuple[object, ...]:
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{field} must be a collection of names, got {type(value).__name__} {value!r:.100}"
        ) from None


def _int_field(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints go, how many stay, and which one is best."""

    root: str | os.PathLike[str]
    """Directory holding every run's checkpoints (``{root}/{run_id}/...``); created on first
    save. Kept as an absolute ``Path``: the ledger records absolute checkpoint paths."""

    run_id: str | None = None
    """The run whose checkpoints these are: ``{root}/{run_id}/`` holds them, and runs sharing
    a root never see each other's. ``None``: the attached consumer's run (required then)."""

    keep_latest_k: int = 0
    """Keep the ``k`` most recently saved checkpoints (plus the best); 0 keeps all."""

    best_metric: str = "eval/simulated_acc_len"
    """The manifest metric that ranks checkpoints for ``CheckpointManager.best``."""

    best_mode: str = "max"
    """``"max"``: the highest ``best_metric`` is best; ``"min"``: the lowest (for a loss)."""

    keep_best: bool = True
    """Retention never deletes the best checkpoint (when False, only the latest is protected)."""

    components: tuple[str, ...] | None = None
    """What every checkpoint of the run holds, a subset of ``COMPONENTS``; each must be a
    key of ``state`` or ``rank_state`` at every save. Leaving ``"model"`` out writes a
    ``NO_MODEL`` marker (the weights live elsewhere). ``None``: not checked."""

    async_save: bool = False
    """Stage the state in memory and write it in a background thread; the ledger records
    the checkpoint once it is durable (at the next save, ``wait()`` or ``close()``)."""

    def __post_init__(self) -> None:
        if isinstance(self.root, os.PathLike):
            object.__setattr__(self, "root", os.fspath(self.root))
        if not isinstance(self.root, str) or not self.root.strip():
            raise InvalidArgumentError(f"root must be a non-empty path, got {self.root!r}")
        if not self.root.isprintable():
            bad = next(c for c in self.root if not c.isprintable())
            raise InvalidArgumentError(
                f"root {self.root!r} holds the control character {bad!r}; pass a plain path"
            )
        # abspath also folds '..' away: the ledger refuses a checkpoint path with one,
        # which it would find out only after the files were written.
        object.__setattr__(self, "root", Path(os.path.abspath(os.path.expanduser(self.root))))
        if self.run_id is not None and (
            not isinstance(self.run_id, str) or not 0 < len(self.run_id) <= 256
        ):
            raise InvalidArgumentError(
                f"run_id must be a non-empty str of at most 256 characters or None, "
                f"got {self.run_id!r}"
            )
        _int_field("keep_latest_k", self.keep_latest_k, minimum=0)
        if not isinstance(self.best_metric, str) or not self.best_metric:
            raise InvalidArgumentError(
                f"best_metric must be a non-empty str, got {self.best_metric!r}"
            )
        if self.best_mode not in BEST_MODES:
            raise InvalidArgumentError(
                f"best_mode must be one of {BEST_MODES}, got {self.best_mode!r}"
            )
        if not isinstance(self.keep_best, bool):
            raise InvalidArgumentError(f"keep_best must be a bool, got {self.keep_best!r}")
        if self.components is not None:
            if isinstance(self.components, str):
                raise InvalidArgumentError(
                    f"components must be a collection of names, got the str {self.components!r}"
                )
            names = _names("components", self.components)
            unknown = [n for n in names if n not in COMPONENTS]
            if unknown or not names or len(set(names)) != len(names):
                raise InvalidArgumentError(
                    f"components must be distinct names out of {COMPONENTS}, got {names!r}"
                    + (f" (unknown: {unknown})" if unknown else "")
                )
            object.__setattr__(self, "components", names)
        if not isinstance(self.async_save, bool):
            raise InvalidArgumentError(f"async_save must be a bool, got {self.async_save!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How a FeatureLoader leases and reads batches."""

    batch_size: int = 8
    """Refs per batch. Every batch is full but the last one of the data (and one that
    lost a sample whose features were gone, or one handed out after ``batch_wait_s``)."""

    batch_wait_s: float | None = 60.0
    """In arrival order (a stream, or producers still committing), seconds a batch that
    has some refs but not ``batch_size`` waits for the rest, counted from its first ref.
    When it passes, the loader hands out the short batch, with a warning the first time
    (a stream's window must hold what a rank keeps unacked, see docs/training.md); the
    end of the data (every producer closed) hands out the last short batch at once.
    ``None`` waits for a full batch or the end of the data; 0 hands out whatever is ready
    (batches as short as the producers are slow). A seeded order leases from the whole
    committed dataset, so its batches are full but the last without waiting."""

    lease_timeout: float | None = None
    """Seconds to wait for refs to arrive. ``None`` waits until some come or the run is
    finished; when a number runs out first, the loader stops early, with a warning (or,
    when some refs came, hands them out as a short batch)."""

    names: tuple[str, ...] | None = None
    """Features to read from the store; ``None`` reads every feature of a ref."""

    prefetch: int = 0
    """N >= 1: lease the next N batches in a background thread, in one ledger write,
    and read their features while the current batch trains; the loader's acks are
    written in that thread too, those of up to N steps in one transaction (see
    ``FeatureLoader``). 0: lease, read and ack on the caller's thread, when asked."""

    unavailable_timeout: float = 120.0
    """Seconds a sample's read may go on failing with ``StoreUnavailableError`` (the store's
    server unreachable, or the machine whose memory holds the sample just died) before the
    loader raises it; until then it reads again, with a logged warning. A dead machine's
    samples turn stale once the store's server drops it (Mooncake: after the master's
    client TTL, about 10 s): they are then reported lost and regenerated, and the run goes
    on. 0 raises at once."""

    ledger_timeout: float = 120.0
    """Seconds a lease, an ack or a lost report may go on failing with ``OperationalError``
    (the ledger's server unreachable or restarting, its write lock held past
    ``busy_timeout``, a COMMIT whose outcome is unknown) before the loader raises it;
    until then it makes the same call again, with a logged warning, which is also how
    the ledger settles a call in doubt (docs/reliability.md). Other errors
    (``StaleEpochError``, bad input) are raised at once. 0 raises at once; ``math.inf``
    waits for the ledger however long it takes."""

    pin_memory: bool = False
    """Read batches into page-locked (pinned) host memory, so that the step's copy to
    the GPU, ``tensor.to("cuda", non_blocking=True)``, runs alongside the step's work, as
    with ``torch.utils.data.DataLoader(pin_memory=True)``. Stacked features are read
    straight into pinned batch tensors; a ``collate_fn``'s tensors are pinned after it
    returns (in the prefetch thread, with ``prefetch``). On a machine without an
    accelerator it pins nothing and warns once, as PyTorch's DataLoader does, so that
    one script runs on both."""

    def __post_init__(self) -> None:
        _int_field("batch_size", self.batch_size, minimum=1)
        timeout = self.lease_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0
        ):
            raise InvalidArgumentError(
                f"lease_timeout must be a number >= 0 or None, got {timeout!r}"
            )
        wait = self.batch_wait_s
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf
        ):
            raise InvalidArgumentError(
                f"batch_wait_s must be a finite number of seconds >= 0 or None (wait for a "
                f"full batch), got {wait!r}"
            )
        if self.names is not None:
            if isinstance(self.names, str):
                raise InvalidArgumentError(
                    f"names must be a collection of feature names, got the str {self.names!r}"
                )
            names = _names("names", self.names)
            bad = [n for n in names if not isinstance(n, str) or not n]
            if bad or not names:
                raise InvalidArgumentError(f"names must hold non-empty strs, got {self.names!r}")
            object.__setattr__(self, "names", names)
        _int_field("prefetch", self.prefetch, minimum=0)
        for name in ("unavailable_timeout", "ledger_timeout"):
            patience = getattr(self, name)
            if (
                isinstance(patience, bool)
                or not isinstance(patience, int | float)
                or not patience >= 0
            ):
                raise InvalidArgumentError(
                    f"{name} must be a number of seconds >= 0, got {patience!r}"
                )
        if not isinstance(self.pin_memory, bool):
            raise InvalidArgumentError(f"pin_memory must be a bool, got {self.pin_memory!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The cadences of a Trainer's loop, in optimizer steps."""

    max_steps: int | None = None
    """Stop after this optimizer step (counted across resumes); ``None``: train until the
    run is finished."""

    grad_accum: int = 1
    """Micro-batches per optimizer step; their refs are acked together at that step."""

    checkpoint_every: int = 0
    """Save a checkpoint every this many optimizer steps; 0: only the final one."""

    eval_every: int = 0
    """Evaluate every this many optimizer steps (and before the final checkpoint); 0: never."""

    allow_resize: bool = False
    """Resume a checkpoint saved by another number of ranks: the ledger re-splits what
    remains over this run's ranks, and each rank's own state is mapped as described in
    docs/operations.md ("Resizing a run"). False refuses such a checkpoint before the
    resume event."""

    def __post_init__(self) -> None:
        if self.max_steps is not None:
            _int_field("max_steps", self.max_steps, minimum=1)
        _int_field("grad_accum", self.grad_accum, minimum=1)
        _int_field("checkpoint_every", self.checkpoint_every, minimum=0)
        _int_field("eval_every", self.eval_every, minimum=0)
        if not isinstance(self.allow_resize, bool):
            raise InvalidArgumentError(f"allow_resize must be a bool, got {self.allow_resize!r}")
        if self.checkpoint_every and self.eval_every and self.checkpoint_every % self.eval_every:
            warnings.warn(
                f"checkpoint_every={self.checkpoint_every} is not a multiple of "
                f"eval_every={self.eval_every}: checkpoints saved between evals carry no "
                "metrics, so they can never be the best",
                stacklevel=3,
            )
