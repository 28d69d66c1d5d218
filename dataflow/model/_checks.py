"""Argument checks that several layers share: a number of seconds, a count.

Each raises :class:`InvalidArgumentError` naming the argument and the value
it got; the callers keep their own wording of what they expect (tests pin it).
"""

from __future__ import annotations

import math

from dataflow.model._errors import InvalidArgumentError


def is_seconds(value: object, *, positive: bool = False, finite: bool = True) -> bool:
    """Whether ``value`` is an int or float (not a bool) of seconds: >= 0 (> 0 if
    ``positive``), never NaN, and finite unless ``finite=False`` lets infinity pass."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    if finite and not math.isfinite(value):
        return False
    return value > 0 if positive else value >= 0  # NaN is neither


def check_seconds(
    name: str,
    value: object,
    *,
    positive: bool = False,
    finite: bool = True,
    allow_none: bool = False,
    expected: str | None = None,
) -> None:
    """Refuse a ``value`` of argument ``name`` that :func:`is_seconds` refuses (None too,
    unless ``allow_none``).

    ``expected``: what the message says ``name`` must be; by default "a finite
    number of seconds from 0" ("above 0" when ``positive``).
    """
    if (value is None and allow_none) or is_seconds(value, positive=positive, finite=finite):
        return
    if expected is None:
        finite_ = "finite " if finite else ""
        expected = f"a {finite_}number of seconds {'above 0' if positive else 'from 0'}"
        if allow_none:
            expected += " or None"
    raise InvalidArgumentError(f"{name} must be {expected}, got {value!r}")


def check_count(name: str, value: object, *, minimum: int) -> None:
    """Refuse a ``value`` of argument ``name`` that is not an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
