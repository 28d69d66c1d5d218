"""The cost of a seeded streaming order (``order_seed`` with a stream) against arrival order.

Not a row of the runner's table: ``python -m benchmarks.bench_seeded_stream [--dir DIR]``
prints two comparisons, each run twice, both orders in the same sitting: leases/s once
every sample is committed (in process, SQLite, a ``MemoryStream``, two producers,
``emit_many`` of 16, leases of 64), and the wall time of a short run whose producers
differ in speed (1.5 and 4.5 ms a sample, a 10 ms step, leases of 8). docs/operations.md
("Reproducible online runs") quotes its figures.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from dataflow import Consumer, Ledger, Producer
from dataflow.streams import MemoryStream
from stores import LocalFeatureStore

_CHUNK = 16


def run(
    workdir: Path, *, seeded: bool, per_producer: int, delays: dict[str, float], step_s: float,
    batch: int,
) -> tuple[int, float]:  # fmt: skip
    """Samples leased and the seconds it took (from the producers' start, or from the
    first lease when the producers do not wait)."""
    ledger = Ledger.open(f"sqlite:///{workdir / (uuid.uuid4().hex + '.db')}")
    store = LocalFeatureStore()
    stream = MemoryStream(window=4 * per_producer, expected_producers=2)
    order = {"order_seed": 7, "producers": ["p0", "p1"]} if seeded else {}
    rank = Consumer(
        ledger, store, run_id="r", consumer_id="rank0", stream=stream.receiver(), **order
    )
    rank.resume("latest")

    def produce(name: str) -> None:
        producer = Producer(ledger, store, run_id="r", producer_id=name, stream=stream.sender(name))
        for k in range(0, per_producer, _CHUNK):
            time.sleep(delays[name] * _CHUNK)
            producer.emit_many([(f"{name}-{k + j}", {"x": torch.zeros(2)}) for j in range(_CHUNK)])
        producer.close()

    threads = [threading.Thread(target=produce, args=(name,)) for name in ("p0", "p1")]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if not any(delays.values()):  # everything committed first: time the leases alone
        for thread in threads:
            thread.join()
        start = time.perf_counter()
    leased, step = 0, 0
    while not rank.drained:
        ids = [ref.sample_id for ref in rank.lease(batch, timeout=10)]
        if ids:
            step += 1
            leased += len(ids)
            rank.ack(ids, step=step)
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    for thread in threads:
        thread.join()
    ledger.close()
    store.close()
    return leased, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the ledgers go")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)
        for seeded in (False, True, False, True):
            n, s = run(workdir, seeded=seeded, per_producer=3008, delays={"p0": 0, "p1": 0},
                       step_s=0, batch=64)  # fmt: skip
            name = "seeded " if seeded else "arrival"
            print(f"{name}: {n} committed samples leased, {n / s:,.0f}/s")
        for seeded in (False, True, False, True):
            n, s = run(workdir, seeded=seeded, per_producer=400,
                       delays={"p0": 0.0015, "p1": 0.0045}, step_s=0.01, batch=8)  # fmt: skip
            print(
                f"{'seeded ' if seeded else 'arrival'}: unequal producers, {n} samples: {s:.2f} s"
            )


if __name__ == "__main__":
    main()
