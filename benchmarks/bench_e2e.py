"""End to end: samples/s through the whole data plane against the same trainer fed from memory.

Two producer processes emit samples (one 256 KiB float32 feature each, the same
pre-made tensor every time, so producing costs only the data plane) into a
``SharedDirFeatureStore`` on a real disk, commit them to a SQLite ledger file
and push the refs over ZeroMQ streams to two trainer ranks, in ``emit_many``
batches of 16 as a producer batches (one ``put_many``, one transaction, one
``send_many`` each). Each rank is a real
process in a gloo group running ``training.Trainer``: a ``FeatureLoader``
leasing from its stream eight batches at a time in a thread (one ledger write for
the lease of eight batches and the acks of the eight steps before it), a step of
fixed compute (a 1024x1024 linear layer over a batch of 4 samples of 64x1024,
forward and backward, 12-25 ms on one idle core, by the VM), gradients all-reduced by
hand, acks at every optimizer step.

A second measurement shows the trainer's side alone: the same two producer
processes commit every sample first (no stream), as producers on machines of
their own would have, and the ranks, started after them (and after a ``sync``,
so that the producers' writeback takes no CPU from them), lease the committed
dataset from the ledger through the same Trainer and loader. On a machine with
as many cores as ranks, the streaming run's producers take their CPU from the
steps; this measurement shows what the data plane costs the training loop itself.

The peer is the same two ranks, in the same processes, running the same step
and optimizer functions over a dataset held in memory, a fresh pre-made batch
each step: no ledger, store, stream or loader. Every data-plane run is compared
with the mean of a run from memory just before and one just after it, so that
a drift in the machine's load hits both sides. The trainer side, whose ratio is
the one the target is about, takes ``ROUNDS`` such rounds (the samples split
into as many runs of the ledger, trained one after the other) and reports the
round of the median ratio: on a shared 2-core VM the compute alone drifts by
10% or more from one run to the next. Each run is timed from its first step to its last
optimizer step on either rank; in the streaming run the producers start with
the ranks and run ahead by the credit window.

The ratio (ours / from memory) is one minus the data plane's overhead; the
target is an overhead under 5% of the step time on the trainer side, and under
15% streaming on a machine with as many cores as ranks (the producers' CPU, which
``bench_producer`` measures against its raw limit, then comes out of the steps).
The row's note says where the rest went: the ranks' time waiting for a batch
(the producers or the loader not keeping up), acking, and the compute itself
slowing down (the producers' and the loader's threads take CPU from the steps on
a machine with as many cores as ranks).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._e2e_raw import Drain, make_raw_ledger, raw_producer_main
from benchmarks._rows import Row, row
from benchmarks._runner import tiny
from dataflow.live._ports import loopback_port

SEQ, HIDDEN = 64, 1024
BATCH = 4
WINDOW = 64
# Samples per emit_many, as a producer batches: one put_many (one directory fsync), one
# ledger transaction, one send_many; a quarter of a rank's credit window.
CHUNK = 16
# Batches per lease ahead: one lease-and-ack transaction every 8 steps. On 2 cores, where
# the loader's thread shares the rank's core, 8 took the trainer side from 0.945-0.955x
# (prefetch=4) to 0.970-0.987x (2026-11-27, means of 30 rounds each, alternated).
PREFETCH = 8
RANKS = PRODUCERS = 2
# Of the trainer-side run: memory, data plane, memory, ... (see to_rows); each round trains
# a tenth of the streaming run's samples (30 steps a rank).
ROUNDS = 20
WAIT_S = 600.0
TARGET = ">= 0.95"  # the trainer side (producers on cores of their own)
# Streaming on 2 shared cores: the producers' data-plane CPU comes out of the ranks' steps
# (that CPU has its own row and target, benchmarks/bench_producer.py).
STREAMING_TARGET = ">= 0.85"
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
    """Samples of the streaming data-plane run (the memory runs train as many)."""
    if tiny():
        return 4 * RANKS * BATCH
    return (60 if quick else 300) * RANKS * BATCH


def committed_count(*, quick: bool) -> int:
    """Samples of the trainer-side measurement: ``ROUNDS`` rounds of a tenth of the
    streaming run's samples each."""
    return sample_count(quick=quick) // 10 * ROUNDS


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
def _rank_main(
    rank: int, cfg: dict[str, Any], go: Any, raw_go: Any = None, pace: Any = None
) -> None:
    import torch
    import torch.distributed as dist

    from dataflow.live._collectives import join_loopback_gloo

    torch.set_num_threads(1)
    join_loopback_gloo(rank, RANKS, cfg["port"], timeout_s=WAIT_S)
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

    def from_memory(steps: int, raw: bool = False) -> dict[str, Any]:
        clocks.clear()
        compute = clocks["compute"] = _Clock()
        reduce = clocks["optimizer"] = _Clock()
        run_step, run_optimizer = compute.wrap(step), reduce.wrap(optimizer_step)
        dist.barrier()
        if raw and rank == 0:
            raw_go.set()  # the raw producers start now, paced over the last run's time
        cpu = time.process_time()
        for i in range(steps):
            run_step(dataset[i])
            run_optimizer(i + 1)
        return _timings(clocks, steps * BATCH, reduce.last_cpu - cpu)

    def data_plane(run_id: str) -> dict[str, Any]:
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
            run_id=run_id,
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
            checkpoints=CheckpointManager(CheckpointConfig(root=Path(cfg["checkpoints"], run_id))),
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
    # A batch the cache still holds would flatter the reference: a trainer fed from memory
    # reads a fresh batch every step, as the data plane's loader hands it one.
    dataset = torch.randn(steps, BATCH, SEQ, HIDDEN)
    result: dict[str, list[dict[str, Any]]] = {"memory": [from_memory(steps)], "data_plane": []}
    for run_id in cfg["runs"]:
        result["data_plane"].append(data_plane(run_id))
        result["memory"].append(from_memory(steps))
    if raw_go is not None:  # the raw limit (benchmarks._e2e_raw), streaming only
        last = result["memory"][-1]
        if rank == 0:
            pace.value = last["end"] - last["start"]
        result["raw"] = [from_memory(steps, raw=True)]
        result["memory"].append(from_memory(steps))
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
    mine = [f"s{i:07d}" for i in range(index, cfg["samples"], PRODUCERS)]
    if sender is not None and not go.wait(WAIT_S):
        raise TimeoutError("the ranks never started the data-plane run")
    start, cpu = time.monotonic(), time.process_time()
    for run_id in cfg["runs"]:  # streaming: one run
        producer = Producer(ledger, store, run_id=run_id, producer_id=producer_id, stream=sender)
        for at in range(0, len(mine), CHUNK):
            producer.emit_many([(f"{run_id}-{sid}", {"x": x}) for sid in mine[at : at + CHUNK]])
        # The stream ends before the ledger records the close (as in dataflow.demo): once
        # the ranks acknowledged the EOF, every ref sent before it has reached them.
        if sender is not None:
            sender.close()
        producer.close()
    cpu, wall = time.process_time() - cpu, time.monotonic() - start
    result = {"samples": len(mine) * len(cfg["runs"]), "cpu": cpu, "wall": wall}
    Path(cfg["out"], f"producer{index}.json").write_text(json.dumps(result))
    store.close()
    ledger.close()


# -- the parent --------------------------------------------------------------------------------
def measure(
    workdir: Path,
    samples: int,
    *,
    streaming: bool = True,
    rounds: int = 1,
    durability: str = "full",
    profile: Path | None = None,
) -> dict[str, Any]:
    """Run the ranks and producers once; what each process reported.

    ``streaming``: the producers stream refs to the ranks while they train (on the
    ranks' cores); else they commit every sample first and the ranks, started after
    them, lease the committed dataset from the ledger (producers on other machines).
    ``rounds`` (committed only): the ``samples`` go into as many runs, which the ranks
    train one after the other, each between two runs from memory (see :func:`to_rows`).
    ``durability``: the ranks' ledger handle's (``"normal"``, leases and acks not
    fsynced, shows what the fsyncs cost); ``profile``: where rank 0 writes a cProfile
    of its data-plane run (its main thread only).
    """
    if streaming and rounds != 1:
        raise ValueError(f"a streaming measurement has one round, not {rounds}")
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    out.mkdir()
    cfg = {
        "port": loopback_port(),
        "endpoints": [f"tcp://127.0.0.1:{loopback_port()}" for _ in range(RANKS)],
        "ledger": f"sqlite:///{workdir / 'ledger.db'}",
        "store": str(workdir / "features"),
        "checkpoints": str(workdir / "ckpt"),
        "out": str(out),
        "samples": max(samples // rounds // (RANKS * BATCH), 1) * RANKS * BATCH,
        "runs": [f"e2e-{k}" for k in range(rounds)],
        "streaming": streaming,
        "durability": durability,
        "profile": None if profile is None else str(profile),
    }
    # One fork server imports torch and the data plane once for the four processes: four
    # imports at once would take a loaded 2-core machine a minute.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    go = ctx.Event()
    raw_go, pace, drain, raw = None, None, None, []
    if streaming:  # and then the raw limit, beside the ranks fed from memory
        raw_go, pace, drain = ctx.Event(), ctx.Value("d", 0.0), Drain(PRODUCERS)
        cfg.update(
            raw_store=str(workdir / "raw"),
            raw_ledger=str(workdir / "raw.db"),
            raw_endpoint=drain.endpoint,
        )
        make_raw_ledger(workdir / "raw.db")
        raw = [
            ctx.Process(target=raw_producer_main, args=(p, cfg, raw_go, pace))
            for p in range(PRODUCERS)
        ]
    ranks = [ctx.Process(target=_rank_main, args=(r, cfg, go, raw_go, pace)) for r in range(RANKS)]
    producers = [ctx.Process(target=_producer_main, args=(p, cfg, go)) for p in range(PRODUCERS)]
    processes = ranks + producers + raw
    try:
        for process in raw:
            process.start()
        for process in producers:
            process.start()
        if not streaming:  # the dataset is committed before the ranks start
            for process in producers:
                process.join(WAIT_S)
            os.sync()  # their writeback would take CPU from the first run from memory
        for process in ranks:
            process.start()
        for process in processes:
            process.join(WAIT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        if drain is not None:
            drain.close(WAIT_S if all(p.exitcode == 0 for p in processes) else 0)
    codes = [p.exitcode for p in processes]
    if codes != [0] * len(processes):
        raise RuntimeError(
            f"an end-to-end process failed: exit codes {codes} (ranks, producers, raw producers)"
        )
    return {
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)],
        "producers": [
            json.loads((out / f"producer{p}.json").read_text()) for p in range(PRODUCERS)
        ],
        "raw_producers": [
            json.loads((out / f"raw_producer{p}.json").read_text()) for p in range(len(raw))
        ],
    }


def _rate(runs: list[dict[str, Any]]) -> float:
    """Samples/s of one phase over the ranks (``runs``: each rank's timings of it)."""
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return sum(r["samples"] for r in runs) / wall


def _per_step_ms(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(1000 * r[key] / max(1, r["steps"]) for r in runs)


def _wall_per_step_ms(runs: list[dict[str, Any]]) -> float:
    return statistics.fmean(1000 * (r["end"] - r["start"]) / r["steps"] for r in runs)


STREAMING_ROW = "end to end: 2 producers, store, ledger, streams, loader, 2 gloo ranks"
RAW_ROW = "end to end, the raw limit: 2 raw producers of the same bytes beside 2 ranks from memory"
COMMITTED_ROW = "end to end, trainer side: committed dataset, store, ledger, loader, 2 gloo ranks"


def to_rows(got: dict[str, Any], *, streaming: bool = True) -> list[Row]:
    """The row of one :func:`measure`.

    Each data-plane run is compared with the mean of the runs from memory just
    before and just after it, so that a drift in the machine's load hits both
    sides; with several rounds the row gives the round of the median ratio, and
    its note every round's ratio.
    """
    ranks, producers = got["ranks"], got["producers"]

    def phase(name: str, k: int) -> list[dict[str, Any]]:
        return [r[name][k] for r in ranks]

    ratios = []
    for k in range(len(ranks[0]["data_plane"])):
        memory = (_rate(phase("memory", k)) + _rate(phase("memory", k + 1))) / 2
        ratios.append(_rate(phase("data_plane", k)) / memory)
    k = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    data, before, after = phase("data_plane", k), phase("memory", k), phase("memory", k + 1)
    ours, memory = _rate(data), (_rate(before) + _rate(after)) / 2
    produced = sum(p["samples"] for p in producers)
    producer_cpu = 1000 * sum(p["cpu"] for p in producers) / produced
    producer_rate = produced / max(p["wall"] for p in producers)
    per_step = {
        key: _per_step_ms(data, f"{key}_s")
        for key in ("compute", "batches", "leases", "acks", "optimizer", "ahead_cpu")
    }
    trained = sum(r["samples"] for r in data)
    samples = sum(r["samples"] for rank in ranks for r in rank["data_plane"])
    rounds = (
        f"; rounds of {trained:,} samples, each against the runs from memory before and after "
        f"it: {', '.join(f'{r:.3f}' for r in ratios)}, the median's figures follow"
        if len(ratios) > 1
        else ""
    )
    note = (
        f"overhead {1 - ours / memory:.1%} ({samples:,} samples of 256 KiB{rounds}; memory runs "
        f"before and after: {_rate(before):,.0f} and {_rate(after):,.0f} samples/s). "
        f"Per optimizer step and rank: {_wall_per_step_ms(data):.1f} ms (from memory: "
        f"{_wall_per_step_ms(before):.1f}), of which compute {per_step['compute']:.1f} ms "
        f"(from memory: {_per_step_ms(before, 'compute_s'):.1f}), "
        f"waiting for the batch {per_step['batches']:.1f} ms, leases and the acks they carry "
        f"(ledger writes, in the loader's thread) {per_step['leases']:.1f} ms, acks alone "
        f"{per_step['acks']:.1f} ms, the loader's thread {per_step['ahead_cpu']:.2f} ms of CPU "
        "(lease, acks, reads), "
        f"gradient all-reduce + optimizer {per_step['optimizer']:.1f} ms (from memory: "
        f"{_per_step_ms(before, 'optimizer_s'):.1f}); rank CPU to its last step "
        f"{_per_step_ms(data, 'cpu'):.1f} ms (from memory: {_per_step_ms(before, 'cpu'):.1f}). "
        f"Producers: {producer_cpu:.2f} CPU ms per sample, {producer_rate:,.0f} samples/s "
        + (
            "while throttled by the credit window, "
            + ("on the ranks' cores" if (os.cpu_count() or 1) <= RANKS else "beside the ranks")
            if streaming
            else "before the ranks started (as on machines of their own)"
        )
    )
    raw = _raw_row(got, phase) if "raw" in ranks[0] else None
    if raw is not None and raw.ratio:
        note += (
            f". The raw limit on this machine (the next row) is {raw.ratio:.3f}x; ours against "
            f"it: {ours / memory / raw.ratio:.3f}x"
        )
    main = row(
        STREAMING_ROW if streaming else COMMITTED_ROW,
        ours,
        "samples/s",
        "the same 2 ranks fed from memory",
        memory,
        target=STREAMING_TARGET if streaming else TARGET,
        note=note,
    )
    return [main] if raw is None else [main, raw]


def _raw_row(got: dict[str, Any], phase: Callable[[str, int], list[dict[str, Any]]]) -> Row:
    """The raw limit of the streaming row (:mod:`benchmarks._e2e_raw`): the ranks fed from
    memory beside raw producers of the same samples, against the runs from memory just
    before and after."""
    runs = len(got["ranks"][0]["memory"])
    before, after = phase("memory", runs - 2), phase("memory", runs - 1)
    memory = (_rate(before) + _rate(after)) / 2
    raw = _rate(phase("raw", 0))
    producers = got["raw_producers"]
    cpu = 1000 * sum(p["cpu"] for p in producers) / sum(p["samples"] for p in producers)
    return row(
        RAW_ROW,
        raw,
        "samples/s",
        "the same 2 ranks fed from memory",
        memory,
        note=(
            f"overhead {1 - raw / memory:.1%}: what producers cost the ranks' cores here at "
            "best. Raw producers: per sample write + fsync + rename of the same 256 KiB into "
            "one directory, one fsync of it per batch of 16, one sqlite3 executemany of the "
            f"batch's commit rows, a raw ZeroMQ PUSH of each ref's JSON; {cpu:.2f} CPU ms per "
            "sample, paced over the time of the run from memory before (as ours run ahead of "
            f"the ranks by the credit window); memory runs before and after: {_rate(before):,.0f}"
            f" and {_rate(after):,.0f} samples/s"
        ),
    )


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    committed = measure(
        workdir / "committed", committed_count(quick=quick), streaming=False, rounds=ROUNDS
    )
    streaming = measure(workdir / "streaming", sample_count(quick=quick))
    return [
        *to_rows(committed, streaming=False),
        *to_rows(streaming),
    ]


if __name__ == "__main__":
    from benchmarks._runner import main

    sys.exit(main(["--only", "e2e", *sys.argv[1:]]))
