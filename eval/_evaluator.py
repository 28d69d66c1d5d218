"""Evaluator: eval metrics of a draft model from per-batch output dicts, across ranks.

Counts are summed, never averaged: per-batch rates weigh a batch of 3 tokens like a
batch of 3000, so every total is accumulated first and the metrics are computed once,
from the totals of the whole eval set (of every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from eval._errors import EvalError, short_repr
from eval._metrics import acceptance_rates, as_count_vector, as_scalar, geometric_sum

_PER_POSITION = ("acc_corrects", "acc_denoms")
_SINGLE = ("accuracy_correct", "accuracy_denom")
_REQUIRED = ("loss", "num_tokens")

# Layout of the summed payload: these scalars, then corrects[L], then denoms[L].
_SCALARS = ("loss_sum", "num_tokens", "negative", "over", "non_finite")

# Layout of the header agreed with an all_reduce MAX before anything else is sent.
_HEADER = ("num_positions", "num_batches", "per_position", "single", "failed")


class Evaluator:
    """Eval metrics over the per-batch output dicts of a draft model.

    Each output dict holds ``loss`` (mean over that batch's tokens), ``num_tokens``, and
    either ``acc_corrects`` and ``acc_denoms`` (1-D, one entry per draft position) or,
    for a model with a single accuracy, ``accuracy_correct`` and ``accuracy_denom``.
    Values are tensors or Python numbers; they are summed in float64 on the device of
    the first batch's tensors, with a single host sync at the end.

    When ``group`` is given, or ``torch.distributed`` is initialized (then the default
    group is used), totals are summed over the ranks of the group before any metric is
    computed. Every rank must call ``run`` (or ``evaluate``) the same number of times;
    each call issues the same collectives on every rank whatever its shard holds, so
    empty or uneven shards do not deadlock.
    """

    def __init__(self, *, group: dist.ProcessGroup | None = None) -> None:
        process_group = getattr(dist, "ProcessGroup", None)  # absent without distributed
        if group is not None and (process_group is None or not isinstance(group, process_group)):
            raise EvalError(
                f"group is {short_repr(group)} ({type(group).__name__}); pass a process "
                "group (e.g. dist.new_group(ranks)), or None for the default group."
            )
        self.group = group

    def run(self, outputs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        """Metrics over ``outputs``: the model's per-batch output dicts (of this rank).

        Returns ``eval/avg_loss`` (token-weighted; absent when no tokens were counted),
        ``eval/avg_acc`` (``a_0``), ``eval/simulated_acc_len``, ``eval/tokens_per_step``
        (``1 + simulated_acc_len``) and ``eval/acceptance_rate_{i}`` for each draft
        position ``i`` counted from 0. Returns ``{}`` when no rank saw a batch.
        Raises ``EvalError`` for malformed outputs; in a distributed run a rank that
        finds one makes every rank raise rather than leaving its peers waiting. It first
        consumes the rest of ``outputs`` (discarding them), so that a generator calling a
        model that runs collectives of its own (tensor-parallel, FSDP) stays in step
        with the peers' models.
        """
        distributed = self.group is not None or (dist.is_available() and dist.is_initialized())
        failure: EvalError | None = None
        try:
            totals = _accumulate(outputs, drain_on_error=distributed)
        except EvalError as exc:
            if not distributed:
                raise
            failure, totals = exc, _Totals()

        header = dict(zip(_HEADER, totals.header(failed=failure is not None), strict=True))
        device = totals.device
        if distributed:
            # dataflow's collectives, imported here: importing eval imports only torch.
            from dataflow.live import flag_device, reduce_max

            device = flag_device(self.group)
            header = dict(zip(_HEADER, reduce_max(list(header.values()), self.group), strict=True))

        if header["failed"]:
            raise failure or EvalError(
                "another rank found a malformed eval output and raised; see its error."
            )
        if header["num_batches"] == 0:
            # Not zeros: a loss of 0.0 would win every best-checkpoint comparison.
            return {}
        if header["per_position"] and header["single"]:
            raise EvalError(
                "some ranks returned acc_corrects/acc_denoms and others accuracy_correct/"
                "accuracy_denom; every batch of one eval must use the same kind of counts."
            )

        num_positions = header["num_positions"]
        payload = totals.payload(num_positions, device=device)
        if distributed:
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.group)
        # The pass's one read of device values: the totals and this rank's first bad batch.
        values = torch.cat([payload, totals.first_bad.to(payload)]).tolist()
        return _summarize(values, num_positions)

    def evaluate(
        self, model_fn: Callable[[Any], Mapping[str, Any]], batches: Iterable[Any]
    ) -> dict[str, float]:
        """``run`` over ``model_fn(batch)`` for each batch, under ``torch.no_grad()``.

        ``model_fn`` returns the output dict described on ``Evaluator``; putting the
        model in eval mode is left to the caller.
        """
        if not callable(model_fn):
            raise EvalError(
                f"model_fn is a {type(model_fn).__name__}, not callable; pass a function "
                "that maps a batch to its output dict."
            )
        with torch.no_grad():
            return self.run(_model_outputs(model_fn, batches))


@dataclass
class _Totals:
    """Running float64 sums of one rank's outputs, on the outputs' device."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    scalars: torch.Tensor | None = None
    corrects: torch.Tensor | None = None
    denoms: torch.Tensor | None = None
    first_bad: torch.Tensor = field(default_factory=lambda: torch.full((1,), -1.0))
    num_batches: int = 0
    per_position: bool = False
    single: bool = False

    def header(self, *, failed: bool) -> list[int]:
        num_positions = 0 if self.corrects is None else self.corrects.numel()
        flags = (self.per_position, self.single, failed)
        return [num_positions, self.num_batches, *(int(flag) for flag in flags)]

    def payload(self, num_positions: int, *, device: torch.device) -> torch.Tensor:
        """``[*scalars, *corrects, *denoms]``, the vectors zero-padded to ``num_positions``."""
        zeros = torch.zeros(num_positions, dtype=torch.float64, device=self.device)
        parts = [
            torch.zeros(len(_SCALARS), dtype=torch.float64, device=self.device)
            if self.scalars is None
            else self.scalars,
            zeros if self.corrects is None else _pad(self.corrects, num_positions),
            zeros if self.denoms is None else _pad(self.denoms, num_positions),
        ]
        return torch.cat(parts).to(device)

    def add(self, index: int, output: object) -> None:
        """Add batch ``index``; its values are checked on the device, reported at the end."""
        keys = self._check_keys(index, output)
        assert isinstance(output, Mapping)
        if self.num_batches == 0:
            self.device = _device_of(output)
            self.first_bad = torch.full((1,), -1.0, dtype=torch.float64, device=self.device)
        name = f"batch {index}"
        loss = as_scalar(output["loss"], f"{name} loss", device=self.device)
        num_tokens = as_scalar(output["num_tokens"], f"{name} num_tokens", device=self.device)
        if keys == _PER_POSITION:
            corrects, denoms = (
                as_count_vector(output[key], f"{name} {key}", device=self.device) for key in keys
            )
            if corrects.numel() != denoms.numel() or corrects.numel() == 0:
                raise EvalError(
                    f"{name} has {corrects.numel()} acc_corrects and {denoms.numel()} "
                    "acc_denoms; return one entry per draft position (at least one) in both."
                )
        else:
            corrects, denoms = (
                as_scalar(output[key], f"{name} {key}", device=self.device).reshape(1)
                for key in keys
            )

        negative = (corrects < 0).any() | (denoms < 0).any() | (num_tokens < 0)
        over = (corrects > denoms).any()
        finite = torch.isfinite(corrects).all() & torch.isfinite(denoms).all()
        non_finite = ~(finite & torch.isfinite(num_tokens))
        # A batch with no tokens has a NaN mean loss; it must not poison the sum.
        loss_sum = torch.where(num_tokens > 0, loss * num_tokens, 0.0)
        scalars = torch.stack(
            [loss_sum, num_tokens, *(flag.double() for flag in (negative, over, non_finite))]
        )
        bad = negative | over | non_finite
        self.first_bad = torch.where(bad & (self.first_bad < 0), float(index), self.first_bad)

        self.scalars = scalars if self.scalars is None else self.scalars + scalars
        self.corrects = _add_padded(self.corrects, corrects)
        self.denoms = _add_padded(self.denoms, denoms)
        self.num_batches += 1
        self.per_position |= keys == _PER_POSITION
        self.single |= keys == _SINGLE

    def _check_keys(self, index: int, output: object) -> tuple[str, str]:
        if not isinstance(output, Mapping):
            raise EvalError(
                f"batch {index} output is a {type(output).__name__}; return a dict with loss, "
                "num_tokens and acc_corrects/acc_denoms (or accuracy_correct/accuracy_denom)."
            )
        has_per_position = any(key in output for key in _PER_POSITION)
        has_single = any(key in output for key in _SINGLE)
        if has_per_position and has_single:
            raise EvalError(
                f"batch {index} has both acc_corrects/acc_denoms and accuracy_correct/"
                "accuracy_denom; return one kind of counts."
            )
        keys = _SINGLE if has_single else _PER_POSITION
        missing = [key for key in (*_REQUIRED, *keys) if key not in output]
        if missing:
            raise EvalError(
                f"batch {index} output lacks {', '.join(missing)} (it has "
                f"{', '.join(map(str, output)) or 'no keys'}); return loss, num_tokens and "
                "acc_corrects/acc_denoms (or accuracy_correct/accuracy_denom)."
            )
        if (keys == _PER_POSITION and self.single) or (keys == _SINGLE and self.per_position):
            raise EvalError(
                f"batch {index} has {'/'.join(keys)} but earlier batches had the other kind "
                "of counts; every batch of one eval must use the same kind."
            )
        return keys


def _model_outputs(
    model_fn: Callable[[Any], Mapping[str, Any]], batches: Iterable[Any]
) -> Iterator[Mapping[str, Any]]:
    # A generator, so that even iter(batches) runs inside run(): a rank given something
    # that is not iterable then fails through the path that makes every rank raise.
    try:
        iterator = iter(batches)
    except TypeError:
        raise EvalError(
            f"batches is a {type(batches).__name__}, not iterable; pass an iterable of the "
            "batches model_fn takes (a list, a DataLoader ...)."
        ) from None
    for batch in iterator:
        yield model_fn(batch)


def _accumulate(outputs: Iterable[Mapping[str, Any]], *, drain_on_error: bool = False) -> _Totals:
    """The totals of ``outputs``; with ``drain_on_error``, an ``EvalError`` propagates only
    once the rest of ``outputs`` has been consumed (unchecked, discarded)."""
    if isinstance(outputs, Mapping) or not isinstance(outputs, Iterable):
        raise EvalError(
            f"outputs is a {type(outputs).__name__}; pass an iterable of per-batch output "
            "dicts (a list, or a generator over the eval batches)."
        )
    totals = _Totals()
    iterator = iter(outputs)
    try:
        for index, output in enumerate(iterator):
            totals.add(index, output)
    except EvalError:
        if drain_on_error:
            _drain(iterator)
        raise
    return totals


def _drain(iterator: Iterator[object]) -> None:
    """Consume ``iterator``: the models behind it run every forward, and so every
    collective of their own, that the peers' models run."""
    # An EvalError from a generator ends it (the first error is the one reported); any
    # other exception propagates, as one raised by the model always does.
    with contextlib.suppress(EvalError):
        for _ in iterator:
            pass


def _summarize(values: list[float], num_positions: int) -> dict[str, float]:
    scalars = dict(zip(_SCALARS, values, strict=False))
    counts = values[len(_SCALARS) : -1]
    first_bad = int(values[-1])
    problems = [
        f"{int(scalars[key])} batch(es) with {what}"
        for key, what in (
            ("negative", "negative counts or num_tokens"),
            ("over", "acc_corrects greater than acc_denoms"),
            ("non_finite", "non-finite counts or num_tokens"),
        )
        if scalars[key]
    ]
    if problems:
        where = f"batch {first_bad} of this rank" if first_bad >= 0 else "on another rank"
        raise EvalError(
            f"invalid eval outputs: {'; '.join(problems)} (first: {where}); check how the "
            "model computes its counts."
        )
    rates = acceptance_rates(counts[:num_positions], counts[num_positions:])
    acc_len = geometric_sum(rates)
    metrics = {}
    if scalars["num_tokens"] > 0:
        metrics["eval/avg_loss"] = scalars["loss_sum"] / scalars["num_tokens"]
    metrics["eval/avg_acc"] = rates[0]
    metrics["eval/simulated_acc_len"] = acc_len
    metrics["eval/tokens_per_step"] = 1.0 + acc_len
    metrics.update({f"eval/acceptance_rate_{i}": rate for i, rate in enumerate(rates)})
    return metrics


def _device_of(output: Mapping[str, Any]) -> torch.device:
    for key in (*_REQUIRED, *_PER_POSITION, *_SINGLE):
        value = output.get(key)
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _pad(vector: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(vector, (0, length - vector.numel()))


def _add_padded(total: torch.Tensor | None, vector: torch.Tensor) -> torch.Tensor:
    if total is None:
        return vector.clone()
    length = max(total.numel(), vector.numel())
    return _pad(total, length) + _pad(vector, length)


def communication_device(backend: str) -> torch.device:
    """``dataflow.live.communication_device``: the device collectives of a group with
    ``backend`` run on (imported on first use: importing eval imports only torch)."""
    from dataflow.live import communication_device as device

    return device(backend)
