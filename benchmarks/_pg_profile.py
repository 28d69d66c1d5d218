"""Where one producer's CPU goes per commit event on PostgreSQL, ours against raw.

``python -m benchmarks.bench_pg --profile [--seconds S] [--dir DIR]``: one producer in
this process commits batches of :data:`bench_pg.BATCH` refs into a throw-away server
(as bench_pg's "1 writer, one run, no consumer" row), then raw psycopg ``executemany``
writes the same rows. Each runs twice: once plain, for its CPU per event
(``time.process_time``: the process's CPU, not its waits on the server), once under
cProfile with that same CPU clock, for the shares of that CPU by where the code lives.
The table gives each share times the plain run's CPU per event (cProfile's own cost
inflates Python code, so only the shares are taken from it).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from benchmarks import _report, bench_pg
from dataflow import Kind, Ledger, Producer
from stores import LocalFeatureStore

#: Where a function's code lives -> the layer it is counted in (first match wins).
LAYERS = (
    ("/dataflow/model/", "dataflow.model (refs, payloads, fold)"),
    ("/dataflow/recorder/", "dataflow.recorder (ledger, SQL)"),
    ("/dataflow/live/", "dataflow.live (Producer, RunView)"),
    ("/dataflow/", "dataflow, other"),
    ("/sqlalchemy/", "SQLAlchemy"),
    ("/psycopg", "psycopg (Python and C)"),
    ("/msgspec/", "msgspec / json"),
    ("/json/", "msgspec / json"),
)
OTHER = "builtins and the rest"


def _layer(filename: str, name: str) -> str:
    if filename == "~":  # a builtin: named by its module in the function name
        for needle, layer in (("psycopg", "psycopg (Python and C)"), ("msgspec", "msgspec / json")):
            if needle in name:
                return layer
        return OTHER
    for needle, layer in LAYERS:
        if needle in filename:
            return layer
    return OTHER


Step = Callable[[], int]  # one batch committed: its events


@contextmanager
def _ours(url: str, writer: int) -> Iterator[Step]:
    with Ledger.open(url, create=False) as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="run", producer_id=f"producer-{writer}")
        batches = bench_pg._batches(bench_pg.Task(bench_pg.OURS, url, ("run",), writer))

        def step() -> int:
            refs = next(batches)
            producer.commit(refs)
            return len(refs)

        yield step


@contextmanager
def _raw(url: str, writer: int) -> Iterator[Step]:
    options = "-c synchronous_commit=on"
    with psycopg.connect(bench_pg._conninfo(url), autocommit=True, options=options) as conn:
        batches = bench_pg._batches(bench_pg.Task(bench_pg.RAW, url, ("run",), writer))
        actor = f"producer-{writer}"

        def step() -> int:
            refs = next(batches)
            now = time.time()
            rows = [("run", Kind.COMMIT, r.sample_id, 0, 0, None, actor, r.to_json(), now)
                    for r in refs]  # fmt: skip
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(bench_pg._INSERT, rows)
            return len(rows)

        yield step


def _cpu_per_event(step: Step, seconds: float) -> float:
    """Microseconds of this process's CPU per event, committing for ``seconds``."""
    events, cpu, stop = 0, time.process_time(), time.monotonic() + seconds
    while time.monotonic() < stop:
        events += step()
    return (time.process_time() - cpu) / events * 1e6


def _shares(step: Step, seconds: float) -> tuple[dict[str, float], list[str]]:
    """Each layer's share of the CPU under cProfile, and the top functions by own time."""
    profile = cProfile.Profile(time.process_time)
    stop = time.monotonic() + seconds
    profile.enable()
    while time.monotonic() < stop:
        step()
    profile.disable()
    stats = pstats.Stats(profile)
    by_layer: dict[str, float] = {}
    own = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        layer = _layer(filename, name)
        by_layer[layer] = by_layer.get(layer, 0.0) + tottime
        own.append((tottime, f"{Path(filename).name}:{line} {name}"))
    total = sum(by_layer.values()) or 1.0
    top = [f"{t / total:6.1%}  {where}" for t, where in sorted(own, reverse=True)[:15]]
    return {k: v / total for k, v in by_layer.items()}, top


def report(workdir: Path, *, seconds: float = 10.0) -> str:
    """The per-event CPU table, ours against raw, and our top functions."""
    before = _report.load()
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_pg_profile_") as tmp:
        os.chmod(tmp, 0o755)  # see bench_pg.postgres()
        with bench_pg.postgres(Path(tmp)) as server, bench_pg.fresh_database(server.url) as url:
            # Each contender writes its own producer's ids: the runs after the first
            # commit new samples, not duplicates that the dedup would turn away.
            with _ours(url, 0) as step:
                ours_us = _cpu_per_event(step, seconds)
            with _raw(url, 1) as step:
                raw_us = _cpu_per_event(step, seconds)
            with _ours(url, 2) as step:
                ours_shares, top = _shares(step, seconds)
            with _raw(url, 3) as step:
                raw_shares, _ = _shares(step, seconds)
    layers = sorted(set(ours_shares) | set(raw_shares), key=lambda k: -ours_shares.get(k, 0.0))
    cells = [
        (layer, f"{ours_shares.get(layer, 0.0) * ours_us:.1f}",
         f"{raw_shares.get(layer, 0.0) * raw_us:.1f}")
        for layer in layers
    ]  # fmt: skip
    cells.append(("**all** (plain run, no profiler)", f"{ours_us:.1f}", f"{raw_us:.1f}"))
    table = _report.markdown_table(
        ["where the CPU goes", "ours, us per commit event", "raw executemany, us per row"], cells
    )
    return "\n".join(
        [
            f"Per-event CPU of one producer process, {bench_pg.BATCH} refs per commit, "
            f"{seconds:g} s per run, PostgreSQL fsync on ({_report.today()}, "
            f"{_report.machine()}; load average {before:.1f} at the start, "
            f"{_report.load():.1f} at the end).",
            "",
            table,
            "",
            "Our top functions by own CPU (share of the profiled run):",
            "",
            "```",
            *top,
            "```",
        ]
    )
