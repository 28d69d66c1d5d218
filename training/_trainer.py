"""Trainer: the resume -> lease -> step -> ack -> eval -> checkpoint loop of a custom trainer."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dataflow import Checkpoint, Consumer, InvalidArgumentError, ReconcilePlan
from dataflow.live import reduce_max
from eval import Evaluator
from training._checkpoint import CheckpointManager
from training._config import LoaderConfig, TrainerConfig
from training._loader import Batch, CollateFn, FeatureLoader
from training._resuming import (
    DATA_ENTRY,
    REGENERATE_PRODUCER_ID,
    RNG_ENTRY,
    TRAINER_ENTRY,
    RegenerateFn,
    _derived_seed,
    _Resuming,
    _seed_generators,
)
from training._rng import rng_state, set_rng_state
from training._step import StepHelper

log = logging.getLogger("training")

__all__ = ["REGENERATE_PRODUCER_ID", "Trainer", "_derived_seed", "_seed_generators"]


#: A zero-argument function returning the per-batch eval output dicts, or a
#: ``(model_fn, batches)`` pair for ``Evaluator.evaluate``.
EvalFn = Callable[[], Iterable[Mapping[str, Any]]] | tuple[Callable[[Any], Mapping[str, Any]], Any]


def _check_callable(name: str, fn: object, *, optional: bool = False) -> None:
    if (fn is not None or not optional) and not callable(fn):
        raise InvalidArgumentError(f"{name} must be callable, got {type(fn).__name__}")


def _check_eval_fn(eval_fn: object) -> None:
    if eval_fn is None or callable(eval_fn):
        return
    if isinstance(eval_fn, tuple) and len(eval_fn) == 2 and callable(eval_fn[0]):
        batches = eval_fn[1]
        if isinstance(batches, Iterator):
            raise InvalidArgumentError(
                "the batches of eval_fn=(model_fn, batches) are an iterator, which the first "
                "eval would exhaust; pass a list, or a function returning the batches"
            )
        if callable(batches) or isinstance(batches, Iterable):
            return
    raise InvalidArgumentError(
        "eval_fn must be a function returning the per-batch eval output dicts, or a "
        f"(model_fn, batches) pair; got {eval_fn!r:.80}"
    )


class Trainer(_Resuming):
    """Runs the loop of a custom trainer over a Consumer's run; the model stays yours.

    ``run()`` resumes (unless ``resume`` was called), then per micro-batch calls
    ``step_fn(batch)`` (forward and backward; its return value, e.g. the loss, is
    kept as ``last_loss``). Every ``grad_accum`` micro-batches it calls
    ``optimizer_fn(step)`` (optimizer step, zero_grad, scheduler) and acks the refs
    of all those micro-batches at that step, in one transaction (``StepHelper``).
    The loader's batches are full (``LoaderConfig.batch_size``, waiting up to
    ``batch_wait_s`` for a stream's slow producers) but the last, so a step trains
    ``grad_accum * batch_size`` samples per rank but at the end of the data; a
    stream producer lost for a while (a network blip) is logged, and training goes
    on (``FeatureLoader``). In a step,
    the micro-batches before the last of a step run under ``no_sync()`` of each of
    ``modules`` (DDP, FSDP), so gradients are reduced once per step. To know the
    boundary before backward, the next micro-batch is leased before the current
    one runs. Then, on their cadences, it evaluates and saves ``state_fn()`` (and
    each rank's ``rank_state_fn()``) through the CheckpointManager, which records
    the checkpoint in the ledger once every rank's files are durable. An eval
    whose metrics beat every checkpoint so far saves off the cadence too. When
    the run is finished (or ``max_steps`` is reached) it saves a final checkpoint
    if a step was taken since the last one. With ``grad_accum=1``, ``step_fn`` may
    do the optimizer step itself and ``optimizer_fn`` may be omitted.

    Steps continue from the checkpoint resumed from, so every ack names a step
    later than it, as the ledger requires. Every checkpoint also records the
    trainer's set-up, and each rank's random generators and data position; a
    resume restores the generators and refuses, before the resume event, a
    checkpoint of a differently set-up run (or, with ``model``, of a model with
    other keys). ``TrainerConfig(allow_resize=True)`` lets it resume a checkpoint
    of another number of ranks: the ledger re-splits what remains.

    Several ranks (``Consumer(rank=r, world_size=n)``) need torch.distributed
    initialized: the ranks agree how many micro-batches they take, so they take the
    same steps, evaluate and checkpoint together, and stop together. While a rank's
    share can still grow (a stream with producers running), they agree before each
    micro-batch whether any of them still has one; once every share is fixed (a
    committed dataset, or the end of the stream), one collective settles the number
    of micro-batches left and no more are needed. A rank whose share ran out while
    its peers still train gets an empty Batch (``len(batch) == 0``), so a
    ``step_fn`` that joins collectives (DDP) can contribute nothing instead of
    hanging its peers.
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        step_fn: Callable[[Batch], Any],
        checkpoints: CheckpointManager,
        state_fn: Callable[[], Mapping[str, Any]],
        optimizer_fn: Callable[[int], object] | None = None,
        load_fn: Callable[[dict], object] | None = None,
        rank_state_fn: Callable[[], Mapping[str, Any]] | None = None,
        load_rank_fn: Callable[[dict | None], object] | None = None,
        regenerate_fn: RegenerateFn | None = None,
        evaluator: Evaluator | None = None,
        eval_fn: EvalFn | None = None,
        config: TrainerConfig | None = None,
        loader_config: LoaderConfig | None = None,
        collate_fn: CollateFn | None = None,
        modules: Iterable[torch.nn.Module] = (),
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(consumer, Consumer):
            raise InvalidArgumentError(
                f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}"
            )
        if not isinstance(checkpoints, CheckpointManager):
            raise InvalidArgumentError(
                f"checkpoints must be a CheckpointManager, got {type(checkpoints).__name__}"
            )
        if checkpoints.consumer is not None and checkpoints.consumer is not consumer:
            raise InvalidArgumentError(
                "checkpoints is attached to another consumer than this trainer's"
            )
        config = TrainerConfig() if config is None else config
        if not isinstance(config, TrainerConfig):
            raise InvalidArgumentError(
                f"config must be a TrainerConfig, got {type(config).__name__}"
            )
        _check_callable("step_fn", step_fn)
        _check_callable("state_fn", state_fn)
        _check_callable("optimizer_fn", optimizer_fn, optional=True)
        _check_callable("load_fn", load_fn, optional=True)
        _check_callable("rank_state_fn", rank_state_fn, optional=True)
        _check_callable("load_rank_fn", load_rank_fn, optional=True)
        _check_callable("regenerate_fn", regenerate_fn, optional=True)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if (rank_state_fn is None) != (load_rank_fn is None):
            raise InvalidArgumentError(
                "rank_state_fn and load_rank_fn come together: what one saves, the other loads"
            )
        if config.grad_accum > 1 and optimizer_fn is None:
            raise InvalidArgumentError(
                f"grad_accum={config.grad_accum} needs an optimizer_fn: step_fn cannot tell "
                "which micro-batch ends an optimizer step"
            )
        if evaluator is not None and not isinstance(evaluator, Evaluator):
            raise InvalidArgumentError(
                f"evaluator must be an eval.Evaluator, got {type(evaluator).__name__}"
            )
        if evaluator is not None and eval_fn is None:
            raise InvalidArgumentError("an evaluator needs an eval_fn producing what it evaluates")
        _check_eval_fn(eval_fn)
        if eval_fn is not None and config.eval_every == 0:
            warnings.warn("eval_fn is set but eval_every=0: evaluation never runs", stacklevel=2)
        if eval_fn is None and config.eval_every:
            warnings.warn(
                f"eval_every={config.eval_every} but no eval_fn: evaluation is skipped",
                stacklevel=2,
            )
        self.consumer = consumer
        self.checkpoints = checkpoints
        self.config = config
        self.step_fn = step_fn
        self.state_fn = state_fn
        self.optimizer_fn = optimizer_fn
        self.load_fn = load_fn
        self.rank_state_fn = rank_state_fn
        self.load_rank_fn = load_rank_fn
        self.regenerate_fn = regenerate_fn
        #: The (unwrapped) model whose keys a checkpoint's "model" entry must match.
        self.model = model
        self.evaluator = evaluator if evaluator is not None or eval_fn is None else Evaluator()
        self.eval_fn = eval_fn
        self.loader = FeatureLoader(
            consumer, config=loader_config, collate_fn=collate_fn, on_lost=self._on_lost
        )
        #: Accumulates micro-batches: no_sync() for ``modules`` off the boundary, one ack.
        self.helper = StepHelper(
            consumer, grad_accum=config.grad_accum, modules=modules, ack=self.loader.ack
        )
        #: The last optimizer step taken (or resumed from).
        self.step = 0
        #: The ReconcilePlan of the last resume (``resume()`` returns the state), None
        #: before it: ``plan.checkpoint`` resumed from, ``plan.regenerate`` to put back.
        self.plan: ReconcilePlan | None = None
        #: The metrics of the last eval, and the step it ran at.
        self.metrics: dict[str, float] | None = None
        self.metrics_step: int | None = None
        #: What step_fn returned for the last micro-batch.
        self.last_loss: Any = None
        #: Samples this rank trained (acked) in this lineage: its position in its queue
        #: (counted from the resize when the lineage was resized: a new queue starts there).
        self.position = 0
        #: Collectives the ranks ran to agree on who still has data (one, once every
        #: rank's share is fixed: a committed dataset needs no more than that; the one
        #: asking whether work came back once that count ran out is not counted).
        self.agreements = 0
        self._batches_left: int | None = None
        self._saved_step = 0
        self._resumed_position = 0
        self._resumed_rank_state: dict | None = None
        #: Set by a resize: this rank's state is new (no old rank of its number), and the
        #: seed of its fresh generators when the checkpoint holds generators.
        self._new_rank = False
        self._fresh_seed: int | None = None

    def resume(self, checkpoint: int | str | Checkpoint | None = "latest") -> dict | None:
        """Resume the consumer from ``checkpoint`` and return the state to apply (None from
        scratch); ``load_fn``, when given, is called with it, and ``load_rank_fn`` with this
        rank's own state. Steps continue from there.

        The resume's ``ReconcilePlan`` is kept as :attr:`plan` (not returned: the state is
        what a caller applies): ``trainer.plan.checkpoint`` is the checkpoint resumed from
        (None from scratch), ``trainer.plan.regenerate`` the samples a producer must put
        back when there is no ``regenerate_fn``.

        With ``TrainerConfig(allow_resize=True)``, a checkpoint of another number of ranks
        resumes too; rank ``r`` then takes old rank ``r``'s generators and state, and a
        rank the old run did not have gets fresh generators and ``load_rank_fn(None)``
        (docs/operations.md, "Resizing a run")."""
        self._resumed_position = 0
        self._resumed_rank_state = None
        self._new_rank, self._fresh_seed = False, None
        # Resumed again in this process (a run() raised): nothing read ahead, and no
        # micro-batch of an unfinished step, may cross into the new epoch.
        self.loader._restart()
        self.helper._restart()
        plan, state = self.checkpoints.resume(
            self.consumer,
            checkpoint,
            check=self._check_resumable,
            allow_resize=self.config.allow_resize,
        )
        self.plan = plan
        self.step = self._saved_step = plan.checkpoint.step if plan.checkpoint else 0
        self.position = self._resumed_position
        if state is not None and self.load_fn is not None:
            self.load_fn(state)
        rank_state = self._resumed_rank_state
        saved_rng = (rank_state or {}).get(RNG_ENTRY)
        if isinstance(saved_rng, dict) and {"python", "torch"} <= saved_rng.keys():
            set_rng_state(saved_rng)
        elif self._fresh_seed is not None:
            _seed_generators(self._fresh_seed)
        if (rank_state is not None or self._new_rank) and self.load_rank_fn is not None:
            self.load_rank_fn(rank_state)
        if plan.regenerate and self.regenerate_fn is not None:
            self._regenerate(list(plan.regenerate))
        elif plan.regenerate:
            warnings.warn(
                f"{len(plan.regenerate)} samples of run {self.consumer.run_id!r} must be "
                "trained again but their features were released: a producer must "
                "regenerate them (Producer.regenerate) before the run can finish",
                stacklevel=2,
            )
        return state

    def run(self) -> int:
        """Train until the run is finished for every rank, or ``max_steps``; return the step."""
        distributed = self._distributed()
        if self.plan is None:
            state = self.resume()
            if state is not None and self.load_fn is None:
                raise InvalidArgumentError(
                    f"resumed from the checkpoint at step {self.step}, but there is no load_fn "
                    "to apply its state: pass load_fn, or call resume() and apply what it "
                    "returns before run()"
                )
        self._batches_left = None  # what came back since a previous run() is counted anew
        max_steps = self.config.max_steps
        if max_steps is not None and self.step >= max_steps:
            warnings.warn(
                f"resumed at step {self.step}, max_steps={max_steps}: nothing to train",
                stacklevel=2,
            )
        try:
            done = max_steps is not None and self.step >= max_steps
            batch = None if done else self._next_batch(distributed)
            while batch is not None:
                # The boundary is known before backward: the grad_accum-th micro-batch, or
                # the last one (the next is leased first; at max_steps, none is leased).
                final = max_steps is not None and self.step + 1 >= max_steps
                ends_run = self.helper.is_boundary() and final
                upcoming = None if ends_run else self._next_batch(distributed)
                with self.helper.micro_step(batch, last=upcoming is None) as boundary:
                    self.last_loss = self.step_fn(batch)
                if boundary:
                    self._optimizer_step()
                batch = upcoming
                if batch is None and self._work_came_back(distributed):
                    batch = self._next_batch(distributed)
            self.loader.flush()
            if self._batches_left == 0 and not self.consumer.finished:
                # Work came back that no rank can lease yet (a sample waiting for a
                # producer to regenerate it); it waits for the next run or resume.
                log.warning(
                    "rank %d of run %r stops with work left that no rank can lease yet "
                    "(waiting for regeneration); the next run() or resume trains it",
                    self.consumer.rank,
                    self.consumer.run_id,
                )
            if self.step > self._saved_step:
                if self._eval_enabled and self.metrics_step != self.step:
                    self._evaluate()
                self._save()
            self.checkpoints.wait()
        finally:
            self.loader.close()
        return self.step

    def evaluate(self) -> dict[str, float]:
        """Run the eval now (every rank must call it together); return and keep the metrics."""
        if self.eval_fn is None or self.evaluator is None:
            raise InvalidArgumentError("this trainer has no eval_fn")
        if isinstance(self.eval_fn, tuple):
            model_fn, batches = self.eval_fn
            metrics = self.evaluator.evaluate(model_fn, batches() if callable(batches) else batches)
        else:
            metrics = self.evaluator.run(self.eval_fn())
        self.metrics, self.metrics_step = metrics, self.step
        return metrics

    # -- internals ----------------------------------------------------------------
    @property
    def _eval_enabled(self) -> bool:
        return self.eval_fn is not None and self.config.eval_every > 0

    def _distributed(self) -> bool:
        if self.consumer.world_size == 1:
            return False
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                f"a Trainer with world_size={self.consumer.world_size} needs torch.distributed "
                "initialized: the ranks agree on steps and checkpoints through it"
            )
        return True

    def _next_batch(self, distributed: bool) -> Batch | None:
        """The next micro-batch, the same count on every rank (an empty Batch where a rank's
        share ran out first), None once no rank has one left.

        While a rank's share can still grow (producers open, a regeneration outstanding),
        the ranks agree before each micro-batch whether any of them has one. Once every
        share is fixed, one agreement settles how many micro-batches are left, and the
        ranks take them without another collective.
        """
        if not distributed:
            return self.loader.next_batch()
        if self._batches_left is not None:
            if self._batches_left == 0:
                return None
            self._batches_left -= 1
            return self.loader.next_batch() or Batch()
        batch = self.loader.next_batch()
        remaining = self.loader.remaining_batches()
        has = int(batch is not None)
        any_has, any_open, most = reduce_max([has, int(remaining is None), has + (remaining or 0)])
        self.agreements += 1
        if not any_open:
            self._batches_left = max(most - 1, 0)
            if most == 0:
                return None
        elif not any_has:
            return None
        return Batch() if batch is None else batch

    def _work_came_back(self, distributed: bool) -> bool:
        """Once the ranks' settled count of micro-batches ran out: whether work came back
        meanwhile (a lost sample regenerated, a nack) that a rank can lease now. Every
        rank reaches this together and they agree; the count is settled anew."""
        if not distributed or self._batches_left != 0:
            return False
        max_steps = self.config.max_steps
        if max_steps is not None and self.step >= max_steps:
            return False
        self.loader.flush()
        # None: this rank's share is not fixed (a rank's regeneration is still open), so
        # work may be left, e.g. a regenerated sample already leased ahead; agreeing on
        # "nothing left" then would end run() with that batch leased and never trained.
        remaining = self.loader.remaining_batches(fresh=True)
        # Not counted in self.agreements.
        [left] = reduce_max([int(remaining is None or remaining > 0)])
        if not left:
            return False
        self._batches_left = None
        return True

    def _optimizer_step(self) -> None:
        self.step += 1
        if self.optimizer_fn is not None:
            self.optimizer_fn(self.step)
        self.position += len(self.helper.finish(self.step))
        save = bool(self.config.checkpoint_every) and self.step % self.config.checkpoint_every == 0
        if self._eval_enabled and self.step % self.config.eval_every == 0:
            self._evaluate()
            # Every rank asks, rank 0 decides: a new best is saved even off the cadence.
            save = save or self.checkpoints.is_best(self.metrics)
        if save:
            self._save()

    def _evaluate(self) -> None:
        metrics = self.evaluate()
        if not metrics:
            log.warning("eval at step %d saw no batch: no metrics", self.step)

    def _save(self) -> None:
        self.loader.flush()  # the checkpoint records what was acked up to this step
        # Only metrics of this very step describe the state being saved.
        metrics = self.metrics if self.metrics_step == self.step else None
        rank_state = {} if self.rank_state_fn is None else dict(self.rank_state_fn())
        state = dict(self.state_fn())
        components = self.checkpoints.config.components
        if TRAINER_ENTRY not in state and (components is None or TRAINER_ENTRY in components):
            state[TRAINER_ENTRY] = self._setup()
        if RNG_ENTRY not in rank_state and (components is None or RNG_ENTRY in components):
            rank_state[RNG_ENTRY] = rng_state()
        if DATA_ENTRY not in rank_state and (components is None or DATA_ENTRY in components):
            # The loader's state, at the position trained: the loader hands out the next
            # micro-batch before this step's last one trains (to know the boundary), and
            # a resume gives that batch back to the queue.
            rank_state[DATA_ENTRY] = {**self.loader.state_dict(), "position": self.position}
        path = self.checkpoints.save(
            self.step, state, rank_state=rank_state or None, metrics=metrics
        )
        self._saved_step = self.step
        log.info("checkpoint at step %d: %s", self.step, path)
