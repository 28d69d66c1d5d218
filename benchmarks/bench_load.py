"""A load run: 32 producer processes and 8 consumer processes against one PostgreSQL.

``python -m benchmarks --only load [--load-seconds S]`` or
``python -m benchmarks.bench_load [--seconds 60] [--producers 32] [--consumers 8] [--dir DIR]``;
not part of the default ``python -m benchmarks``, and not a test.

One run on a throw-away server (``bench_pg.postgres``: fsync on). The producers
commit batches of :data:`BATCH` refs (``Producer.commit``: the ledger's path, no
feature bytes) for ``seconds``, then close. The consumers are the 8 ranks of one
trainer (``Consumer(rank=r, world_size=8)``) without torch.distributed: rank 0
resumes first, then the others join its epoch (the no-collective path the
Consumer documents); each leases up to :data:`LEASE_BATCH` refs of its share and
acks them, until the producers have closed and its share is drained (at most
:data:`DRAIN_S` more seconds). So that the backlog stays bounded, a producer waits
while more than :data:`MAX_BACKLOG` committed samples are not yet acked (a counter
shared by the processes, outside the ledger: the time it waits is not in the
commit latency).

It reports events/s (commits, leases and acks, per sample, and the ledger's rows),
commit and lease latency p50/p99, each consumer's resident set sampled every
second (start, middle, end, and the slope), and checks the run with
``replay(ledger, run).verify()``: no violation, every committed sample acked (0
lost), none acked twice (0 duplicated, from the ids each consumer wrote to a file
as it acked them).
"""

from __future__ import annotations

import argparse
import bisect
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import _report, bench_pg
from benchmarks._rows import Row, row
from benchmarks._runner import LOAD_SECONDS_ENV, tiny
from benchmarks.bench_ledger import bench_ref
from dataflow import Consumer, Ledger, Producer, replay
from stores import LocalFeatureStore

PRODUCERS, CONSUMERS = 32, 8
SECONDS, QUICK_SECONDS, TINY_SECONDS = 60.0, 10.0, 2.0
BATCH = 64
LEASE_BATCH = 256
MAX_BACKLOG = 64 * 1024
DRAIN_S = 120.0
RUN_ID = "load"
_PROCESSES = mp.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["psycopg", "dataflow", "stores", "benchmarks.bench_load"])
_WAIT = 600.0
_MAX_MEMORY_SAMPLES = 4096


class Histogram:
    """Latencies in buckets 2% wide (from 1 us): bounded memory, quantiles within 2%."""

    _BASE = math.log(1.02)

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def add(self, seconds: float) -> None:
        self.counts[max(0, int(math.log(max(seconds, 1e-6) * 1e6) / self._BASE))] += 1

    def merge(self, other: Histogram) -> None:
        self.counts.update(other.counts)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile in seconds (the upper edge of its bucket); nan when empty."""
        total = sum(self.counts.values())
        if not total:
            return math.nan
        keys = sorted(self.counts)
        running, cumulative = 0, []
        for k in keys:
            running += self.counts[k]
            cumulative.append(running)
        k = keys[min(bisect.bisect_left(cumulative, q * total), len(keys) - 1)]
        return math.exp((k + 1) * self._BASE) / 1e6


@dataclass
class Report:
    """What one process did."""

    events: int = 0  # commits (a producer) or samples leased (a consumer)
    latency: Histogram = field(default_factory=Histogram)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds from start, bytes)
    drained_at: float = 0.0


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


def _keep(samples: list[tuple[float, int]], sample: tuple[float, int]) -> None:
    """Append, halving the list (every other one) when it is full: bounded, evenly spread."""
    samples.append(sample)
    if len(samples) > _MAX_MEMORY_SAMPLES:
        del samples[1::2]


def _producer(url: str, index: int, shared: Any, pipe: Any) -> None:
    committed, acked = shared
    report = Report()
    with Ledger.open(url, create=False) as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id=RUN_ID, producer_id=f"producer-{index}")
        ledger.head_seq(RUN_ID)  # connect before the clock starts
        pipe.send("ready")
        start, stop = pipe.recv()
        time.sleep(max(0.0, start - time.monotonic()))
        n = 0
        while time.monotonic() < stop:
            if committed.value - acked.value > MAX_BACKLOG:
                time.sleep(0.005)
                continue
            refs = [bench_ref(f"p{index}-{n + i:09d}") for i in range(BATCH)]
            began = time.perf_counter()
            producer.commit(refs)
            report.latency.add(time.perf_counter() - began)
            n += BATCH
            with committed.get_lock():
                committed.value += BATCH
        report.events = n
        producer.close()
    pipe.send(report)


def _consumer(url: str, rank: int, world: int, shared: Any, pipe: Any) -> None:
    _, acked = shared
    report = Report()
    with (
        open(Path(pipe.recv()), "w") as acks,
        Ledger.open(url, create=False) as ledger,
        LocalFeatureStore() as store,
    ):
        consumer = Consumer(ledger, store, run_id=RUN_ID, consumer_id=f"rank{rank}", rank=rank,
                            world_size=world, release_policy="never")  # fmt: skip
        consumer.forget_finished = True  # each rank's fold keeps its live samples only
        pipe.recv()  # rank 0 first; the others once it has resumed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no events yet": by design
            consumer.resume()
        pipe.send("ready")
        start, stop = pipe.recv()
        time.sleep(max(0.0, start - time.monotonic()))
        step, next_sample, deadline = 0, start, stop + DRAIN_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_sample:
                _keep(report.rss, (now - start, _rss()))
                next_sample = now + 1.0
            began = time.perf_counter()
            refs = consumer.lease(LEASE_BATCH, timeout=0.05)
            if not refs:
                if now > stop and consumer.finished:
                    break
                continue
            report.latency.add(time.perf_counter() - began)
            step += 1
            consumer.ack(refs, step=step)
            acks.write("".join(f"{r.sample_id}\n" for r in refs))
            report.events += len(refs)
            with acked.get_lock():
                acked.value += len(refs)
        report.drained_at = time.monotonic() - start
        _keep(report.rss, (report.drained_at, _rss()))
        consumer.close()
    pipe.send(report)


def _recv(pipe: Any) -> Any:
    if not pipe.poll(_WAIT):
        raise TimeoutError(f"a load process said nothing for {_WAIT:g}s")
    return pipe.recv()


@dataclass
class LoadResult:
    seconds: float
    producers: int
    consumers: int
    commits: int
    acked: int
    rows: int  # the ledger's rows of the run
    drained_s: float
    commit: Histogram
    lease: Histogram
    rss: list[list[tuple[float, int]]]  # per consumer
    violations: list[str]
    lost: int
    duplicated: int
    committed_in_ledger: int


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares bytes per second of a resident-set series."""
    if len(samples) < 2:
        return 0.0
    ts, bs = [t for t, _ in samples], [b for _, b in samples]
    mt, mb = statistics.fmean(ts), statistics.fmean(bs)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (b - mb) for t, b in samples) / var if var else 0.0


def load(
    workdir: Path, *, seconds: float, producers: int = PRODUCERS, consumers: int = CONSUMERS
) -> LoadResult:
    """Run the load on a throw-away server under ``workdir`` and check the run."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_load_") as tmp:
        os.chmod(tmp, 0o755)  # see bench_pg.postgres()
        with bench_pg.postgres(Path(tmp)) as server, bench_pg.fresh_database(server.url) as url:
            return _load(Path(tmp), url, seconds, producers, consumers)


def _load(tmp: Path, url: str, seconds: float, producers: int, consumers: int) -> LoadResult:
    shared = (_PROCESSES.Value("q", 0), _PROCESSES.Value("q", 0))
    procs, pipes = [], []
    try:
        roles = [(_consumer, (rank, consumers)) for rank in range(consumers)]
        roles += [(_producer, (index,)) for index in range(producers)]
        for target, who in roles:
            ours, theirs = _PROCESSES.Pipe()
            args = (url, *who, shared, theirs)
            procs.append(_PROCESSES.Process(target=target, args=args, daemon=True))
            pipes.append(ours)
        for proc in procs:
            proc.start()
        for rank, pipe in enumerate(pipes[:consumers]):
            pipe.send(str(tmp / f"acks-{rank}.txt"))
        pipes[0].send("resume")
        _ready(pipes[0])
        for pipe in pipes[1:consumers]:
            pipe.send("resume")
        for pipe in pipes[1:]:
            _ready(pipe)
        start = time.monotonic() + 0.2
        for pipe in pipes:
            pipe.send((start, start + seconds))
        reports = [_recv(pipe) for pipe in pipes]
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return _check(tmp, url, seconds, reports[:consumers], reports[consumers:])


def _ready(pipe: Any) -> None:
    answer = _recv(pipe)
    if answer != "ready":
        raise RuntimeError(f"a load process did not start: {answer!r}")


def _check(
    tmp: Path, url: str, seconds: float, consumed: list[Report], produced: list[Report]
) -> LoadResult:
    commit, lease = Histogram(), Histogram()
    for r in produced:
        commit.merge(r.latency)
    for r in consumed:
        lease.merge(r.latency)
    seen: Counter[str] = Counter()
    for path in sorted(tmp.glob("acks-*.txt")):
        with open(path) as acks:
            seen.update(line.rstrip("\n") for line in acks)
    with Ledger.open(url, create=False) as ledger:
        state = replay(ledger, RUN_ID)
        violations = list(state.verify())
        committed, trained = set(state.committed), set(state.trained)
    with psycopg.connect(bench_pg._conninfo(url)) as conn:
        count = conn.execute(
            "SELECT count(*) FROM dataflow_events WHERE run_id = %s", (RUN_ID,)
        ).fetchone()
    return LoadResult(
        seconds=seconds,
        producers=len(produced),
        consumers=len(consumed),
        commits=sum(r.events for r in produced),
        acked=sum(r.events for r in consumed),
        rows=int(count[0]) if count else 0,
        drained_s=max(r.drained_at for r in consumed),
        commit=commit,
        lease=lease,
        rss=[r.rss for r in consumed],
        violations=violations,
        lost=len((committed - trained) | (committed - set(seen))),
        duplicated=sum(1 for n in seen.values() if n > 1),
        committed_in_ledger=len(committed),
    )


def memory_summary(result: LoadResult) -> tuple[float, float, float, float]:
    """Over the consumers: the largest resident set (MiB) at start, middle and end, and the
    steepest slope (MiB per minute)."""
    start = max(s[0][1] for s in result.rss if s) / 2**20
    mid = max(s[len(s) // 2][1] for s in result.rss if s) / 2**20
    end = max(s[-1][1] for s in result.rss if s) / 2**20
    slope = max(_slope(s) for s in result.rss) * 60 / 2**20
    return start, mid, end, slope


def late_slope(result: LoadResult) -> float:
    """Over the consumers: the steepest slope (bytes per second) of the resident set over
    the second half of the run, once the samples in flight (up to ``MAX_BACKLOG``) are in
    it: what each further sample costs a rank."""
    return max((_slope(s[len(s) // 2 :]) for s in result.rss), default=0.0)


def to_rows(result: LoadResult, *, note: str) -> list[Row]:
    """The load's figures; each reference is the figure it is read against."""
    samples = result.commits + 2 * result.acked  # commit, lease and ack of each sample
    wall = result.drained_s or result.seconds
    start, mid, end, slope = memory_summary(result)
    per_sample = slope / 60 * 2**20 / max(result.commits / result.seconds, 1e-9)
    late = late_slope(result) / max(result.commits / result.seconds, 1e-9)
    where = f"{result.producers} producers, {result.consumers} consumers"
    mem_note = (
        f"{note}; consumer resident set (largest of {result.consumers}): start {start:.0f} MiB, "
        f"middle {mid:.0f} MiB, end {end:.0f} MiB, steepest slope {slope:.2f} MiB/min "
        f"({per_sample:.0f} bytes per committed sample), over the second half "
        f"{late:.0f} bytes per committed sample (the ranks forget finished samples: "
        "Consumer.forget_finished)"
    )
    check = (
        f"{note}; replay(...).verify(): {len(result.violations)} violations"
        + (f" (first: {result.violations[0]})" if result.violations else "")
        + f"; {result.committed_in_ledger:,} committed in the ledger, producers counted "
        f"{result.commits:,}"
    )
    return [
        row(f"load: sample events/s, {where}", _report.per_second(samples, wall), "events/s",
            "ledger rows/s of the same run", _report.per_second(result.rows, wall), note=note),
        row(f"load: commit p50 latency, {where}", result.commit.quantile(0.5) * 1e3, "ms",
            "commit p99", result.commit.quantile(0.99) * 1e3, note=note),
        row(f"load: lease p50 latency, {where}", result.lease.quantile(0.5) * 1e3, "ms",
            "lease p99", result.lease.quantile(0.99) * 1e3, note=note),
        row(f"load: consumer resident set at the end, {where}", end, "MiB",
            "at the start", start, note=mem_note),
        row(f"load: samples lost + duplicated, {where}", result.lost + result.duplicated,
            "samples", "samples committed", result.commits, note=check),
    ]  # fmt: skip


def seconds_for(*, quick: bool) -> float:
    """``--load-seconds`` of the runner (its environment variable), else by size."""
    given = os.environ.get(LOAD_SECONDS_ENV)
    if given:
        return float(given)
    if tiny():
        return TINY_SECONDS
    return QUICK_SECONDS if quick else SECONDS


def rows(
    workdir: Path,
    *,
    quick: bool,
    seconds: float | None = None,
    producers: int = PRODUCERS,
    consumers: int = CONSUMERS,
) -> list[Row]:
    """The load run's rows (``python -m benchmarks --only load``)."""
    seconds = seconds_for(quick=quick) if seconds is None else seconds
    before = _report.load()
    result = load(workdir, seconds=seconds, producers=producers, consumers=consumers)
    note = (
        f"{seconds:g} s of producing, {BATCH} refs per commit, leases of up to {LEASE_BATCH}, "
        f"the last rank drained {result.drained_s:.1f} s after the start (events/s and rows/s "
        f"over that time); {result.commits:,} samples, {result.rows:,} "
        f"ledger rows; PostgreSQL fsync on; load average {before:.1f} at the start, "
        f"{_report.load():.1f} at the end"
    )
    return to_rows(result, note=note)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_load", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=SECONDS, help="how long producers run")
    parser.add_argument("--producers", type=int, default=PRODUCERS)
    parser.add_argument("--consumers", type=int, default=CONSUMERS, help="ranks of one run")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the server's files go")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = rows(
        args.dir,
        quick=False,
        seconds=args.seconds,
        producers=args.producers,
        consumers=args.consumers,
    )
    table = [(r.name, f"{r.value:,.2f} {r.unit}", r.baseline, f"{r.baseline_value or 0:,.2f}")
             for r in result]  # fmt: skip
    print(_report.markdown_table(["row", "figure", "beside", ""], table))
    for r in result[-2:]:
        print(f"\n{r.note}")
    return result


if __name__ == "__main__":
    main()
