"""StepHelper: gradient accumulation that knows the optimizer boundary before backward."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dataflow import ArgumentTypeError, Consumer, InvalidArgumentError, SampleRef
from training._loader import Batch


def _check_modules(modules: Iterable[Any]) -> tuple[torch.nn.Module, ...]:
    # One module passed alone: a Sequential or ModuleList would iterate its layers, none
    # with a no_sync(), and every micro-step would be reduced without a word.
    if isinstance(modules, torch.nn.Module) or not isinstance(modules, Iterable):
        raise ArgumentTypeError(
            f"modules must be a collection of torch.nn.Modules, got {type(modules).__name__}: "
            "pass a list, e.g. modules=[ddp_model]"
        )
    checked = tuple(modules)
    for module in checked:
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(
                f"modules must be torch.nn.Modules, got {type(module).__name__}"
            )
    return checked


def _warn_about_fsdp2(modules: tuple[torch.nn.Module, ...]) -> None:
    for module in modules:
        if not hasattr(module, "no_sync") and hasattr(module, "set_requires_gradient_sync"):
            warnings.warn(
                f"{type(module).__name__} is an FSDP2 module (fully_shard): it has no "
                "no_sync(), and StepHelper does not defer its reductions, so it reduce-"
                "scatters every micro-batch (its gradients stay sharded). Deferring them "
                "with set_requires_gradient_sync(False) would keep unsharded gradients that "
                "zero_grad() cannot clear, and an abandoned step would leak them into the "
                "next one",
                stacklevel=3,
            )


class StepHelper:
    """Accumulates ``grad_accum`` micro-batches per optimizer step, the DDP/FSDP way.

    Every micro-batch runs inside ``with helper.micro_step(batch, last=...)``: the
    forward and backward of all but the last micro-batch of an optimizer step run
    under ``no_sync()`` of every module that has one (``DistributedDataParallel``,
    FSDP), so gradients are reduced once per optimizer step, not once per
    micro-batch. An FSDP2 module (``fully_shard``) has no ``no_sync()``: it is
    reduced every micro-batch, and passing one in ``modules`` with ``grad_accum > 1``
    warns why. The boundary must be known before backward: it is the
    ``grad_accum``-th micro-batch, or the one the caller marks ``last=True`` (the
    data ends: a short last step). ``micro_step`` yields
    whether this micro-batch ends the step. At the boundary, after the optimizer
    step, ``finish(step)`` acks the refs of every micro-batch of the step in one
    ledger transaction, through ``ack`` when given (the Trainer passes its
    loader's :meth:`FeatureLoader.ack`, which writes it in the loader's background
    thread), else ``consumer.ack``.
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        grad_accum: int = 1,
        modules: Iterable[torch.nn.Module] = (),
        ack: Callable[..., object] | None = None,
    ) -> None:
        if not isinstance(consumer, Consumer):
            raise InvalidArgumentError(
                f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}"
            )
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise InvalidArgumentError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        if ack is not None and not callable(ack):
            raise InvalidArgumentError(f"ack must be callable, got {type(ack).__name__}")
        self.consumer = consumer
        self._ack: Callable[..., object] = consumer.ack if ack is None else ack
        self.grad_accum = grad_accum
        self.modules = _check_modules(modules)
        if grad_accum > 1:
            _warn_about_fsdp2(self.modules)
        #: Micro-batches of the optimizer step in progress.
        self.micro_batches = 0
        #: Micro-steps run under no_sync() so far: their reduction was deferred.
        self.deferred = 0
        self._refs: list[SampleRef] = []
        self._boundary = False

    def _restart(self) -> None:
        """Drop the optimizer step in progress (the consumer resumes: its refs go back)."""
        self._refs = []
        self.micro_batches = 0
        self._boundary = False

    @property
    def pending_refs(self) -> tuple[SampleRef, ...]:
        """The refs of the optimizer step in progress, not yet acked."""
        return tuple(self._refs)

    def is_boundary(self, *, last: bool = False) -> bool:
        """Whether the next micro-batch ends an optimizer step."""
        return last or self.micro_batches + 1 == self.grad_accum

    @contextlib.contextmanager
    def micro_step(self, batch: Batch, *, last: bool = False) -> Iterator[bool]:
        """Run one micro-batch's forward and backward inside; yields True at the boundary."""
        if not isinstance(batch, Batch):
            raise InvalidArgumentError(
                f"batch must be a training.Batch, got {type(batch).__name__}"
            )
        if self._boundary:
            raise InvalidArgumentError(
                "the previous micro-batch ended an optimizer step: call finish(step) after "
                "the optimizer step, before the next micro_step"
            )
        boundary = self.is_boundary(last=last)
        with contextlib.ExitStack() as stack:
            if not boundary:
                for module in self.modules:
                    no_sync = getattr(module, "no_sync", None)
                    if no_sync is not None:
                        stack.enter_context(no_sync())
            yield boundary
        self._refs.extend(batch.refs)
        self.micro_batches += 1
        if not boundary:
            self.deferred += 1
        self._boundary = boundary

    def finish(self, step: int) -> list[SampleRef]:
        """After the optimizer step ``step``: ack every micro-batch's refs in one transaction
        and start the next step. Returns the acked refs."""
        if not self._boundary:
            raise InvalidArgumentError(
                f"finish({step}) before the boundary: {self.micro_batches} of "
                f"{self.grad_accum} micro-batches ran (pass last=True to end a step early)"
            )
        refs = list(self._refs)
        if refs:
            # Before the step is cleared: if the ack raises, its refs stay pending and a
            # retry of finish(step) acks them (they are in the weights already).
            self._ack(refs, step=step)
        self._refs = []
        self.micro_batches = 0
        self._boundary = False
        return refs
