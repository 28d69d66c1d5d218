"""The ledger on PostgreSQL under concurrent writers, beside raw psycopg ``executemany``.

Writer processes commit batches of refs for a fixed time, with one consumer
process leasing and acking what they commit alongside or with none (each
:class:`Config`; :data:`CONFIGS` lists the rows and the targets of issue #37), through:

* ours: ``Producer.commit`` (validation, then one statement: the run's lock, the
  producer's epoch, the append that skips ids already held) and
  ``Consumer.lease`` / ``Consumer.ack``;
* raw: psycopg ``executemany`` of the same commit rows into the same table
  (our schema, created by ``Ledger.open``), one transaction per batch, and a
  raw consumer that selects new commits and inserts lease and ack rows;
* raw + the per-run row lock (one run only): raw with the ``SELECT ... FOR
  UPDATE`` on the run's row that every ledger append takes first, to show
  how much of the gap the lock alone explains.

Writers either all write one run (our producers share its lock, and our
consumer's lease and ack transactions hold it shared too, one at a time) or
each its own run. Every contender gets a fresh database on one throw-away server in the
work directory, with ``fsync`` on and ``synchronous_commit=on`` (a ledger
opened with ``durability="full"``). Events/s counts the writers'
commit events over the wall time from a common start to the last writer's
last batch; latency is one commit transaction, seen by its writer (ours:
``Producer.commit``; raw: the ref JSON, then the transaction). CPU per event:
the writers' own process CPU over their commit events, and the server's (the
postmaster, every backend, the WAL writer and the checkpointer, from ``/proc``,
from the empty schema to the dropped database) over every event written (the
commits, and the consumer's leases and acks where one runs).

Run: ``python -m benchmarks.bench_pg [--quick] [--writers 1,4,8] [--seconds S] [--dir DIR]``;
``--profile`` prints where one producer's CPU goes per commit event (cProfile).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg

from benchmarks import _report
from benchmarks._rows import Row, row
from benchmarks.bench_ledger import bench_ref
from benchmarks.bench_stores import filesystem
from dataflow import Consumer, Kind, Ledger, Producer
from dataflow.testing._postgres import (
    PostgresServer,
    _conninfo,
    _run_tool,
    create_database,
    drop_database,
)
from stores import LocalFeatureStore

WRITERS = (1, 4, 8)
BATCH = 64  # refs per commit transaction
LEASE_BATCH = 256
SECONDS, QUICK_SECONDS = 6.0, 1.0
ONE_RUN, OWN_RUNS = "one run", "own runs"


@dataclass(frozen=True)
class Config:
    """One measurement: ``writers`` processes into one run (or each into its own), the
    consumer process alongside or not; the targets on ours / raw, and which rows it gives.

    ``target``: on the commit events/s; ``p99_target``: on the commit p99 latency;
    ``lock``: also measure raw with the per-run row lock; ``cpu``: also report the
    writers' and the server's CPU per event.
    """

    writers: int
    mode: str = ONE_RUN
    consumer: bool = True
    target: str | None = None
    p99_target: str | None = None
    lock: bool = False
    cpu: bool = False

    @property
    def label(self) -> str:
        n = self.writers
        alone = "" if self.consumer else ", no consumer"
        return f"{n} writer{'s' if n > 1 else ''}, {self.mode}{alone}"


#: The rows of ``python -m benchmarks`` and the targets of issue #37 on PostgreSQL.
CONFIGS = (
    Config(1),
    Config(4, lock=True),
    Config(4, OWN_RUNS),
    Config(8, target=">= 0.8", p99_target="<= 2", lock=True, cpu=True),
    Config(8, OWN_RUNS),
    Config(1, consumer=False, target=">= 0.6", cpu=True),
    Config(8, consumer=False, target=">= 0.5"),
    Config(32, target=">= 0.7"),
)
OURS, RAW, RAW_LOCKED = "ours", "raw", "raw+lock"
# Workers fork from a server that imported torch and dataflow once (bench_streams).
_PROCESSES = mp.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "psycopg", "dataflow", "benchmarks.bench_pg"])
_WAIT = 300.0
_INSERT = (
    "INSERT INTO dataflow_events (run_id, kind, sample_id, revision, epoch, step, actor, "
    "payload, ts) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_DURABLE = ("fsync", "full_page_writes", "synchronous_commit")
_LOCK = (
    "INSERT INTO dataflow_runs (run_id, epoch) VALUES (%s, 0) ON CONFLICT DO NOTHING",
    "SELECT epoch FROM dataflow_runs WHERE run_id = %s FOR UPDATE",
)


@dataclass(frozen=True)
class Task:
    """One process's part of one measurement: ``writer`` index, or None for the consumer."""

    contender: str
    url: str
    run_ids: tuple[str, ...]
    writer: int | None


@dataclass
class Result:
    events: int = 0
    laps: list[float] = field(default_factory=list)
    ended: float = 0.0
    cpu_s: float = 0.0  # this process's CPU over the measurement


@dataclass
class Measured:
    contender: str
    config: Config
    rate: float  # the writers' commit events per second
    p50_ms: float
    p99_ms: float
    consumer_events: int
    writer_cpu_us: float  # the writers' CPU per commit event
    server_cpu_us: float  # the server's CPU per event (commits and the consumer's)


# -- the processes -------------------------------------------------------------------------------
Step = Callable[[], tuple[int, float]]  # one batch: (events, seconds it took)


def _worker(pipe: Any) -> None:
    while (task := pipe.recv()) is not None:
        try:
            with _STEPS[task.contender, task.writer is None](task) as step:
                pipe.send("ready")
                start, stop = pipe.recv()
                pipe.send(_loop(step, start, stop))
        except Exception as exc:  # the coordinator raises it, instead of waiting on us
            pipe.send(exc)


def _loop(step: Step, start: float, stop: float) -> Result:
    time.sleep(max(0.0, start - time.monotonic()))
    result = Result()
    cpu = time.process_time()
    while time.monotonic() < stop:
        events, seconds = step()
        if events:
            result.events += events
            result.laps.append(seconds)
        else:
            time.sleep(0.001)  # a consumer with nothing committed yet
    result.ended = time.monotonic()
    result.cpu_s = time.process_time() - cpu
    return result


def _batches(task: Task) -> Iterator[list[Any]]:
    assert task.writer is not None
    for b in itertools.count():
        yield [bench_ref(f"w{task.writer}-{b * BATCH + i:09d}") for i in range(BATCH)]


@contextmanager
def _ours_writer(task: Task) -> Iterator[Step]:
    assert task.writer is not None
    with Ledger.open(task.url, create=False) as ledger, LocalFeatureStore() as store:
        producer = Producer(
            ledger,
            store,
            run_id=task.run_ids[task.writer],
            producer_id=f"producer-{task.writer}",
        )
        ledger.head_seq(producer.run_id)  # connect before the clock starts
        batches = _batches(task)

        def step() -> tuple[int, float]:
            refs = next(batches)
            start = time.perf_counter()
            producer.commit(refs)
            return len(refs), time.perf_counter() - start

        yield step


@contextmanager
def _raw_writer(task: Task, *, locked: bool) -> Iterator[Step]:
    assert task.writer is not None
    run_id, actor = task.run_ids[task.writer], f"producer-{task.writer}"
    options = "-c synchronous_commit=on"
    with psycopg.connect(_conninfo(task.url), autocommit=True, options=options) as conn:
        batches = _batches(task)

        def step() -> tuple[int, float]:
            refs = next(batches)
            start = time.perf_counter()
            now = time.time()
            rows = [(run_id, Kind.COMMIT, r.sample_id, 0, 0, None, actor, r.to_json(), now)
                    for r in refs]  # fmt: skip
            with conn.transaction(), conn.cursor() as cur:
                if locked:
                    for statement in _LOCK:
                        cur.execute(statement, (run_id,))
                cur.executemany(_INSERT, rows)
            return len(rows), time.perf_counter() - start

        yield step


@contextmanager
def _ours_consumer(task: Task) -> Iterator[Step]:
    with Ledger.open(task.url, create=False) as ledger, LocalFeatureStore() as store:
        consumers = [
            Consumer(
                ledger,
                store,
                run_id=run_id,
                consumer_id="trainer",
                release_policy="never",
            )
            for run_id in dict.fromkeys(task.run_ids)
        ]
        with warnings.catch_warnings():
            # "run ... has no events": the writers have not committed yet, by design.
            warnings.simplefilter("ignore", UserWarning)
            for consumer in consumers:
                consumer.resume()
        steps = [0] * len(consumers)

        def step() -> tuple[int, float]:
            start, events = time.perf_counter(), 0
            for i, consumer in enumerate(consumers):
                refs = consumer.lease(LEASE_BATCH)
                if refs:
                    steps[i] += 1
                    consumer.ack(refs, step=steps[i])
                    events += 2 * len(refs)
            return events, time.perf_counter() - start

        yield step


@contextmanager
def _raw_consumer(task: Task) -> Iterator[Step]:
    run_ids = list(dict.fromkeys(task.run_ids))
    options = "-c synchronous_commit=on"
    with psycopg.connect(_conninfo(task.url), autocommit=True, options=options) as conn:
        after = dict.fromkeys(run_ids, 0)
        steps = dict.fromkeys(run_ids, 0)

        def step() -> tuple[int, float]:
            start, events = time.perf_counter(), 0
            for run_id in run_ids:
                found = conn.execute(
                    "SELECT seq, sample_id FROM dataflow_events WHERE run_id = %s AND kind = %s "
                    "AND seq > %s ORDER BY seq LIMIT %s",
                    (run_id, Kind.COMMIT, after[run_id], LEASE_BATCH),
                ).fetchall()
                if not found:
                    continue
                after[run_id] = found[-1][0]
                steps[run_id] += 1
                for kind, step_no in ((Kind.LEASE, None), (Kind.ACK, steps[run_id])):
                    now = time.time()
                    rows = [(run_id, kind, sid, None, 1, step_no, "trainer", None, now)
                            for _, sid in found]  # fmt: skip
                    with conn.transaction(), conn.cursor() as cur:
                        cur.executemany(_INSERT, rows)
                events += 2 * len(found)
            return events, time.perf_counter() - start

        yield step


_STEPS: dict[tuple[str, bool], Callable[[Task], Any]] = {
    (OURS, False): _ours_writer,
    (RAW, False): lambda task: _raw_writer(task, locked=False),
    (RAW_LOCKED, False): lambda task: _raw_writer(task, locked=True),
    (OURS, True): _ours_consumer,
    (RAW, True): _raw_consumer,
    (RAW_LOCKED, True): _raw_consumer,
}


# -- the coordinator ------------------------------------------------------------------------------
class Workers:
    """Processes that outlive one measurement, so each imports dataflow and torch only once."""

    def __init__(self, count: int) -> None:
        self.pipes, self.procs = [], []
        for _ in range(count):
            ours, theirs = _PROCESSES.Pipe()
            proc = _PROCESSES.Process(target=_worker, args=(theirs,), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)

    def run(self, tasks: list[Task], seconds: float) -> list[Result]:
        pipes = self.pipes[: len(tasks)]
        for pipe, task in zip(pipes, tasks, strict=True):
            pipe.send(task)
        answers = [_recv(pipe) for pipe in pipes]
        for answer in answers:
            if isinstance(answer, Exception):
                raise RuntimeError(f"a benchmark process failed: {answer!r}") from answer
        start = time.monotonic() + 0.2
        for pipe in pipes:
            pipe.send((start, start + seconds))
        results = [_recv(pipe) for pipe in pipes]
        for result in results:
            if isinstance(result, Exception):
                raise RuntimeError(f"a benchmark process failed: {result!r}") from result
            result.ended -= start
        return results

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():  # stuck behind a failed measurement
                proc.terminate()


def _recv(pipe: Any) -> Any:
    if not pipe.poll(_WAIT):
        raise TimeoutError(f"a benchmark process said nothing for {_WAIT:g}s")
    return pipe.recv()


def _reachable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def server_cpu_seconds(server: PostgresServer) -> float:
    """The CPU the server has used so far: the postmaster, its exited children (which it
    reaped) and its live ones (backends, WAL writer, checkpointer), from ``/proc``.

    Exact once the backends that exited have been reaped: it waits (up to a second) until
    none is a zombie, whose time is neither among the live nor yet in the postmaster's.
    """
    assert server.directory is not None
    pid = int((server.directory / "data" / "postmaster.pid").read_text().split()[0])
    deadline = time.monotonic() + 1.0
    while True:
        children = [f for f in map(_stat, _pids()) if f and int(f[1]) == pid]
        if all(f[0] != "Z" for f in children) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    # utime stime cutime cstime of the postmaster, utime stime of each child
    ticks = sum(int(f) for f in _stat(pid)[11:15])
    ticks += sum(int(f) for fields in children for f in fields[11:13])
    return ticks / os.sysconf("SC_CLK_TCK")


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (which may hold spaces): field 3 onward;
    empty for a process gone meanwhile."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return text[text.rindex(")") + 2 :].split()


@contextmanager
def postgres(workdir: Path) -> Iterator[PostgresServer]:
    """A throw-away server with fsync on, its files in ``workdir`` where it can reach them."""
    # As root the server runs as the postgres user, which cannot enter a private
    # directory (pytest's tmp_path is one); then the files go to tempfile's default.
    where = workdir if os.geteuid() != 0 or _reachable_by_others(workdir) else None
    server = PostgresServer()
    # PostgresServer puts its cluster in tempfile's directory; only while it starts,
    # so that nothing else (multiprocessing's own temporary files) lands there.
    with mock.patch.object(tempfile, "tempdir", where and str(workdir)):
        server.start()
    try:
        assert server.directory is not None and server.port is not None
        # The test helper starts it with fsync off (on its command line, which
        # ALTER SYSTEM cannot override); a benchmark must pay for durability.
        options = (
            f"-p {server.port} -c listen_addresses=127.0.0.1 "
            f"-c unix_socket_directories='{server.directory}'"
        )
        data = str(server.directory / "data")
        _run_tool(server.bin_dir, "pg_ctl", "restart", "-D", data, "-m", "fast", "-o", options,
                  "-w", "-l", str(server.directory / "server.log"))  # fmt: skip
        server._wait_ready()
        with psycopg.connect(_conninfo(server.url)) as conn:
            settings = [conn.execute(f"SHOW {name}").fetchone() for name in _DURABLE]
        if settings != [("on",)] * len(_DURABLE):
            raise RuntimeError(f"PostgreSQL runs with {dict(zip(_DURABLE, settings, strict=True))}")
        yield server
    finally:
        server.stop()


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    url = create_database(server_url, name)
    try:
        Ledger.open(url).close()  # our schema, for raw too: the same table and indexes
        yield url
    finally:
        drop_database(server_url, name)


def measure(
    workers: Workers,
    server: PostgresServer,
    contender: str,
    config: Config,
    seconds: float,
) -> Measured:
    writers = config.writers
    run_ids = tuple("run" if config.mode == ONE_RUN else f"run-{w}" for w in range(writers))
    with fresh_database(server.url) as url:
        tasks = [Task(contender, url, run_ids, w) for w in range(writers)]
        if config.consumer:
            tasks.append(Task(contender, url, run_ids, None))
        # From the empty schema to the database dropped, once its backends are gone: the
        # processes' connections and the drop count too (milliseconds, against seconds).
        server_s = server_cpu_seconds(server)
        results = workers.run(tasks, seconds)
    server_s = server_cpu_seconds(server) - server_s
    written = results[:writers]
    consumed = results[writers].events if config.consumer else 0
    laps = sorted(lap for r in written for lap in r.laps)
    wall = max(r.ended for r in written)
    commits = sum(r.events for r in written)
    return Measured(
        contender,
        config,
        _report.per_second(commits, wall),
        statistics.median(laps) * 1e3,
        laps[min(len(laps) - 1, int(0.99 * len(laps)))] * 1e3,
        consumed,
        sum(r.cpu_s for r in written) / max(commits, 1) * 1e6,
        server_s / max(commits + consumed, 1) * 1e6,
    )


def bench(workdir: Path, configs: tuple[Config, ...], seconds: float) -> tuple[list[Measured], str]:
    """The measurements, and the file system the server's files were on."""
    results = []
    with postgres(workdir) as server, ExitStack() as stack:
        assert server.directory is not None
        where = f"{filesystem(server.directory)} ({server.directory.parent})"
        workers = Workers(max(c.writers for c in configs) + 1)
        stack.callback(workers.close)
        for k, config in enumerate(configs):
            contenders = [OURS, RAW] + ([RAW_LOCKED] if config.lock else [])
            # Alternate the order, so that no contender always runs on a warmer server.
            for contender in contenders if k % 2 == 0 else contenders[::-1]:
                results.append(measure(workers, server, contender, config, seconds))
    return results, where


def to_rows(results: list[Measured], *, note: str) -> list[Row]:
    by = {(m.contender, m.config): m for m in results}
    out = []
    for m in results:
        if m.contender != OURS:
            continue
        c, raw = m.config, by[RAW, m.config]
        where = c.label
        consumers = (
            f"; consumer lease+ack events: ours {m.consumer_events:,}, raw {raw.consumer_events:,}"
            if m.consumer_events or raw.consumer_events
            else ""
        )
        out += [
            row(
                f"pg ledger commit, {where}",
                m.rate,
                "events/s",
                f"raw psycopg executemany, {where}",
                raw.rate,
                target=c.target,
                note=note + consumers,
            ),
            row(
                f"pg ledger commit p50 latency, {where}",
                m.p50_ms,
                "ms",
                f"raw psycopg executemany p50, {where}",
                raw.p50_ms,
                note=note,
            ),
            row(
                f"pg ledger commit p99 latency, {where}",
                m.p99_ms,
                "ms",
                f"raw psycopg executemany p99, {where}",
                raw.p99_ms,
                target=c.p99_target,
                note=note,
            ),
        ]
        locked = by.get((RAW_LOCKED, c))
        if locked is not None:
            out.append(
                row(
                    f"pg raw executemany + per-run row lock, {where}",
                    locked.rate,
                    "events/s",
                    f"raw psycopg executemany, {where}",
                    raw.rate,
                    note=note + f"; ours / raw+lock {m.rate / locked.rate:.2f}x",
                )
            )
        if c.cpu:
            out += [
                row(
                    f"pg writer CPU per commit event, {where}",
                    m.writer_cpu_us,
                    "us",
                    f"raw psycopg writer CPU per row, {where}",
                    raw.writer_cpu_us,
                    note=note,
                ),
                row(
                    f"pg server CPU per event, {where}",
                    m.server_cpu_us,
                    "us",
                    f"server CPU per raw row, {where}",
                    raw.server_cpu_us,
                    note=note + consumers,
                ),
            ]
    return out


def configs_for(writers: tuple[int, ...], *, consumer: bool = True) -> tuple[Config, ...]:
    """``writers`` counts into one run and (above 1) into their own runs, with the targets
    and extra rows :data:`CONFIGS` gives the same measurement."""
    known = {(c.writers, c.mode, c.consumer): c for c in CONFIGS}
    out = []
    for n in writers:
        for mode in (ONE_RUN, OWN_RUNS) if n > 1 else (ONE_RUN,):
            plain = Config(n, mode, consumer, lock=consumer and mode == ONE_RUN and n > 1)
            out.append(known.get((n, mode, consumer), plain))
    return tuple(out)


def rows(
    workdir: Path,
    *,
    quick: bool,
    writers: tuple[int, ...] | None = None,
    seconds: float | None = None,
    consumer: bool = True,
    configs: tuple[Config, ...] | None = None,
) -> list[Row]:
    """Our commit rate, latency and CPU on PostgreSQL against raw executemany.

    ``configs`` (default :data:`CONFIGS`) says what to measure; ``writers`` instead
    measures those writer counts (:func:`configs_for`), ``consumer=False`` without the
    consumer process.
    """
    if configs is None:
        configs = CONFIGS if writers is None else configs_for(writers, consumer=consumer)
    seconds = (QUICK_SECONDS if quick else SECONDS) if seconds is None else seconds
    before = _report.load()
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_pg_") as tmp:
        os.chmod(tmp, 0o755)  # see postgres()
        results, fs = bench(Path(tmp), configs, seconds)
    note = (
        f"{BATCH} refs per commit, {seconds:g} s per contender, a consumer process (where "
        f"one runs) leasing {LEASE_BATCH} and acking; PostgreSQL "
        f"fsync on, synchronous_commit on, files on {fs}; "
        f"load average {before:.1f} at the start, {_report.load():.1f} at the end"
    )
    return to_rows(results, note=note)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_pg", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="short runs: a check, not a result")
    parser.add_argument("--writers", help="these writer counts (1,4,8), not the issue's rows")
    parser.add_argument("--seconds", type=float, help="per contender and writer count")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the server's files go")
    parser.add_argument("--no-consumer", action="store_true", help="with --writers: no consumer")
    parser.add_argument(
        "--profile", action="store_true", help="where one producer's CPU goes per commit event"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.profile:
        from benchmarks import _pg_profile

        print(_pg_profile.report(args.dir, seconds=args.seconds or 10.0))
        return []
    writers = None if args.writers is None else tuple(int(n) for n in args.writers.split(","))
    result = rows(
        args.dir,
        quick=args.quick,
        writers=writers,
        seconds=args.seconds,
        consumer=not args.no_consumer,
    )
    table = [
        (r.name, f"{r.value:,.2f}", r.unit, f"{r.baseline_value or 0:,.2f}", f"{r.ratio or 0:.2f}x",
         r.target or "", "" if r.met is None else ("met" if r.met else "missed"))
        for r in result
    ]  # fmt: skip
    headers = ["row", "ours", "unit", "raw", "ours / raw", "target", ""]
    print(_report.markdown_table(headers, table))
    if result:
        print(f"\n{result[0].note}")
    return result


if __name__ == "__main__":
    main()
