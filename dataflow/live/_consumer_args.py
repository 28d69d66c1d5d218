"""The Consumer's argument checks: ints, steps, sample ids, producer ids.

Each raises before anything is written: ArgumentTypeError for a wrong type,
InvalidArgumentError for a value out of range, LedgerStateError for a step
that cannot name an optimizer step.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError, LedgerStateError
from dataflow.model._refs import SampleRef, validate_sample_id
from dataflow.recorder._ledger import check_id

_MAX_INT64 = 2**63 - 1


def _check_int(name: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    if value > _MAX_INT64:
        raise InvalidArgumentError(f"{name} must fit in 64 bits (<= {_MAX_INT64}), got {value}")
    return value


def _check_step(what: str, step: object, *, minimum: int) -> int:
    _check_int("step", step, minimum=-_MAX_INT64 - 1)
    if step < minimum:  # type: ignore[operator]
        raise LedgerStateError(
            f"{what} step must be >= {minimum}, got {step}: step N is the N-th optimizer "
            "step (acks name the step their samples were trained into, from 1; a "
            "checkpoint at step 0 holds the state before the first step)"
        )
    return step  # type: ignore[return-value]


def _sample_ids(refs: object, what: str) -> list[str]:
    """Ids of ``refs`` (SampleRefs or ids), refusing duplicates and bad types."""
    if isinstance(refs, (str, SampleRef)) or not isinstance(refs, Iterable):
        raise ArgumentTypeError(f"{what} takes a list of SampleRefs or sample ids, got {refs!r}")
    ids = [r.sample_id if isinstance(r, SampleRef) else validate_sample_id(r) for r in refs]
    duplicates = sorted(s for s, n in collections.Counter(ids).items() if n > 1)
    if duplicates:
        raise InvalidArgumentError(f"{what} got the same sample more than once: {duplicates}")
    return ids


def _check_producers(producers: object) -> frozenset[str]:
    """``Consumer(producers=...)``: the producer ids, checked as ``Producer`` checks its own."""
    if producers is None:
        return frozenset()
    if isinstance(producers, (str, bytes)) or not isinstance(producers, Iterable):
        raise ArgumentTypeError(
            f"producers takes a list of producer ids, e.g. ['prod-0', 'prod-1'], got {producers!r}"
        )
    return frozenset(check_id("a producer id in producers", p) for p in producers)
