"""``python -m benchmarks``: run every benchmark module's ``rows()`` and print one table.

Each module named in :data:`REGISTRY` is imported on first use and called as
``rows(workdir, quick=...)`` (``benchmarks/_rows.py``). A module that fails to
import, has no ``rows()`` or raises is reported with its error and the others
still run; the exit status is 1 when any module failed, 0 otherwise (a missed
target is a result, not a failure).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import _report
from benchmarks._rows import Row

#: Benchmark name (what ``--only`` takes) -> the module whose ``rows()`` measures it.
REGISTRY: dict[str, str] = {
    "ledger": "benchmarks.bench_ledger",
    "pg": "benchmarks.bench_pg",
    "stores": "benchmarks.bench_stores",
    "streams": "benchmarks.bench_streams",
    "restart": "benchmarks.bench_restart",
    "e2e": "benchmarks.bench_e2e",
    "memory": "benchmarks.bench_memory",
    "producer": "benchmarks.bench_producer",
    "demo": "benchmarks.bench_demo",
    "load": "benchmarks.bench_load",
}

#: Run only when named in ``--only`` (not by default): minutes of load, not a row of the table.
OPT_IN = frozenset({"load"})

#: The section of docs/benchmarks.md that ``--write-docs`` rewrites.
SECTION = "Results"

#: Set (to "1") by the hidden ``--tiny``: the runner's own tests shrink the modules that
#: read it below their ``--quick`` sizes.
TINY_ENV = "DATAFLOW_BENCH_TINY"

#: Set by ``--load-seconds``: how long the load run (``--only load``) produces.
LOAD_SECONDS_ENV = "DATAFLOW_BENCH_LOAD_SECONDS"

HEADERS = ("metric", "ours", "reference", "reference figure", "ratio", "target", "met")


def tiny() -> bool:
    """Whether the runner's tests asked for sizes below ``--quick`` (a check that it runs)."""
    return os.environ.get(TINY_ENV) == "1"


@dataclass(frozen=True)
class Failure:
    """A module that gave no rows: its benchmark name and what went wrong."""

    name: str
    error: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": None,
            "unit": "",
            "baseline": "",
            "baseline_value": None,
            "ratio": None,
            "target": None,
            "met": None,
            "note": f"failed: {self.error}",
        }


@dataclass
class Outcome:
    rows: list[Row]
    failures: list[Failure]
    seconds: float
    loads: tuple[float, float]


def run_modules(
    names: Sequence[str],
    workdir: Path,
    *,
    quick: bool,
    registry: Mapping[str, str] = REGISTRY,
) -> Outcome:
    """Run the named modules' ``rows()`` in order, each in its own directory under ``workdir``."""
    rows: list[Row] = []
    failures: list[Failure] = []
    start, load_before = time.perf_counter(), _report.load()
    progress = tqdm(names, desc="benchmarks", unit="module", file=sys.stderr, leave=False)
    for name in progress:
        progress.set_postfix_str(name)
        try:
            module = importlib.import_module(registry[name])
            measure = getattr(module, "rows", None)
            if not callable(measure):
                raise LookupError(f"module {registry[name]} has no rows() yet")
            moddir = workdir / name
            moddir.mkdir()
            got = measure(moddir, quick=quick)
            bad = [r for r in got if not isinstance(r, Row)]
            if bad:
                raise TypeError(f"rows() returned {type(bad[0]).__name__}, not Row")
            rows.extend(got)
        except Exception as exc:
            detail = traceback.format_exception_only(exc)[-1].strip()
            failures.append(Failure(name, detail))
            tqdm.write(f"benchmark {name!r} failed: {detail}", file=sys.stderr)
    progress.close()
    return Outcome(rows, failures, time.perf_counter() - start, (load_before, _report.load()))


def fmt_number(value: float | None) -> str:
    """Thousands separators for large figures, three significant digits for small ones."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def table(outcome: Outcome) -> str:
    cells: list[list[str]] = []
    for r in outcome.rows:
        met = "" if r.met is None else ("met" if r.met else "**missed**")
        ours = f"{fmt_number(r.value)} {r.unit}".strip()
        ref = "" if r.baseline_value is None else f"{fmt_number(r.baseline_value)} {r.unit}"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        cells.append([r.name, ours, r.baseline, ref, ratio, r.target or "", met])
    for f in outcome.failures:
        cells.append([f.name, "**failed**", f.error, "", "", "", ""])
    return _report.markdown_table(HEADERS, cells)


def report(outcome: Outcome, command: str) -> str:
    """The Results section: where and when it ran, then the table and the rows' notes."""
    before, after = outcome.loads
    lines = [
        f"Measured {_report.today()} on {_report.machine()}: `{command}`",
        f"(1-minute load average {before:.1f} at the start, {after:.1f} at the end;"
        f" {outcome.seconds:.0f} s in all).",
        "",
        table(outcome),
    ]
    # Rows of one module often share their note: say it once, for all of them.
    named: dict[str, list[str]] = {}
    for r in outcome.rows:
        if r.note:
            named.setdefault(r.note, []).append(r.name)
    notes = [f"- {'; '.join(names)}: {note}" for note, names in named.items()]
    return "\n".join([*lines, "", *notes] if notes else lines)


def _tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a memory file system (whose numbers say nothing about disks)."""
    best, fstype = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            mount = parts[1]
            inside = path == Path(mount) or Path(mount) in path.parents
            if inside and len(mount) > len(best):
                best, fstype = mount, parts[2]
    return fstype in ("tmpfs", "ramfs")


def parser(registry: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks and print one table: each figure of ours beside its "
        "reference measured in the same run, the ratio and its target.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a check, not a result")
    p.add_argument(
        "--only", nargs="+", metavar="NAME", help=f"run only these: {', '.join(registry)}"
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows to FILE as JSON")
    p.add_argument(
        "--dir", type=Path, help="where the files go (a real disk; default: the system temp dir)"
    )
    p.add_argument(
        "--write-docs", action="store_true", help=f"rewrite the {SECTION} section of {_report.DOCS}"
    )
    p.add_argument(
        "--load-seconds", type=float, metavar="S", help="how long --only load runs (default 60)"
    )
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None, *, registry: Mapping[str, str] = REGISTRY) -> int:
    """The command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(registry).parse_args(argv)
    default = [n for n in registry if n not in OPT_IN]
    names = default if args.only is None else list(dict.fromkeys(args.only))
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(
            f"unknown benchmark {', '.join(map(repr, unknown))}; choose from: "
            f"{', '.join(registry)}",
            file=sys.stderr,
        )
        return 2
    if args.tiny:
        os.environ[TINY_ENV] = "1"
    if args.load_seconds is not None:
        os.environ[LOAD_SECONDS_ENV] = str(args.load_seconds)
    quick = args.quick or args.tiny
    base = Path(args.dir or tempfile.gettempdir()).resolve()
    if _tmpfs(base):
        print(f"warning: {base} is a memory file system; pass --dir on a disk", file=sys.stderr)
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix="benchmarks_") as tmp:
        outcome = run_modules(names, Path(tmp), quick=quick, registry=registry)
    command = " ".join(["python -m benchmarks", *argv])
    body = report(outcome, command)
    print(body)
    if args.json is not None:
        items = [r.to_json() for r in outcome.rows] + [f.to_json() for f in outcome.failures]
        args.json.write_text(json.dumps(items, indent=2) + "\n")
    if args.write_docs:
        _report.write_section(SECTION, body)
        print(f"wrote the {SECTION} section of {_report.DOCS}", file=sys.stderr)
    return 1 if outcome.failures else 0
