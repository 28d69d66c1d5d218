"""Times as the read-side tools show and take them: local ISO 8601, or unix seconds."""

from __future__ import annotations

import math
from datetime import datetime

from dataflow.model._errors import InvalidArgumentError


def parse_time(text: str) -> float:
    """Unix seconds from ``text``: a number, or an ISO 8601 time (naive: local time)."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = datetime.fromisoformat(text.strip()).timestamp()
        except ValueError:
            raise InvalidArgumentError(
                f"expected an ISO 8601 time (2025-05-01T12:00:00, 2025-05-01T12:00:00+00:00) "
                f"or unix seconds, got {text!r}"
            ) from None
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(f"expected a time after 1970 (unix seconds >= 0), got {text!r}")
    return value


def iso_time(ts: float) -> str:
    """``ts`` as local ISO 8601 with its offset (what ``--at`` reads back); ``repr(ts)``
    for what is no time (a damaged row)."""
    try:
        return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError, TypeError):
        return repr(ts)


#: Unix times a row may carry: years 1 to 9999, what datetime reads.
_TIMES = (-62_135_596_800.0, 253_402_300_800.0)


def is_time(ts: object) -> bool:
    """Whether a row's ``ts`` is a time datetime can show (a damaged row's may not be)."""
    return (
        isinstance(ts, int | float)
        and not isinstance(ts, bool)
        and math.isfinite(ts)
        and _TIMES[0] < ts < _TIMES[1]
    )
