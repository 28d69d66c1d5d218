"""Restart cost and consumer memory as a run's log grows.

A trainer that crashed restarts: a new process opens the ledger, resumes from
the latest checkpoint and leases its first batch. For runs of 10^4, 10^5 and
10^6 events (``bench_ledger.run_log``: commits, leases, acks, a checkpoint
every 1,000 acks), each in a fresh copy of the database, one child process is
timed from its start to its first leased batch, twice: with the snapshot a
consumer stores at its checkpoints (``Consumer.snapshot_every``; here at the
newest checkpoint) and without one (the full fold, what a restart cost before
snapshots). The child imports dataflow and no torch, as a data-plane process
would; a trainer that imports torch pays its import on top, the same at every
size.

Memory: the resident set of such a consumer once it has resumed, for the same
runs and for one of 10^6 committed samples, and that less the same process's
resident set after its imports: the bytes the fold keeps per committed sample.
Times leave out torch's import, which the first lease triggers (decoding a ref
resolves its dtypes) and which a trainer pays once at its start whatever the log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _report
from benchmarks._rows import Row, row
from benchmarks.bench_ledger import RUN_ID, build_run
from benchmarks.bench_stores import filesystem
from dataflow import Ledger, replay
from dataflow.interfaces._durable import fsync_path

_SIZES = (10_000, 100_000, 1_000_000)
_QUICK = (2_000, 6_000)
#: The sizes of :func:`rows`: the target compares the largest with the smallest.
ROW_SIZES, QUICK_ROW_SIZES = (10_000, 100_000, 1_000_000), (1_000, 10_000)
TARGET = "<= 2"
_MEMORY_SAMPLES = 1_000_000
_QUICK_MEMORY_SAMPLES = 3_000
#: Events per committed sample in bench_ledger's runs: a commit, a lease, an ack.
_EVENTS_PER_SAMPLE = 3

# The child: a fresh process that restarts a consumer of the run. No torch: a
# store whose features are never read is enough to lease refs.
_CHILD = """
import json, sys, time
started = float(sys.argv[2])
from collections.abc import Iterator
from dataflow import Consumer, FeatureStore, Ledger

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

class RefsOnly(FeatureStore):
    def _put(self, *a): raise NotImplementedError
    def _get(self, *a): raise NotImplementedError
    def _delete(self, ref): pass
    def _exists(self, ref): return True
    def _scan(self) -> Iterator: return iter(())

imported, base = time.time(), rss()
ledger = Ledger.open("sqlite:///" + sys.argv[1], create=False)
consumer = Consumer(ledger, RefsOnly("bench://"), run_id=sys.argv[3], consumer_id="trainer",
                    release_policy="never")
consumer.snapshot_every = None  # measure the restart, not a new snapshot
consumer.resume()
resumed_rss, torch_before = rss(), "torch" in sys.modules
# Decoding a ref resolves its torch dtypes: a trainer has imported torch long before.
before = time.time()
import torch
torch_s = time.time() - before
batch = consumer.lease(32)
leased = time.time() - torch_s
print(json.dumps({"start_to_lease": leased - started, "import": imported - started,
                  "resume_to_lease": leased - imported, "leased": len(batch),
                  "from_snapshot": consumer._snapshot_seq > 0, "rss": resumed_rss,
                  "base_rss": base, "torch_before_lease": torch_before,
                  "samples": len(consumer.state.committed)}))
"""


@dataclass
class Restart:
    events: int
    samples: int
    snapshot: bool
    start_to_lease: float
    resume_to_lease: float
    rss: int
    base_rss: int

    @property
    def bytes_per_sample(self) -> float:
        return (self.rss - self.base_rss) / max(1, self.samples)


def _snapshot_at_last_checkpoint(path: Path) -> int:
    """Store the snapshot a consumer would have written at the newest checkpoint."""
    ledger = Ledger.open(f"sqlite:///{path}", durability="normal")
    try:
        full = replay(ledger, RUN_ID, snapshots=False)
        seq = full.checkpoints[-1].seq if full.checkpoints else full.head_seq
        ledger.save_snapshot(RUN_ID, replay(ledger, RUN_ID, upto_seq=seq, snapshots=False))
        return seq
    finally:
        ledger.close()


def _drop_snapshots(path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DELETE FROM dataflow_snapshots")
    conn.close()


def _restart(path: Path, events: int, *, snapshot: bool, repeats: int) -> Restart:
    """The best of ``repeats`` restarts, each in a fresh copy of the database."""
    best: Restart | None = None
    for _ in range(repeats):
        copy = path.with_name(f"{path.stem}-restart.db")
        shutil.copyfile(path, copy)
        if not snapshot:
            _drop_snapshots(copy)
        # On disk, as a crashed run's ledger is: else the resume's first commit would
        # fsync the whole fresh copy (a cost of the copy that grows with the log).
        fsync_path(copy)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(copy), repr(time.time()), RUN_ID],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        assert got["leased"] > 0 and got["from_snapshot"] == snapshot, got
        assert not got["torch_before_lease"], "the resume imported torch"
        result = Restart(
            events,
            got["samples"],
            snapshot,
            got["start_to_lease"],
            got["resume_to_lease"],
            got["rss"],
            got["base_rss"],
        )
        if best is None or result.start_to_lease < best.start_to_lease:
            best = result
        copy.unlink()
    assert best is not None
    return best


def restarts(
    workdir: Path, events: int, repeats: int, modes: tuple[bool, ...] = (True, False)
) -> list[Restart]:
    """Restarts of a consumer on a run of ``events`` events: from a snapshot, from none."""
    path = workdir / f"run-{events}.db"
    build_run(path, events)
    try:
        _snapshot_at_last_checkpoint(path)
        return [_restart(path, events, snapshot=s, repeats=repeats) for s in modes]
    finally:
        path.unlink()


def bench(
    workdir: Path, sizes: tuple[int, ...], memory_samples: int, repeats: int
) -> list[Restart]:
    results = []
    for events in [*sizes, memory_samples * _EVENTS_PER_SAMPLE]:
        results += restarts(workdir, events, repeats)
    return results


def consumer_memory(workdir: Path, samples: int) -> tuple[int, int]:
    """(resident bytes, resident bytes after its imports) of a consumer that resumed a run
    of about ``samples`` committed samples (from its snapshot) and leased a batch.

    The difference is what the fold keeps; ``workdir`` holds the run's database.
    """
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_memory_") as tmp:
        (got,) = restarts(Path(tmp), samples * _EVENTS_PER_SAMPLE, repeats=1, modes=(True,))
    return got.rss, got.base_rss


def rows(workdir: Path, *, quick: bool, sizes: tuple[int, ...] | None = None) -> list[Row]:
    """Restart latency (process start to first leased batch) at the largest size against
    the smallest, from a snapshot (the target) and from the full fold; files in ``workdir``."""
    sizes = sizes or (QUICK_ROW_SIZES if quick else ROW_SIZES)
    repeats = 1 if quick else 2
    before = _report.load()
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_restart_") as tmp:
        results = [r for events in sizes for r in restarts(Path(tmp), events, repeats)]
        fs = filesystem(Path(tmp))
    by = {(r.events, r.snapshot): r for r in results}
    small, large = min(sizes), max(sizes)
    note = (
        f"best of {repeats} restarts, each a fresh process on a fresh copy of the SQLite "
        f"ledger (torch's import left out); files on {fs}; load average {before:.1f} at the "
        f"start, {_report.load():.1f} at the end; "
        + ", ".join(f"{r.events:,} events {'snapshot' if r.snapshot else 'full fold'} "
                    f"{r.start_to_lease:.2f} s" for r in results)
    )  # fmt: skip
    return [
        row(
            f"restart to first lease at {large:,} events, {how}",
            by[large, snapshot].start_to_lease,
            "s",
            f"restart to first lease at {small:,} events, {how}",
            by[small, snapshot].start_to_lease,
            target=TARGET if snapshot else None,
            note=note,
        )
        for snapshot, how in ((True, "from a snapshot"), (False, "full fold"))
    ]


def report(results: list[Restart], *, command: str, loads: tuple[float, float]) -> str:
    rows = []
    for r in results:
        rows.append(
            [
                f"{r.events:,}",
                f"{r.samples:,}",
                "snapshot + tail" if r.snapshot else "full fold",
                f"{r.start_to_lease:.2f}",
                f"{r.resume_to_lease:.2f}",
                f"{r.rss / 2**20:.0f}",
                f"{r.bytes_per_sample:.0f}",
            ]
        )
    table = _report.markdown_table(
        [
            "events in the log",
            "committed samples",
            "restart from",
            "start to first lease, s",
            "resume to first lease, s",
            "consumer RSS, MiB",
            "bytes / sample",
        ],
        rows,
    )
    by = {(r.events, r.snapshot): r for r in results}
    sizes = sorted({r.events for r in results})[:-1]  # the last run is the memory one
    smallest, largest = sizes[0], sizes[-1]
    ratio = by[largest, True].start_to_lease / by[smallest, True].start_to_lease
    full_ratio = by[largest, False].start_to_lease / by[smallest, False].start_to_lease
    memory = by[max(r.events for r in results), True]
    mib = memory.rss / 2**20
    lines = [
        f"Measured {_report.today()} on {_report.machine()}: `{command}`",
        f"(1-minute load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end;"
        " best of the repeats; a real disk).",
        "",
        "A crashed trainer restarts: a new process opens the ledger, resumes from the"
        " latest checkpoint and leases its first batch. Each row is one such process on a"
        " fresh copy of a run of that many events (commits, leases, acks, a checkpoint"
        " every 1,000 acks), started from the snapshot a consumer stores at its"
        " checkpoints (`Consumer.snapshot_every`), or without one (the full fold: the"
        " peer, what every restart cost before snapshots). *Start to first lease* counts"
        " from the process's start (Python, SQLAlchemy and dataflow imports included);"
        " *resume to first lease* from after the imports. Both leave out torch's import,"
        " which the first lease triggers (a ref's dtypes) and which a trainer pays once"
        " whatever the log. *Consumer RSS* is the process's resident set once it has"
        " resumed; *bytes / sample* is that less its resident set after the imports, per"
        " committed sample (noisy at small sizes, where the fold is a few MiB).",
        "",
        table,
        "",
        f"- restart at {largest:,} events / at {smallest:,}, with snapshots: "
        f"{_report.fmt_ratio(ratio)} (target <= 2x: **{'met' if ratio <= 2 else 'missed'}**); "
        f"without: {_report.fmt_ratio(full_ratio)}",
        f"- a consumer of {memory.samples:,} committed samples: {mib:.0f} MiB resident "
        f"(target < 256 MiB: **{'met' if mib < 256 else 'missed'}**), "
        f"{memory.bytes_per_sample:.0f} bytes per sample over the process's "
        f"{memory.base_rss / 2**20:.0f} MiB after imports",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_restart",
        description="Restart latency and consumer memory as the log grows.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a check, not a result")
    parser.add_argument("--repeats", type=int, default=3, help="restarts per row, the best counts")
    parser.add_argument("--dir", type=Path, help="where the databases go (default: a temp dir)")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    sizes = _QUICK if args.quick else _SIZES
    memory_samples = _QUICK_MEMORY_SAMPLES if args.quick else _MEMORY_SAMPLES
    command = " ".join(["python -m benchmarks.bench_restart", *argv])
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_restart_") as tmp:
        before = _report.load()
        results = bench(Path(tmp), sizes, memory_samples, args.repeats)
        body = report(results, command=command, loads=(before, _report.load()))
    print(f"## Restart and memory\n\n{body}")
    if args.write_docs:
        _report.write_section("Restart and memory", body)
        print(f"wrote the Restart and memory section of {_report.DOCS}")
    return body


if __name__ == "__main__":
    main()
