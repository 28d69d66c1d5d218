"""End to end: samples/s through the whole data plane against the same trainer fed from memory.

Two producer processes emit samples (one 256 KiB float32 feature each, the same
pre-made tensor every time, so producing costs only the data plane) into a
``SharedDirFeatureStore`` on a real disk, commit them to a SQLite ledger file
and push the refs over ZeroMQ streams to two trainer ranks. Each rank is a real
process in a gloo group running ``training.Trainer``: a ``FeatureLoader``
leasing from its stream four batches at a time in a thread (one ledger write for
the lease of four batches, one for the acks of four steps), a step of
fixed compute (a 1024x1024 linear layer over a batch of 4 samples of 64x1024,
forward and backward, about 25 ms on one idle core), gradients all-reduced by
hand, acks at every optimizer step.

A second run measures the trainer's side alone: the same two producer processes
commit every sample first (no stream), as producers on machines of their own would
have, and the ranks, started after them, lease the committed dataset from the
ledger through the same Trainer and loader. On a machine with as many cores as
ranks, the streaming run's producers take their CPU from the steps; this run shows
what the data plane costs the training loop itself.

The peer is the same two ranks, in the same processes, running the same step
and optimizer functions over a pre-made batch in memory: no ledger, store,
stream or loader. It runs once before and once after the data plane (their
mean is the reference, so a drift in the machine's load hits both sides).
Each run is timed from its first step to its last optimizer step on either
rank; the producers start with the ranks and run ahead by the credit window.

The ratio (ours / from memory) is one minus the data plane's overhead; the
target is an overhead under 5% of the step time. The row's note says where the
rest went: the ranks' time waiting for a batch (the producers or the loader
not keeping up), acking, and the compute itself slowing down (the producers'
and the loader's threads take CPU from the steps on a machine with as many
cores as ranks).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks._rows import Row, row
from benchmarks._runner import tiny

SEQ, HIDDEN = 64, 1024
BATCH = 4
WINDOW = 64
CHUNK = 8  # samples per emit_many: one ledger transaction
PREFETCH = 4  # batches per lease ahead: one lease and one ack transaction per 4 steps
RANKS = PRODUCERS = 2
RUN_ID = "e2e"
WAIT_S = 600.0
TARGET = ">= 0.95"
_PRELOAD = [
    "torch",
    "torch.distributed",
    "dataflow",
    "dataflow.streams",
    "stores",
    "training",
    "benchmarks.bench_e2e",
]


def sample_count(*, quick: bool) -> int:
    """Samples of the data-plane run (the memory runs train as many)."""
    if tiny():
        return 4 * RANKS * BATCH
    return (60 if quick else 300) * RANKS * BATCH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Clock:
    """Seconds spent inside the wrapped calls (and the CPU seconds of the thread that made
    them), when the first began and the last ended, and the process's CPU time then.

    A wrapped call inside another of the same clock (``ack_and_lease`` falling back to
    ``lease``) is counted once, as part of the outer one.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.thread_cpu = 0.0
        self.calls = 0
        self.first: float | None = None
        self.last = 0.0
        self.last_cpu = 0.0
        self._inside = threading.local()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "call", False):
                return fn(*args, **kwargs)
            self._inside.call = True
            start, cpu = time.monotonic(), time.thread_time()
            if self.first is None:
                self.first = start
            try:
                return fn(*args, **kwargs)
            finally:
                self.last = time.monotonic()
                self.last_cpu = time.process_time()
                self.seconds += self.last - start
                self.thread_cpu += time.thread_time() - cpu
                self.calls += 1
                self._inside.call = False

        return timed


# -- the rank processes ----------------------------------------------------------------------
def _rank_main(rank: int, cfg: dict[str, Any], go: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=RANKS,
        timeout=timedelta(seconds=WAIT_S),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    clocks: dict[str, _Clock] = {}

    def step(x: torch.Tensor) -> None:
        if len(x):
            torch.tanh(model(x)).pow(2).mean().backward()

    def optimizer_step(_step: int) -> None:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()

    def from_memory(steps: int) -> dict[str, Any]:
        clocks.clear()
        compute = clocks["compute"] = _Clock()
        reduce = clocks["optimizer"] = _Clock()
        x = torch.randn(BATCH, SEQ, HIDDEN)
        run_step, run_optimizer = compute.wrap(step), reduce.wrap(optimizer_step)
        dist.barrier()
        cpu = time.process_time()
        for i in range(steps):
            run_step(x)
            run_optimizer(i + 1)
        return _timings(clocks, steps * BATCH, reduce.last_cpu - cpu)

    def data_plane() -> dict[str, Any]:
        from dataflow import Consumer, Ledger
        from dataflow.streams import ReceiverConfig, ZmqRefReceiver
        from stores import SharedDirFeatureStore
        from training import CheckpointConfig, CheckpointManager, LoaderConfig, Trainer

        clocks.clear()
        compute = clocks["compute"] = _Clock()
        reduce = clocks["optimizer"] = _Clock()
        receiver = (
            ZmqRefReceiver(
                ReceiverConfig(
                    endpoint=cfg["endpoints"][rank], window=WINDOW, expected_producers=PRODUCERS
                )
            )
            if cfg["streaming"]
            else None
        )
        consumer = Consumer(
            Ledger.open(cfg["ledger"], durability=cfg["durability"]),
            SharedDirFeatureStore(cfg["store"]),
            run_id=RUN_ID,
            consumer_id=f"rank{rank}",
            rank=rank,
            world_size=RANKS,
            stream=receiver,
        )
        trained = 0

        def step_fn(batch: Any) -> None:
            nonlocal trained
            trained += len(batch)
            step(batch.features["x"] if len(batch) else torch.zeros(0, SEQ, HIDDEN))

        trainer = Trainer(
            consumer,
            step_fn=compute.wrap(step_fn),
            optimizer_fn=reduce.wrap(optimizer_step),
            checkpoints=CheckpointManager(CheckpointConfig(root=cfg["checkpoints"])),
            state_fn=lambda: {"model": model.state_dict()},
            loader_config=LoaderConfig(batch_size=BATCH, prefetch=PREFETCH),
        )
        trainer.resume()  # from scratch; not timed
        loader = clocks["batches"] = _Clock()
        trainer.loader.next_batch = loader.wrap(trainer.loader.next_batch)  # type: ignore[method-assign]
        acks = clocks["acks"] = _Clock()
        consumer.ack_many = acks.wrap(consumer.ack_many)  # type: ignore[method-assign]
        leases = clocks["leases"] = _Clock()
        consumer.lease = leases.wrap(consumer.lease)  # type: ignore[method-assign]
        consumer.ack_and_lease = leases.wrap(consumer.ack_and_lease)  # type: ignore[method-assign]
        ahead = clocks["ahead"] = _Clock()  # the loader's thread: lease, acks, reads
        loader_ahead = trainer.loader._lease_and_read
        trainer.loader._lease_and_read = ahead.wrap(loader_ahead)  # type: ignore[method-assign]
        dist.barrier()
        if rank == 0:
            go.set()  # the producers start now, and run ahead by the credit window
        cpu = time.process_time()
        if cfg["profile"] and rank == 0:
            import cProfile

            cProfile.runctx("trainer.run()", globals(), {"trainer": trainer}, cfg["profile"])
        else:
            trainer.run()
        cpu = reduce.last_cpu - cpu  # to the last optimizer step, as the wall time
        consumer.close()
        return _timings(clocks, trained, cpu)

    steps = cfg["samples"] // (RANKS * BATCH)
    result = {
        "memory_before": from_memory(steps),
        "data_plane": data_plane(),
        "memory_after": from_memory(steps),
    }
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # neither rank tears its group down while the other still talks to it
    dist.destroy_process_group()


def _timings(clocks: dict[str, _Clock], samples: int, cpu: float) -> dict[str, Any]:
    compute, reduce = clocks["compute"], clocks["optimizer"]
    return {
        "start": compute.first,
        "end": reduce.last,
        "samples": samples,
        "cpu": cpu,
        "steps": reduce.calls,
        **{f"{name}_s": clock.seconds for name, clock in clocks.items()},
        **{f"{name}_cpu_s": clock.thread_cpu for name, clock in clocks.items()},
    }


# -- the producer processes ------------------------------------------------------------------
def _producer_main(index: int, cfg: dict[str, Any], go: Any) -> None:
    import torch

    from dataflow import Ledger, Producer
    from dataflow.streams import SenderConfig, ZmqRefSender
    from stores import SharedDirFeatureStore

    torch.set_num_threads(1)
    x = torch.randn(SEQ, HIDDEN)
    ledger = Ledger.open(cfg["ledger"])
    store = SharedDirFeatureStore(cfg["store"])
    producer_id = f"producer-{index}"
    sender = (
        ZmqRefSender(
            SenderConfig(
                endpoints=tuple(cfg["endpoints"]), producer_id=producer_id, send_timeout=WAIT_S
            )
        )
        if cfg["streaming"]
        else None
    )
    producer = Producer(ledger, store, run_id=RUN_ID, producer_id=producer_id, stream=sender)
    mine = [f"s{i:07d}" for i in range(index, cfg["samples"], PRODUCERS)]
    if sender is not None and not go.wait(WAIT_S):
        raise TimeoutError("the ranks never started the data-plane run")
    start, cpu = time.monotonic(), time.process_time()
    for at in range(0, len(mine), CHUNK):
        producer.emit_many([(sid, {"x": x}) for sid in mine[at : at + CHUNK]])
    # The stream ends before the ledger records the close (as in dataflow.demo): once the
    # ranks acknowledged the EOF, every ref sent before it has reached them.
    if sender is not None:
        sender.close()
    producer.close()
    cpu, wall = time.process_time() - cpu, time.monotonic() - start
    result = {"samples": len(mine), "cpu": cpu, "wall": wall}
    Path(cfg["out"], f"producer{index}.json").write_text(json.dumps(result))
    store.close()
    ledger.close()


# -- the parent --------------------------------------------------------------------------------
def measure(
    workdir: Path,
    samples: int,
    *,
    streaming: bool = True,
    durability: str = "full",
    profile: Path | None = None,
) -> dict[str, Any]:
    """Run the ranks and producers once; what each process reported.

    ``streaming``: the producers stream refs to the ranks while they train (on the
    ranks' cores); else they commit every sample first and the ranks, started after
    them, lease the committed dataset from the ledger (producers on other machines).
    ``durability``: the ranks' ledger handle's (``"normal"``, leases and acks not
    fsynced, shows what the fsyncs cost); ``profile``: where rank 0 writes a cProfile
    of its data-plane run (its main thread only).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    out.mkdir()
    cfg = {
        "port": _free_port(),
        "endpoints": [f"tcp://127.0.0.1:{_free_port()}" for _ in range(RANKS)],
        "ledger": f"sqlite:///{workdir / 'ledger.db'}",
        "store": str(workdir / "features"),
        "checkpoints": str(workdir / "ckpt"),
        "out": str(out),
        "samples": samples,
        "streaming": streaming,
        "durability": durability,
        "profile": None if profile is None else str(profile),
    }
    # One fork server imports torch and the data plane once for the four processes: four
    # imports at once would take a loaded 2-core machine a minute.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    go = ctx.Event()
    ranks = [ctx.Process(target=_rank_main, args=(r, cfg, go)) for r in range(RANKS)]
    producers = [ctx.Process(target=_producer_main, args=(p, cfg, go)) for p in range(PRODUCERS)]
    processes = ranks + producers
    try:
        for process in producers:
            process.start()
        if not streaming:  # the dataset is committed before the ranks start
            for process in producers:
                process.join(WAIT_S)
        for process in ranks:
            process.start()
        for process in processes:
            process.join(WAIT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    codes = [p.exitcode for p in processes]
    if codes != [0] * len(processes):
        raise RuntimeError(f"an end-to-end process failed: exit codes {codes} (ranks, producers)")
    return {
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)],
        "producers": [
            json.loads((out / f"producer{p}.json").read_text()) for p in range(PRODUCERS)
        ],
    }


def _rate(ranks: list[dict[str, Any]], phase: str) -> float:
    runs = [r[phase] for r in ranks]
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return sum(r["samples"] for r in runs) / wall


def _per_step_ms(ranks: list[dict[str, Any]], phase: str, key: str) -> float:
    return statistics.fmean(1000 * r[phase][key] / max(1, r[phase]["steps"]) for r in ranks)


STREAMING_ROW = "end to end: 2 producers, store, ledger, streams, loader, 2 gloo ranks"
COMMITTED_ROW = "end to end, trainer side: committed dataset, store, ledger, loader, 2 gloo ranks"


def to_rows(got: dict[str, Any], samples: int, *, streaming: bool = True) -> list[Row]:
    ranks, producers = got["ranks"], got["producers"]
    ours = _rate(ranks, "data_plane")
    before, after = _rate(ranks, "memory_before"), _rate(ranks, "memory_after")
    memory = (before + after) / 2
    step = {p: _per_step_ms(ranks, p, "compute_s") for p in ("memory_before", "data_plane")}
    wall = {
        p: statistics.fmean(1000 * (r[p]["end"] - r[p]["start"]) / r[p]["steps"] for r in ranks)
        for p in ("memory_before", "data_plane")
    }
    produced = sum(p["samples"] for p in producers)
    producer_cpu = 1000 * sum(p["cpu"] for p in producers) / produced
    producer_rate = produced / max(p["wall"] for p in producers)
    per_step = {
        key: _per_step_ms(ranks, "data_plane", f"{key}_s")
        for key in ("batches", "leases", "acks", "optimizer", "ahead_cpu")
    }
    note = (
        f"overhead {1 - ours / memory:.1%} ({samples:,} samples of 256 KiB; memory runs before "
        f"and after: {before:,.0f} and {after:,.0f} samples/s). Per optimizer step and rank: "
        f"{wall['data_plane']:.1f} ms (from memory: {wall['memory_before']:.1f}), of which "
        f"compute {step['data_plane']:.1f} ms (from memory: {step['memory_before']:.1f}), "
        f"waiting for the batch {per_step['batches']:.1f} ms, leases and the acks they carry "
        f"(ledger writes, in the loader's thread) {per_step['leases']:.1f} ms, acks alone "
        f"{per_step['acks']:.1f} ms, the loader's thread {per_step['ahead_cpu']:.2f} ms of CPU "
        "(lease, acks, reads), "
        f"gradient all-reduce + optimizer {per_step['optimizer']:.1f} ms (from memory: "
        f"{_per_step_ms(ranks, 'memory_before', 'optimizer_s'):.1f}); rank CPU to its last step "
        f"{_per_step_ms(ranks, 'data_plane', 'cpu'):.1f} ms (from memory: "
        f"{_per_step_ms(ranks, 'memory_before', 'cpu'):.1f}). Producers: "
        f"{producer_cpu:.2f} CPU ms per sample, {producer_rate:,.0f} samples/s "
        + (
            "while throttled by the credit window, on the ranks' cores"
            if streaming
            else "before the ranks started (as on machines of their own)"
        )
    )
    return [
        row(
            STREAMING_ROW if streaming else COMMITTED_ROW,
            ours,
            "samples/s",
            "the same 2 ranks fed from memory",
            memory,
            target=TARGET,
            note=note,
        )
    ]


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    samples = sample_count(quick=quick)
    committed = measure(workdir / "committed", samples, streaming=False)
    streaming = measure(workdir / "streaming", samples)
    return [
        *to_rows(committed, samples, streaming=False),
        *to_rows(streaming, samples),
    ]


if __name__ == "__main__":
    from benchmarks._runner import main

    sys.exit(main(["--only", "e2e", *sys.argv[1:]]))
