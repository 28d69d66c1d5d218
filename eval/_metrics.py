"""Acceptance metrics of a speculative-decoding draft model, from per-position totals.

With ``corrects_i`` accepted draft tokens out of ``denoms_i`` tries at draft position
``i`` (totals over the whole eval set), the acceptance rate is ``a_i = corrects_i /
denoms_i`` (0 where ``denoms_i`` is 0) and the simulated acceptance length is
``sum_k prod_{i <= k} a_i``.
"""

import math
import numbers
from collections.abc import Sequence
from typing import TypeAlias

import torch

from eval._errors import EvalError, short_repr

Counts: TypeAlias = torch.Tensor | Sequence[float]

_CPU = torch.device("cpu")


def simulated_acceptance_length(corrects: Counts, denoms: Counts) -> float:
    """Expected number of accepted draft tokens per verification step.

    ``corrects`` and ``denoms`` are 1-D per-position totals (tensors or sequences of
    numbers, one entry per draft position, position 0 first). With ``a_i = corrects_i /
    denoms_i`` (0 where ``denoms_i`` is 0) the result is ``sum_k prod_{i <= k} a_i``:
    draft token ``k`` is accepted only if every token before it was.

    Raises ``EvalError`` for anything but two 1-D count vectors of the same length with
    finite, non-negative entries and ``corrects_i <= denoms_i``.
    """
    corrects_list = as_count_vector(corrects, "corrects", device=_CPU).tolist()
    denoms_list = as_count_vector(denoms, "denoms", device=_CPU).tolist()
    return geometric_sum(acceptance_rates(corrects_list, denoms_list))


def acceptance_rates(corrects: list[float], denoms: list[float]) -> list[float]:
    """Checked ``a_i = corrects_i / denoms_i`` (0 where ``denoms_i`` is 0)."""
    if len(corrects) != len(denoms):
        raise EvalError(
            f"corrects has {len(corrects)} positions but denoms has {len(denoms)}; "
            "pass one total per draft position in both."
        )
    for i, (correct, denom) in enumerate(zip(corrects, denoms, strict=True)):
        for name, value in (("corrects", correct), ("denoms", denom)):
            if not math.isfinite(value) or value < 0:
                raise EvalError(f"{name}[{i}] = {value!r}; counts must be finite and non-negative.")
        if correct > denom:
            raise EvalError(
                f"corrects[{i}] = {correct!r} exceeds denoms[{i}] = {denom!r}; a position "
                "cannot accept more draft tokens than it tried (are the arguments swapped?)."
            )
    pairs = zip(corrects, denoms, strict=True)
    return [correct / denom if denom > 0 else 0.0 for correct, denom in pairs]


def geometric_sum(rates: list[float]) -> float:
    """``sum_k prod_{i <= k} rates_i``."""
    total, prefix = 0.0, 1.0
    for rate in rates:
        prefix *= rate
        total += prefix
    return total


def as_count_vector(value: object, name: str, *, device: torch.device | None) -> torch.Tensor:
    """``value`` as a 1-D float64 tensor on ``device`` (``None``: where it already is).

    Types and shapes are checked here; the values are not, since that needs a host sync.
    """
    if isinstance(value, torch.Tensor):
        _check_dtype(value, name)
        tensor = value.detach()
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise EvalError(
                    f"{name}[{i}] is {item!r} ({type(item).__name__}); "
                    "pass numbers or a 1-D tensor of counts."
                )
        floats = [_float(item, f"{name}[{i}]") for i, item in enumerate(value)]
        tensor = torch.tensor(floats, dtype=torch.float64)
    else:
        raise EvalError(
            f"{name} is a {type(value).__name__} ({short_repr(value)}); "
            "pass a 1-D tensor or a sequence of numbers, one per draft position."
        )
    if tensor.dim() != 1:
        raise EvalError(
            f"{name} has shape {tuple(tensor.shape)}; pass a 1-D vector with one entry per "
            "draft position (sum over samples first)."
        )
    return _to_float64(tensor, device)


def as_scalar(value: object, name: str, *, device: torch.device | None) -> torch.Tensor:
    """``value`` (a number or a one-element tensor) as a 0-d float64 tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        _check_dtype(value, name)
        if value.numel() != 1:
            raise EvalError(
                f"{name} has shape {tuple(value.shape)}; pass a single number "
                "(reduce over the batch first)."
            )
        return _to_float64(value.detach().reshape(()), device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EvalError(
            f"{name} is a {type(value).__name__} ({short_repr(value)}); pass a number or a "
            "one-element tensor."
        )
    # torch.full passes the number as a kernel argument: no host-to-device copy to wait for.
    return torch.full((), _float(value, name), dtype=torch.float64, device=device)


def _float(value: numbers.Real, name: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise EvalError(
            f"{name} is {short_repr(value)}, beyond a float64 (about 1.8e308); pass counts "
            "and losses that fit one."
        ) from None


def _to_float64(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    # A blocking host-to-device copy synchronizes the stream; from host memory an
    # asynchronous one is safe (CUDA stages the source before returning). Device-to-host
    # copies stay blocking, since the host reads the result.
    target = tensor.device if device is None else device
    non_blocking = tensor.device.type == "cpu" and target.type != "cpu"
    return tensor.to(device=target, dtype=torch.float64, non_blocking=non_blocking)


def _check_dtype(tensor: torch.Tensor, name: str) -> None:
    if tensor.is_meta:
        raise EvalError(f"{name} is a meta tensor, which holds no values; pass computed ones.")
    # Checked before any op touches the values: these raise torch errors of their own.
    if tensor.is_nested:
        raise EvalError(
            f"{name} is a nested tensor; pass a dense one (sum over the samples first, or "
            "call .to_padded_tensor(0))."
        )
    if tensor.layout != torch.strided:
        raise EvalError(
            f"{name} is a {tensor.layout} tensor; pass a dense one (call .to_dense() on it)."
        )
    if tensor.is_quantized:
        raise EvalError(
            f"{name} is a quantized tensor ({tensor.dtype}); pass a dense one (call "
            ".dequantize() on it)."
        )
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise EvalError(f"{name} has dtype {tensor.dtype}; pass integer or floating-point values.")
