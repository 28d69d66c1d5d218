"""A producer's data-plane CPU per sample against the raw limit for the same bytes.

One producer emits batches of ``BATCH`` small samples (one float32 feature of
``FEATURE_BYTES``, the same pre-made tensor every time, so making features costs
nothing) through ``Producer.emit_many``: a ``SharedDirFeatureStore`` on a real
disk, a SQLite ledger file (``durability="full"``: WAL, ``synchronous=FULL``) and a
``ZmqRefSender`` to a ``ZmqRefReceiver`` in a child process, which credits every
ref it receives. The figure is the producer process's CPU time
(``time.process_time``: user and system, the fsyncs' own CPU included, not the
waits for the disk) per sample.

The raw limit, measured in the same run and in the same process, does for the same
samples what no data plane can skip: per sample, the file's bytes written to a
temporary file, fsynced and renamed into one directory, with one fsync of that
directory per batch (as the store does: its files lie in one directory; stores made
before spread them over 256 bucket directories, about 57 fsyncs for 64 samples); per batch, the
commit rows (sample id, the ref JSON as payload) inserted by one ``sqlite3``
``executemany`` into a table of the ledger's shape and indexes (the unique commit
index included) in a file of the same PRAGMAs; and the ref's JSON bytes pushed over
a raw ZeroMQ PUSH socket to a PULL in a child process. The two alternate batch by
batch (each first every other time), so that a drift in the machine's load or the
disk's pace hits both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
import torch
import zmq

from benchmarks._rows import Row, row
from benchmarks._runner import tiny
from benchmarks.bench_ledger import _INSERT, _raw_connect, _raw_schema
from benchmarks.bench_pg import _INSERT as _PG_INSERT
from benchmarks.bench_pg import _conninfo, fresh_database, postgres
from dataflow import Kind, Ledger, Producer
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from dataflow.testing import PostgresServer
from stores import SharedDirFeatureStore

BATCH = 64
FEATURE_BYTES = 16 << 10
TARGET = "<= 1.3"
WAIT_S = 120.0
ROW = "producer data-plane CPU per sample: emit_many of 64 (shared dir, {ledger}, ZeroMQ)"


def batches_per_round(*, quick: bool) -> int:
    return 2 if tiny() else 8 if quick else 40


# -- the receiving ends, in a child process ----------------------------------------------------
def _receiver_main(pipe: Any) -> None:
    with ZmqRefReceiver(ReceiverConfig(window=4 * BATCH, idle_timeout=WAIT_S)) as receiver:
        pipe.send(receiver.endpoint)
        while refs := receiver.receive(BATCH):
            receiver.credit(len(refs))


def _pull_main(pipe: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(f"tcp://127.0.0.1:{port}")
    while sock.recv() != b"":
        pass
    sock.close(0)
    ctx.term()


# -- the two contenders ------------------------------------------------------------------------
class _Ours:
    """Producer.emit_many into a shared-dir store, a ledger and a ZeroMQ stream."""

    def __init__(self, workdir: Path, endpoint: str, ledger_url: str) -> None:
        self.ledger = Ledger.open(ledger_url)
        self.store = SharedDirFeatureStore(workdir / "features")
        self.sender = ZmqRefSender(SenderConfig(endpoints=(endpoint,), send_timeout=WAIT_S))
        self.producer = Producer(
            self.ledger, self.store, run_id="bench", producer_id="p", stream=self.sender
        )

    def batch(self, ids: list[str], tensor: torch.Tensor) -> list[Any]:
        """Emit one batch; the refs it committed."""
        return self.producer.emit_many([(sid, {"x": tensor}) for sid in ids])

    def close(self) -> int:
        self.sender.close()
        self.producer.close()
        committed = self.ledger.kind_counts("bench")[Kind.COMMIT]
        self.store.close()
        self.ledger.close()
        return committed


class _Raw:
    """The same bytes as plainly as they can go: files, one executemany, raw PUSH."""

    def __init__(self, workdir: Path, endpoint: str, rows: _RawRows) -> None:
        self.tmp = workdir / "raw" / "tmp"
        self.samples = workdir / "raw" / "samples"
        self.tmp.mkdir(parents=True)
        self.samples.mkdir()
        self.rows = rows
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)

    def batch(self, ids: list[str], data: bytes, payloads: list[str]) -> None:
        for sid in ids:
            tmp = f"{self.tmp}/{sid}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, f"{self.samples}/{sid}")
        fd = os.open(self.samples, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        now = time.time()
        rows = [
            ("bench", Kind.COMMIT, sid, 0, 1, None, "p", payload, now)
            for sid, payload in zip(ids, payloads, strict=True)
        ]
        self.rows.insert(rows)
        for payload in payloads:
            self.push.send(payload.encode())

    def close(self) -> int:
        self.push.send(b"")
        self.push.close(linger=-1)
        self.ctx.term()
        return self.rows.close()


class _RawRows:
    """One executemany of a batch's commit rows in one transaction: SQLite's stdlib driver
    with a ``durability="full"`` ledger's PRAGMAs, or psycopg with synchronous commits."""

    def __init__(self, workdir: Path, postgres_url: str | None) -> None:
        self.postgres = postgres_url is not None
        if postgres_url is None:
            self.conn: Any = _raw_connect(workdir / "raw.db")
            _raw_schema(self.conn)
        else:
            self.conn = psycopg.connect(
                _conninfo(postgres_url), autocommit=True, options="-c synchronous_commit=on"
            )

    def insert(self, rows: list[tuple[Any, ...]]) -> None:
        if self.postgres:
            with self.conn.transaction(), self.conn.cursor() as cur:
                cur.executemany(_PG_INSERT, rows)
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.executemany(_INSERT, rows)
        self.conn.execute("COMMIT")

    def close(self) -> int:
        count = self.conn.execute("SELECT count(*) FROM dataflow_events").fetchone()[0]
        self.conn.close()
        return count


def measure(
    workdir: Path, *, batches: int, rounds: int = 4, postgres: tuple[str, str] | None = None
) -> dict[str, Any]:
    """CPU seconds per sample of ours and of the raw limit, over ``rounds`` alternations.

    ``postgres``: the URLs of two databases of one server, ours and the raw side's
    (None: SQLite files under ``workdir``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    ends = []
    for target in (_receiver_main, _pull_main):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(child,), daemon=True)
        process.start()
        if not parent.poll(WAIT_S):
            raise TimeoutError(f"{target.__name__} never started")
        ends.append((process, parent, parent.recv()))
    (receiver, _, stream_endpoint), (puller, _, pull_endpoint) = ends
    torch.set_num_threads(1)
    tensor = torch.randn(FEATURE_BYTES // 4)
    # About what the store writes: a header padded to 64 bytes, then the tensor.
    data = bytes(512) + tensor.numpy().tobytes()
    ours = _Ours(
        workdir,
        stream_endpoint,
        f"sqlite:///{workdir / 'ledger.db'}" if postgres is None else postgres[0],
    )
    raw = _Raw(workdir, pull_endpoint, _RawRows(workdir, None if postgres is None else postgres[1]))
    cpu = {"ours": 0.0, "raw": 0.0}
    per_round: list[float] = []
    try:
        n = 0
        payloads: list[str] = []
        for _ in range(rounds):
            spent = {"ours": 0.0, "raw": 0.0}
            for b in range(batches):
                # Batch by batch, each side first every other time: the disk's pace drifts
                # (writeback, the journal) from one second to the next, and alternating
                # blocks of batches gave rounds from 0.3x to 6.7x on ext4.
                for name in ("ours", "raw") if b % 2 == 0 else ("raw", "ours"):
                    ids = [f"s{n + i:09d}" for i in range(BATCH)]
                    n += BATCH
                    start = time.process_time()
                    if name == "ours":
                        refs = ours.batch(ids, tensor)
                        spent[name] += time.process_time() - start
                        # The raw side's rows carry the same payloads; making them is not
                        # ours to pay for.
                        payloads = [ref.to_json() for ref in refs if ref is not None]
                    else:
                        raw.batch(ids, data, payloads)
                        spent[name] += time.process_time() - start
            for name in cpu:
                cpu[name] += spent[name]
            per_round.append(spent["ours"] / spent["raw"])
    finally:
        committed, inserted = ours.close(), raw.close()
        receiver.join(WAIT_S)
        puller.join(WAIT_S)
        for process in (receiver, puller):
            if process.is_alive():
                process.kill()
                process.join()
    samples = rounds * batches * BATCH
    if committed != samples or inserted != samples:
        raise RuntimeError(f"committed {committed} and inserted {inserted}, not {samples}")
    return {
        "ours": cpu["ours"] / samples,
        "raw": cpu["raw"] / samples,
        "rounds": per_round,
        "samples": samples,
    }


def to_rows(got: dict[str, Any], *, ledger: str = "SQLite") -> list[Row]:
    rounds = ", ".join(f"{r:.2f}" for r in got["rounds"])
    executemany = "sqlite3" if ledger == "SQLite" else "psycopg"
    note = (
        f"{got['samples']:,} samples of {FEATURE_BYTES >> 10} KiB each side, in batches of "
        f"{BATCH}; CPU time of the producer process (user + system) per sample, the "
        "features made beforehand. Raw: write + fsync + rename per file into one "
        f"directory, one fsync of it per batch, one {executemany} executemany of the commit "
        "rows into the ledger's table and indexes, a raw ZeroMQ PUSH of each ref's JSON. "
        f"Ratio per round (batches alternating): {rounds}"
    )
    return [
        row(
            ROW.format(ledger=ledger),
            1e6 * got["ours"],
            "µs CPU/sample",
            f"raw files + {executemany} executemany + zmq PUSH, same bytes",
            1e6 * got["raw"],
            target=TARGET,
            note=note,
        )
    ]


def _postgres_rows(workdir: Path, batches: int) -> list[Row]:
    """The row with a PostgreSQL ledger (fsync on), on a throw-away server."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="pg_") as tmp:
        os.chmod(tmp, 0o755)  # as bench_pg: the server may run as another user
        with (
            postgres(Path(tmp)) as server,
            fresh_database(server.url) as ours,
            fresh_database(server.url) as raw,
        ):
            got = measure(workdir / "postgres", batches=batches, postgres=(ours, raw))
    return to_rows(got, ledger="PostgreSQL")


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    batches = batches_per_round(quick=quick)
    got = to_rows(measure(workdir / "sqlite", batches=batches))
    try:
        PostgresServer()  # finds the server's binaries, starts nothing
    except RuntimeError:
        return got  # no PostgreSQL here: its row is left out
    return got + _postgres_rows(workdir, batches)


if __name__ == "__main__":
    from benchmarks._runner import main

    sys.exit(main(["--only", "producer", *sys.argv[1:]]))
