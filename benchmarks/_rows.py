"""One row of ``python -m benchmarks``: a figure of ours beside its reference from the same run.

Every benchmark module the runner knows exposes

    def rows(workdir: Path, *, quick: bool) -> list[Row]

which measures (files under ``workdir``, on a real disk) and returns its rows;
``quick`` means small sizes that finish fast (a check that it runs, not a result).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Row:
    """A measured figure, its reference measured in the same run, and the target on their ratio.

    ``ratio`` is ``value / baseline_value``; ``target`` reads ``">= 0.7"`` (the ratio
    must be at least 0.7) or ``"<= 2"`` (at most 2); ``met`` is None without a target.
    """

    name: str
    value: float
    unit: str
    baseline: str
    baseline_value: float | None
    ratio: float | None
    target: str | None
    met: bool | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row(
    name: str,
    value: float,
    unit: str,
    baseline: str,
    baseline_value: float | None,
    *,
    target: str | None = None,
    note: str = "",
) -> Row:
    """Build a :class:`Row`, computing the ratio and whether the target is met.

    >>> row("commit", 70.0, "events/s", "raw executemany", 100.0, target=">= 0.7").met
    True
    """
    ratio = value / baseline_value if baseline_value else None
    met = None if target is None or ratio is None else _meets(ratio, target)
    return Row(name, value, unit, baseline, baseline_value, ratio, target, met, note)


def _meets(ratio: float, target: str) -> bool:
    op, _, bound = target.partition(" ")
    limit = float(bound)
    if op == ">=":
        return ratio >= limit
    if op == "<=":
        return ratio <= limit
    raise ValueError(f"target must read '>= N' or '<= N', got {target!r}")
