"""What every benchmark shares: timing, the machine it ran on, markdown tables, the docs page.

Each benchmark owns one ``## <Section>`` of ``docs/benchmarks.md`` and rewrites
only that section (:func:`write_section`), so benchmarks run and publish
independently of one another.
"""

from __future__ import annotations

import datetime
import os
import platform
import sqlite3
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

#: The page every benchmark publishes to, one ``## Section`` each.
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@dataclass
class Stopwatch:
    """Accumulates the wall and CPU time of the code run inside :meth:`running`."""

    seconds: float = 0.0
    laps: list[float] = field(default_factory=list)
    cpu_laps: list[float] = field(default_factory=list)

    @contextmanager
    def running(self) -> Iterator[None]:
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            lap = time.perf_counter() - start
            self.cpu_laps.append(time.process_time() - cpu_start)
            self.seconds += lap
            self.laps.append(lap)

    @property
    def median(self) -> float:
        """The median wall lap: robust to other processes' bursts on a shared machine."""
        return statistics.median(self.laps) if self.laps else 0.0

    @property
    def cpu_mean(self) -> float:
        """This process's mean CPU time per lap: what a lap costs, whoever else runs."""
        return statistics.fmean(self.cpu_laps) if self.cpu_laps else 0.0


def best_of(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    """Run ``fn`` ``repeats`` times; (fastest wall time, result of the last run)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def per_second(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def fmt_rate(value: float) -> str:
    """A rate with thousands separators: ``123,456``."""
    return f"{value:,.0f}"


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}x"


def machine() -> str:
    """One line naming where the numbers come from (cores, Python, SQLite)."""
    return (
        f"{os.cpu_count()} cores ({platform.machine()}, {platform.system()}), "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}"
    )


def load() -> float:
    """The 1-minute load average: how busy the machine was with other work."""
    return os.getloadavg()[0]


def today() -> str:
    return datetime.date.today().isoformat()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; columns whose first cell is a number are right-aligned."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [bool(rows) and _looks_numeric(str(rows[0][i])) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [
            cell.rjust(w) if num else cell.ljust(w)
            for cell, w, num in zip(row, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric, strict=True)]
    return "\n".join([line(cells[0]), line(rule), *(line(row) for row in cells[1:])])


def _looks_numeric(cell: str) -> bool:
    return bool(cell) and cell.rstrip("x%s").replace(",", "").replace(".", "").isdigit()


def write_section(section: str, body: str, path: Path = DOCS) -> None:
    """Replace the body of ``## {section}`` in ``path`` (appending the section if missing).

    Everything else in the page (its title, the other benchmarks' sections) is
    kept byte for byte.
    """
    heading = f"## {section}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    new = [heading, "", body.strip(), ""]
    try:
        start = lines.index(heading)
    except ValueError:
        lines = [*lines, "", *new] if lines and lines[-1] else [*lines, *new]
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        lines[start:end] = new
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
