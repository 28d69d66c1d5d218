"""The raw limit of the streaming end-to-end row: what producers cost the ranks' cores at best.

On a machine with as many cores as ranks, the streaming producers' CPU comes out of the
steps, and most of it is the kernel's: creating and fsyncing a 256 KiB file per sample.
To show how much of the row's overhead any data plane would pay here, the same two ranks
train from memory once more while two raw producer processes do, for the same samples
at the same pace, what no data plane can skip (as ``bench_producer``'s raw side): per
sample, the file's bytes written to a temporary file, fsynced and renamed into one
directory, one fsync of that directory per batch of ``CHUNK``; per batch, the commit rows
inserted by one ``sqlite3`` ``executemany`` (a ``durability="full"`` ledger's PRAGMAs);
each ref's JSON pushed over a raw ZeroMQ PUSH to a PULL in the parent process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from benchmarks.bench_ledger import _INSERT, _raw_connect, _raw_schema
from dataflow import Kind

# About the JSON of one of the row's refs: the pace of the raw side's sends, not their content.
_REF = (
    '{{"sample_id":"{sid}","store_uri":"dir:///bench/features","generation":{gen},'
    '"specs":{{"x":{{"shape":[64,1024],"dtype":"float32"}}}},"metadata":{{}}}}'
)


def make_raw_ledger(path: Path) -> None:
    """The raw side's ledger file: our events table and indexes, no rows."""
    conn = _raw_connect(path)
    try:
        _raw_schema(conn)
    finally:
        conn.close()


class Drain:
    """A PULL socket in the parent that receives the raw producers' refs until each has
    sent its empty end message."""

    def __init__(self, producers: int) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.received = 0
        self._producers = producers
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ended = 0
        while ended < self._producers:
            if self._pull.recv():
                self.received += 1
            else:
                ended += 1

    def close(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._pull.close(linger=0)
        self._ctx.term()


def raw_producer_main(index: int, cfg: dict[str, Any], go: Any, pace: Any) -> None:
    """Wait for ``go``, then produce this producer's samples raw, spread evenly over
    ``pace.value`` seconds (the duration of the run from memory before it)."""
    import torch

    from benchmarks.bench_e2e import CHUNK, HIDDEN, PRODUCERS, SEQ, WAIT_S

    torch.manual_seed(index)
    data = bytes(512) + torch.randn(SEQ, HIDDEN).numpy().tobytes()
    root = Path(cfg["raw_store"])
    tmp, samples = root / "tmp", root / "samples"
    for directory in (tmp, samples):
        directory.mkdir(parents=True, exist_ok=True)
    conn = _raw_connect(Path(cfg["raw_ledger"]))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(cfg["raw_endpoint"])
    mine = [f"s{i:07d}" for i in range(index, cfg["samples"], PRODUCERS)]
    batches = [mine[at : at + CHUNK] for at in range(0, len(mine), CHUNK)]
    if not go.wait(3 * WAIT_S):
        raise TimeoutError("the ranks never started the raw-limit run")
    spread = pace.value / max(1, len(batches))
    start, cpu = time.monotonic(), time.process_time()
    for k, ids in enumerate(batches):
        delay = start + k * spread - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for sid in ids:
            path = f"{tmp}/{sid}.tmp"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(path, f"{samples}/{sid}")
        fd = os.open(samples, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        now = time.time()
        payloads = [_REF.format(sid=sid, gen=time.time_ns()) for sid in ids]
        rows = [
            ("raw", Kind.COMMIT, sid, 0, 1, None, f"producer-{index}", p, now)
            for sid, p in zip(ids, payloads, strict=True)
        ]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(_INSERT, rows)
        conn.execute("COMMIT")
        for payload in payloads:
            push.send(payload.encode())
    cpu, wall = time.process_time() - cpu, time.monotonic() - start
    push.send(b"")
    push.close(linger=-1)
    ctx.term()
    conn.close()
    result = {"samples": len(mine), "cpu": cpu, "wall": wall}
    Path(cfg["out"], f"raw_producer{index}.json").write_text(json.dumps(result))
