"""Ledger benchmark: batched appends and replay, side by side with raw sqlite3 and eventsourcing.

Appends. The same rows (one commit event per sample, the ref JSON as payload)
go, 1,024 per transaction and fsynced (WAL, ``synchronous=FULL``), through:

* ``Producer.commit``: our public path (validation, encoding the refs, and one insert
  that leaves out the ids the run already holds, through its unique commit index);
* ``WriteTransaction.append``: our internal path, with no dedup;
* raw ``sqlite3`` ``executemany`` into a table of the same shape and indexes:
  the floor any Python ledger on SQLite stands on;
* eventsourcing's ``SQLiteAggregateRecorder`` (``executemany``) and
  ``SQLiteApplicationRecorder`` (one ``execute`` per row, for notification
  ids), with the sample id as originator id and the ref JSON as state, so the
  primary key does the same dedup as our unique commit index.

Batches are interleaved (batch i of every contender before batch i + 1 of any),
each contender in its own database file, so disk and CPU drift hit all alike.

Replay. A run of ``--events`` events shaped like a real one (a resume, then
commits in producer batches, each sample leased and acked by the trainer in
batches of 32 per optimizer step, a checkpoint every 1,000 acks) is folded by
``dataflow.replay`` and compared with a raw ``sqlite3`` scan of the same rows.
Two more rows split our time into reading (``Ledger.rows``) and folding
(``RunState`` over the raw cursor).

Run: ``python -m benchmarks.bench_ledger [--quick] [--events N] [--batches N]
[--write-docs] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import pstats
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from eventsourcing.persistence import StoredEvent
from eventsourcing.sqlite import (
    SQLiteAggregateRecorder,
    SQLiteApplicationRecorder,
    SQLiteDatastore,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.schema import CreateIndex, CreateTable

from benchmarks import _report
from benchmarks._rows import Row, row
from benchmarks._runner import tiny
from dataflow import FeatureSpec, Kind, Ledger, Producer, SampleRef, replay
from dataflow.model._events import dump_payload
from dataflow.model._fold import RunState
from dataflow.recorder._ledger import NewEvent
from dataflow.recorder._schema import events as events_table
from stores import LocalFeatureStore

RUN_ID = "bench"
PRODUCER = "producer"
CONSUMER = "trainer"
BATCH_SIZE = 1024
COMMIT_TARGET = 0.7  # Producer.commit / raw executemany into the same table
REPLAY_TARGET = 0.40  # ours / raw scan

# Contenders, as the tables name them.
COMMIT = "dataflow `Producer.commit`"
APPEND = "dataflow `WriteTransaction.append` (no dedup)"
RAW_INSERT = "raw `sqlite3` `executemany`"
ES_AGGREGATE = "eventsourcing `SQLiteAggregateRecorder`"
ES_APPLICATION = "eventsourcing `SQLiteApplicationRecorder`"
REPLAY = "dataflow `replay` (read + fold)"
RAW_SCAN = "raw `sqlite3` scan"
ROWS = "`Ledger.rows` alone (our read, no fold)"
RAW_FOLD = "raw scan + `RunState.apply` (our fold, raw read)"

_COLUMNS = "seq, kind, sample_id, revision, epoch, step, actor, payload, ts"
_INSERT = (
    "INSERT INTO dataflow_events (run_id, kind, sample_id, revision, epoch, step, actor, "
    "payload, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SCAN = f"SELECT {_COLUMNS} FROM dataflow_events WHERE run_id = ? ORDER BY seq"


def bench_ref(sample_id: str) -> SampleRef:
    return SampleRef(
        sample_id, "mem://bench", 1, {"hidden": FeatureSpec((4096,), torch.bfloat16)}, {}
    )


def sample_id(i: int) -> str:
    return f"sample-{i:09d}"


# -- appends -----------------------------------------------------------------


@dataclass
class Contender:
    """One way of appending batch ``i`` of the shared rows, into its own database."""

    name: str
    append: Callable[[int], None]
    count: Callable[[], int]
    close: Callable[[], None]


def _raw_connect(path: Path) -> sqlite3.Connection:
    """The PRAGMAs of a ``durability="full"`` ledger; transactions are ours to open."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def _raw_schema(conn: sqlite3.Connection) -> None:
    """Our events table and its indexes, compiled from dataflow's own schema."""
    dialect = sqlite_dialect.dialect()
    conn.execute(str(CreateTable(events_table).compile(dialect=dialect)))
    for index in events_table.indexes:
        conn.execute(str(CreateIndex(index).compile(dialect=dialect)))


def _ours_commit(path: Path, refs: list[list[SampleRef]]) -> Contender:
    led = Ledger.open(f"sqlite:///{path}")
    producer = Producer(led, LocalFeatureStore("bench"), run_id=RUN_ID, producer_id=PRODUCER)

    def append(i: int) -> None:
        producer.commit(refs[i])

    # Its commits only: the producer's claim is one event more.
    return Contender(COMMIT, append, lambda: led.kind_counts(RUN_ID)[Kind.COMMIT], led.close)


def _ours_append(path: Path, payloads: list[list[tuple[str, str]]]) -> Contender:
    led = Ledger.open(f"sqlite:///{path}")
    batches = [
        [NewEvent(Kind.COMMIT, PRODUCER, sid, payload=p, revision=0) for sid, p in batch]
        for batch in payloads
    ]

    def append(i: int) -> None:
        with led.write(RUN_ID, "bench") as tx:
            tx.append(batches[i])

    return Contender(APPEND, append, lambda: _ledger_count(led), led.close)


def _ledger_count(led: Ledger) -> int:
    return led.head_seq(RUN_ID)


def _raw_executemany(path: Path, payloads: list[list[tuple[str, str]]]) -> Contender:
    conn = _raw_connect(path)
    _raw_schema(conn)
    now = time.time()
    batches = [
        [(RUN_ID, Kind.COMMIT, sid, 0, 0, None, PRODUCER, p, now) for sid, p in batch]
        for batch in payloads
    ]

    def append(i: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(_INSERT, batches[i])
        conn.execute("COMMIT")

    def count() -> int:
        return conn.execute("SELECT count(*) FROM dataflow_events").fetchone()[0]

    return Contender(RAW_INSERT, append, count, conn.close)


def _eventsourcing(
    path: Path,
    payloads: list[list[tuple[str, str]]],
    recorder_class: type[SQLiteAggregateRecorder],
) -> Contender:
    datastore = SQLiteDatastore(str(path), originator_id_type="text")
    recorder = recorder_class(datastore)
    recorder.create_table()
    with datastore.transaction(commit=False) as cursor:
        cursor.execute("PRAGMA synchronous")
        synchronous = cursor.fetchone()[0]
    # The library sets WAL but leaves synchronous at SQLite's default; that
    # must be FULL (2), like ours, or the comparison is not like for like.
    if synchronous != 2:
        raise RuntimeError(f"eventsourcing runs with synchronous={synchronous}, not FULL (2)")
    batches = [
        [StoredEvent(sid, 0, "dataflow:commit", p.encode()) for sid, p in batch]
        for batch in payloads
    ]
    name = ES_AGGREGATE if recorder_class is SQLiteAggregateRecorder else ES_APPLICATION

    def append(i: int) -> None:
        recorder.insert_events(batches[i])

    def count() -> int:
        with datastore.transaction(commit=False) as cursor:
            cursor.execute("SELECT count(*) FROM stored_events")
            return cursor.fetchone()[0]

    return Contender(name, append, count, datastore.close)


@dataclass
class AppendResult:
    name: str
    batch_size: int
    batches: int
    batch_seconds: float  # median wall time
    batch_cpu_seconds: float  # mean CPU time of this process

    @property
    def events(self) -> int:
        return self.batch_size * self.batches

    @property
    def rate(self) -> float:
        return _report.per_second(self.batch_size, self.batch_seconds)


def bench_appends(workdir: Path, batches: int, batch_size: int = BATCH_SIZE) -> list[AppendResult]:
    """Append ``batches`` batches of ``batch_size`` commit events through every contender."""
    ids = [[sample_id(b * batch_size + i) for i in range(batch_size)] for b in range(batches)]
    refs = [[bench_ref(sid) for sid in batch] for batch in ids]
    payloads = [[(ref.sample_id, ref.to_json()) for ref in batch] for batch in refs]
    contenders = [
        _ours_commit(workdir / "ours_commit.db", refs),
        _ours_append(workdir / "ours_append.db", payloads),
        _raw_executemany(workdir / "raw.db", payloads),
        _eventsourcing(workdir / "es_aggregate.db", payloads, SQLiteAggregateRecorder),
        _eventsourcing(workdir / "es_application.db", payloads, SQLiteApplicationRecorder),
    ]
    watches = {c.name: _report.Stopwatch() for c in contenders}
    # The inputs of every batch are built up front; keep the cyclic GC from
    # walking them (a real producer does not hold a run's refs in memory).
    gc.collect()
    gc.freeze()
    try:
        for i in range(batches):
            turn = i % len(contenders)
            for c in contenders[turn:] + contenders[:turn]:
                with watches[c.name].running():
                    c.append(i)
        expected = batches * batch_size
        for c in contenders:
            got = c.count()
            assert got == expected, f"{c.name} holds {got} events, expected {expected}"
    finally:
        gc.unfreeze()
        for c in contenders:
            c.close()
    return [
        AppendResult(c.name, batch_size, batches, watches[c.name].median, watches[c.name].cpu_mean)
        for c in contenders
    ]


# -- replay --------------------------------------------------------------------


@dataclass
class RunShape:
    """What a synthetic run holds, to check its fold against."""

    events: int = 0
    commits: int = 0
    leases: int = 0
    acks: int = 0
    checkpoints: int = 0


def run_log(
    events: int,
    shape: RunShape,
    *,
    commit_batch: int = BATCH_SIZE,
    step_batch: int = 32,
    checkpoint_every: int = 1000,
) -> Iterator[NewEvent]:
    """Exactly ``events`` events of a valid run, counting them into ``shape``.

    A consumer resumes from scratch (epoch 1, with the payload that
    ``Consumer.resume`` writes for ``release_policy="never"``, so no release
    events are due); then the producer commits ``commit_batch`` samples at a
    time and the consumer leases and acks them in batches of ``step_batch``,
    one optimizer step per batch, with a checkpoint once ``checkpoint_every``
    acks have accumulated. Cut anywhere, the log is still valid.
    """
    template = bench_ref("ID").to_json()

    def log() -> Iterator[NewEvent]:
        resume = {
            "checkpoint_seq": None,
            "checkpoint_step": None,
            "world_size": 1,
            "release_policy": "never",
            "max_attempts": 3,
        }
        yield NewEvent(Kind.RESUME, CONSUMER, epoch=1, payload=dump_payload(resume))
        step, since_checkpoint = 0, 0
        for first in itertools.count(0, commit_batch):
            ids = [sample_id(i) for i in range(first, first + commit_batch)]
            for sid in ids:
                shape.commits += 1
                payload = template.replace('"ID"', f'"{sid}"')
                yield NewEvent(Kind.COMMIT, PRODUCER, sid, payload=payload, revision=0)
            for start in range(0, len(ids), step_batch):
                group = ids[start : start + step_batch]
                step += 1
                for sid in group:
                    shape.leases += 1
                    yield NewEvent(Kind.LEASE, CONSUMER, sid, epoch=1)
                for sid in group:
                    shape.acks += 1
                    yield NewEvent(Kind.ACK, CONSUMER, sid, epoch=1, step=step)
                since_checkpoint += len(group)
                if since_checkpoint >= checkpoint_every:
                    since_checkpoint = 0
                    shape.checkpoints += 1
                    path = dump_payload({"path": f"/ckpt/step-{step}"})
                    yield NewEvent(Kind.CHECKPOINT, CONSUMER, epoch=1, step=step, payload=path)

    for event in itertools.islice(log(), events):
        shape.events += 1
        yield event


def build_run(path: Path, events: int, *, per_transaction: int = 50_000) -> RunShape:
    """Write a synthetic run of ``events`` events into a fresh ledger at ``path``."""
    shape = RunShape()
    stream = run_log(events, shape)
    led = Ledger.open(f"sqlite:///{path}", durability="normal")
    try:
        while chunk := list(itertools.islice(stream, per_transaction)):
            with led.write(RUN_ID, "bench") as tx:
                tx.append(chunk)
    finally:
        led.close()
    return shape


def check_fold(state: RunState, shape: RunShape) -> None:
    """The fold is clean and holds exactly what was written."""
    problems = state.verify()
    assert problems == [], f"replay is not clean: {problems[:5]}"
    got = (
        state.head_seq,
        len(state.committed),
        len(state.pending),
        len(state.leased),
        len(state.trained),
        len(state.checkpoints),
    )
    want = (
        shape.events,
        shape.commits,
        shape.commits - shape.leases,
        shape.leases - shape.acks,
        shape.acks,
        shape.checkpoints,
    )
    assert got == want, f"replay holds {got}, expected {want}"


def _raw_scan(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        n = 0
        for _row in conn.execute(_SCAN, (RUN_ID,)):
            n += 1
        return n
    finally:
        conn.close()


def _raw_scan_fold(path: Path) -> RunState:
    conn = sqlite3.connect(path)
    try:
        return RunState(RUN_ID).apply_rows(conn.execute(_SCAN, (RUN_ID,)))
    finally:
        conn.close()


def _ledger_rows(led: Ledger) -> int:
    return sum(1 for _ in led.rows(RUN_ID))


@dataclass
class ReplayResult:
    name: str
    events: int
    seconds: float

    @property
    def rate(self) -> float:
        return _report.per_second(self.events, self.seconds)


def bench_replay(
    workdir: Path, events: int, repeats: int = 3
) -> tuple[RunShape, list[ReplayResult]]:
    """Fold a synthetic run of ``events`` events; best of ``repeats`` for each reader."""
    path = workdir / "replay.db"
    shape = build_run(path, events)
    _raw_scan(path)  # warm the page cache for everyone
    gc.collect()
    led = Ledger.open(f"sqlite:///{path}")
    try:
        readers: list[tuple[str, Callable[[], object]]] = [
            (REPLAY, lambda: replay(led, RUN_ID)),
            (RAW_SCAN, lambda: _raw_scan(path)),
            (ROWS, lambda: _ledger_rows(led)),
            (RAW_FOLD, lambda: _raw_scan_fold(path)),
        ]
        results = []
        for name, read in readers:
            seconds, out = _report.best_of(repeats, read)
            if isinstance(out, RunState):
                check_fold(out, shape)
            else:
                assert out == shape.events, f"{name} read {out} rows, expected {shape.events}"
            results.append(ReplayResult(name, shape.events, seconds))
    finally:
        led.close()
    return shape, results


# -- report ----------------------------------------------------------------------


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "**missed**"


def report(
    appends: list[AppendResult],
    shape: RunShape,
    replays: list[ReplayResult],
    *,
    batch_size: int,
    repeats: int,
    command: str,
    loads: tuple[float, float] = (0.0, 0.0),
) -> str:
    """The Ledger section of docs/benchmarks.md: how it was measured, two tables, verdicts."""
    append = {r.name: r for r in appends}
    replay_ = {r.name: r for r in replays}
    ours, raw = append[COMMIT], append[RAW_INSERT]
    append_table = _report.markdown_table(
        [
            f"appends, {batch_size:,} events / transaction",
            "events/s",
            "ms / batch",
            "CPU ms / batch",
            "`commit` / this",
        ],
        [
            (
                r.name,
                _report.fmt_rate(r.rate),
                f"{r.batch_seconds * 1e3:.2f}",
                f"{r.batch_cpu_seconds * 1e3:.2f}",
                _report.fmt_ratio(ours.rate / r.rate),
            )
            for r in appends
        ],
    )
    scan = replay_[RAW_SCAN]
    replay_table = _report.markdown_table(
        [f"replay of {shape.events:,} events", "events/s", "seconds", "/ raw scan"],
        [
            (r.name, _report.fmt_rate(r.rate), f"{r.seconds:.2f}", f"{r.rate / scan.rate:.0%}")
            for r in replays
        ],
    )
    es_ratio = ours.rate / append[ES_AGGREGATE].rate
    commit_ratio = ours.rate / raw.rate
    replay_ratio = replay_[REPLAY].rate / scan.rate
    ratio = _report.fmt_ratio
    return f"""\
Measured {_report.today()} on {_report.machine()}: `{command}`
(1-minute load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end).

Appends: each contender writes the same {ours.events:,} commit events (sample id and ref
JSON, {batch_size:,} per transaction, WAL, `synchronous=FULL`) into its own database file,
batches interleaved across contenders. Rates come from the median batch (wall time, fsync
included); CPU ms is this process's mean CPU time per batch, which other jobs on the machine
do not inflate.

{append_table}

- `Producer.commit` / raw `executemany`: {ratio(commit_ratio)} \
(target >= {COMMIT_TARGET}x: {_verdict(commit_ratio, COMMIT_TARGET)}); \
`WriteTransaction.append` / raw: {ratio(append[APPEND].rate / raw.rate)}
- `Producer.commit` / eventsourcing aggregate recorder: {ratio(es_ratio)}; \
/ application recorder: {ratio(ours.rate / append[ES_APPLICATION].rate)}
- for scale, raw `executemany` into our table / eventsourcing aggregate recorder: \
{ratio(raw.rate / append[ES_AGGREGATE].rate)} (its table is one `WITHOUT ROWID` B-tree of four \
columns; ours has nine columns and two secondary indexes)

Replay: one run of {shape.commits:,} commits, {shape.leases:,} leases, {shape.acks:,} acks and
{shape.checkpoints:,} checkpoints (a resume first); every fold is checked clean
(`verify() == []`) and complete; best of {repeats}.

{replay_table}

- `replay` / raw scan: {replay_ratio:.0%} (target >= {REPLAY_TARGET:.0%}: \
{_verdict(replay_ratio, REPLAY_TARGET)})

Where the time goes: `python -m benchmarks.bench_ledger --profile` (cProfile, and the cyclic
GC's collections).
"""


def profile(workdir: Path, batches: int, batch_size: int = BATCH_SIZE) -> None:
    """Print where ``Producer.commit`` and ``replay`` spend their time.

    Each runs twice on fresh state: under cProfile (top functions by own time),
    then without it, counting the cyclic GC's collections. Replays the run that
    :func:`bench_replay` left in ``workdir``.
    """
    replayed = Ledger.open(f"sqlite:///{workdir / 'replay.db'}")
    ledgers = [replayed]

    def commits() -> Callable[[], object]:
        led = Ledger.open(f"sqlite:///{workdir / f'profile_{len(ledgers)}.db'}")
        ledgers.append(led)
        producer = Producer(led, LocalFeatureStore("bench"), run_id=RUN_ID, producer_id=PRODUCER)
        refs = [
            [bench_ref(sample_id(b * batch_size + i)) for i in range(batch_size)]
            for b in range(batches)
        ]
        return lambda: [producer.commit(r) for r in refs]

    try:
        for what, fresh in (
            (f"Producer.commit, {batches} x {batch_size}", commits),
            ("replay", lambda: lambda: replay(replayed, RUN_ID)),
        ):
            profiler = cProfile.Profile()
            profiler.runcall(fresh())
            print(f"\n== cProfile: {what} (top 15 by own time) ==")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
            run = fresh()
            gc.collect()
            heap = len(gc.get_objects())
            with _gc_watch() as collections:
                seconds = _report.best_of(1, run)[0]
            print(f"== {what} without cProfile: {seconds:.2f} s; heap {heap:,} tracked objects ==")
            for generation, (count, spent) in sorted(collections.items()):
                print(f"cyclic GC generation {generation}: {count} collections, {spent:.2f} s")
    finally:
        for led in ledgers:
            led.close()


@contextmanager
def _gc_watch() -> Iterator[dict[int, list[float]]]:
    """Count the cyclic GC's collections and the time they take: {generation: [count, s]}."""
    seen: dict[int, list[float]] = {}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            entry = seen.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


_SIZES = {"events": 1_000_000, "batches": 400, "repeats": 3}
_QUICK = {"events": 100_000, "batches": 20, "repeats": 1}


#: ``rows(quick=True)``: a check that finishes in seconds; below it, the runner's own tests.
_ROWS_QUICK = {"events": 100_000, "batches": 20, "repeats": 1}
_ROWS_TINY = {"events": 10_000, "batches": 3, "repeats": 1}


def _events_label(events: int) -> str:
    """``10^6`` for a power of ten, else the number with separators."""
    exponent = len(str(events)) - 1
    return f"10^{exponent}" if events == 10**exponent else f"{events:,}"


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    """The runner's rows (``python -m benchmarks``): appends and replay on SQLite.

    ``Producer.commit`` against raw ``sqlite3`` ``executemany`` into the same table
    (target >= 0.7) and against eventsourcing's aggregate recorder (no target: its
    table is one ``WITHOUT ROWID`` B-tree of four columns, faster than raw inserts
    into ours); ``replay`` of a realistic run against a raw scan (target >= 0.4).
    """
    sizes = _ROWS_TINY if tiny() else _ROWS_QUICK if quick else _SIZES
    loads = [_report.load()]
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_ledger_") as tmp:
        appends = {r.name: r for r in bench_appends(Path(tmp), sizes["batches"])}
        loads.append(_report.load())
        shape, replays = bench_replay(Path(tmp), sizes["events"], sizes["repeats"])
        loads.append(_report.load())
    ours, raw, es = appends[COMMIT], appends[RAW_INSERT], appends[ES_AGGREGATE]
    load_note = "load average " + ", ".join(f"{x:.1f}" for x in loads) + " (start, mid, end)"
    append_note = (
        f"{BATCH_SIZE:,} commit events per transaction, fsynced (WAL, synchronous=FULL), "
        f"median of {ours.batches} batches; CPU ms per batch: ours "
        f"{ours.batch_cpu_seconds * 1e3:.1f}, raw {raw.batch_cpu_seconds * 1e3:.1f}; {load_note}"
    )
    by_name = {r.name: r for r in replays}
    replay_, scan = by_name[REPLAY], by_name[RAW_SCAN]
    return [
        row(
            "ledger append (SQLite): Producer.commit",
            ours.rate,
            "events/s",
            "raw sqlite3 executemany into the same table",
            raw.rate,
            target=f">= {COMMIT_TARGET}",
            note=append_note,
        ),
        row(
            "ledger append (SQLite): Producer.commit vs eventsourcing",
            ours.rate,
            "events/s",
            "eventsourcing SQLiteAggregateRecorder",
            es.rate,
            note=append_note,
        ),
        row(
            f"replay of {_events_label(shape.events)} events",
            replay_.rate,
            "events/s",
            "raw sqlite3 scan of the same rows",
            scan.rate,
            target=f">= {REPLAY_TARGET}",
            note=(
                f"read + fold, checked clean; best of {sizes['repeats']}; {shape.commits:,} "
                f"commits, {shape.acks:,} acks, {shape.checkpoints:,} checkpoints; {load_note}"
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ledger",
        description="Ledger appends and replay against raw sqlite3 and eventsourcing.",
    )
    parser.add_argument(
        "--events", type=int, help=f"events in the replayed run ({_SIZES['events']:,})"
    )
    parser.add_argument(
        "--batches", type=int, help=f"append batches per contender ({_SIZES['batches']})"
    )
    parser.add_argument(
        "--batch-size", type=int, default=BATCH_SIZE, help="events per append transaction"
    )
    parser.add_argument("--repeats", type=int, help="replays per reader, the best counts (3)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a check, not a result")
    parser.add_argument("--dir", type=Path, help="where the databases go (default: a temp dir)")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--profile", action="store_true", help="also print cProfile hot spots")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    for name, default in (_QUICK if args.quick else _SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("events", "batches", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    command = " ".join(["python -m benchmarks.bench_ledger", *argv])
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_ledger_") as tmp:
        workdir = Path(tmp)
        load_before = _report.load()
        appends = bench_appends(workdir, args.batches, args.batch_size)
        shape, replays = bench_replay(workdir, args.events, args.repeats)
        body = report(
            appends,
            shape,
            replays,
            batch_size=args.batch_size,
            repeats=args.repeats,
            command=command,
            loads=(load_before, _report.load()),
        )
        print(f"## Ledger\n\n{body}")
        if args.profile:
            profile(workdir, max(1, args.batches // 4), args.batch_size)
    if args.write_docs:
        _report.write_section("Ledger", body)
        print(f"wrote the Ledger section of {_report.DOCS}")
    return body


if __name__ == "__main__":
    main()
