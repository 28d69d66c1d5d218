"""Ledger rows per trained sample: the demo's run on SQLite, against one commit row each.

Runs ``dataflow demo`` (two producers, two trainer ranks under DDP, a SIGKILL of both
ranks partway and their resume; seed 0; ``--quick`` under the runner's ``--quick``: its
short run, whose fixed rows (claims, closes, resumes, checkpoints) weigh more) as a user
runs it, in a work directory
of its own, then counts the run's rows in the ledger's ``dataflow_events`` table and
the samples trained in the fold of the run (``replay``). The reference is the floor:
one row per sample, its commit (the dedup needs one per sample); every lease, ack and
release row of a batch adds to it. ``--tiny`` (the runner's tests): 64 samples and no
kill.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._rows import Row, row
from benchmarks._runner import tiny
from dataflow import Ledger, replay

TARGET = "<= 1.2"
_WAIT = 900.0


def rows_per_trained_sample(ledger_path: Path, run_id: str) -> tuple[int, int]:
    """The run's rows in the ledger file, and the samples its fold counts trained."""
    with sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM dataflow_events WHERE run_id = ?", (run_id,)
        ).fetchone()
    with Ledger.open(f"sqlite:///{ledger_path}", create=False) as ledger:
        trained = len(replay(ledger, run_id).trained)
    return int(count), trained


def run_demo(workdir: Path, *args: str) -> dict[str, object]:
    """``dataflow demo --workdir WORKDIR ARGS`` in a process of its own; its report.json."""
    result = subprocess.run(
        [sys.executable, "-m", "dataflow.cli", "demo", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=_WAIT,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"dataflow demo failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads((workdir / "report.json").read_text())


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    """Rows per trained sample in the demo's ledger (the demo's own ``--quick`` size
    with ``quick``)."""
    args = ["--seed", "0"] + (["--quick"] if quick else [])
    if tiny():
        args += ["--quick", "--no-crash", "--samples", "64"]
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_demo_") as tmp:
        report = run_demo(Path(tmp) / "demo", *args)
        count, trained = rows_per_trained_sample(
            Path(tmp) / "demo" / "ledger.db", str(report["run_id"])
        )
    note = (
        f"`dataflow demo {' '.join(args)}` on SQLite: {count:,} rows, {trained:,} samples "
        f"trained, {report.get('resumes', 0)} resume(s)"
    )
    return [
        row(
            "ledger rows per trained sample (demo)",
            count / max(trained, 1),
            "rows",
            "one commit row per sample",
            1.0,
            target=TARGET,
            note=note,
        )
    ]
