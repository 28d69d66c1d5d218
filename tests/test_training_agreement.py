"""Two gloo DDP ranks agree on their number of micro-batches: once for a committed dataset,
per micro-batch only while a stream can still grow, and never leaving a rank alone in a
collective when the shares are uneven.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, init_gloo, join, rank_consumer, run_args

from dataflow import Kind, Ledger, Producer, replay
from stores import SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

RUN = "run"


def _sample_id(i: int) -> str:
    return f"s{i:03d}"


def _features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([i % 5, i % 3, 1], dtype=torch.float64)}


def _produce(args: dict[str, Any]) -> None:
    led = Ledger.open(args["ledger"])
    producer = Producer(led, SharedDirFeatureStore(args["features"]), run_id=RUN)
    for i in range(args["samples"]):
        producer.emit(_sample_id(i), _features(i))
        if args["live_producer"] and i == 3:
            # Keep the stream open until the ranks train: they must see it grow.
            deadline = time.monotonic() + 60
            while not any(e.kind == Kind.LEASE for e in led.events(RUN)):
                assert time.monotonic() < deadline, "the ranks never trained"
                time.sleep(0.05)
        time.sleep(args["emit_pause_s"])
    producer.close()


def _train(rank: int, args: dict[str, Any]) -> None:
    import os

    from torch.nn.parallel import DistributedDataParallel

    init_gloo(rank, args["port"])
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=2**-8)
    sizes: list[int] = []

    def step_fn(batch: Batch) -> None:
        x = batch.features["x"] if len(batch) else torch.zeros(0, 3, dtype=torch.float64)
        ddp(x).pow(2).sum().backward()
        sizes.append(len(batch))

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    consumer = rank_consumer(args, rank, run_id=RUN, order_seed=args["order_seed"])
    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
        state_fn=lambda: {"model": model.state_dict()},
        config=TrainerConfig(grad_accum=2, checkpoint_every=0),
        loader_config=LoaderConfig(batch_size=args["batch_size"]),
        modules=[ddp],
    )
    step = trainer.run()
    result = {"step": step, "sizes": sizes, "agreements": trainer.agreements}
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/test_training_resume_ranks.py: no DDP teardown at exit


def _run(tmp_path: Path, **overrides: Any) -> list[dict[str, Any]]:
    defaults = {
        "samples": 11,
        "emit_pause_s": 0.0,
        "batch_size": 1,
        "order_seed": None,
        "live_producer": False,
    }
    args = run_args(tmp_path, **{**defaults, **overrides})
    producer = start(_produce, args) if args["live_producer"] else None
    if producer is None:
        _produce(args)
    ranks = [start(_train, rank, args) for rank in range(2)]
    assert [join(p) for p in ranks] == [0, 0]
    if producer is not None:
        assert join(producer) == 0
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
        assert run.verify() == []
        assert sorted(run.trained) == [_sample_id(i) for i in range(args["samples"])]
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_a_committed_dataset_with_uneven_shares_needs_one_agreement(tmp_path: Path) -> None:
    # 11 samples in a seeded order: rank 0 owns 6, rank 1 owns 5. One collective settles
    # 6 micro-batches each (3 steps); rank 1 trains an empty one instead of leaving rank 0
    # alone in DDP's gradient reduction.
    first, second = _run(tmp_path, order_seed=3)
    assert first["agreements"] == second["agreements"] == 1
    assert first["step"] == second["step"] == 3
    assert first["sizes"] == [1] * 6
    assert second["sizes"] == [1] * 5 + [0]


@pytest.mark.slow
def test_a_stream_agrees_per_micro_batch_until_it_ends_then_once(tmp_path: Path) -> None:
    # A producer still emitting: the ranks cannot know their shares, so they agree before
    # each micro-batch; every sample is trained once and both ranks stop together.
    first, second = _run(tmp_path, live_producer=True, emit_pause_s=0.05, samples=16)
    assert first["agreements"] == second["agreements"] > 1
    assert first["step"] == second["step"]
    assert len(first["sizes"]) == len(second["sizes"])
    assert sum(first["sizes"]) + sum(second["sizes"]) == 16


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise KeyError("no message")


def _deep(levels: int) -> list:
    nested: list = []
    for _ in range(levels):
        nested = [nested]
    return nested


def _agree_with_a_bad_payload(rank: int, args: dict[str, Any]) -> None:
    from training._dist import agree

    init_gloo(rank, args["port"])
    try:
        error, payload = None, {"ok": rank}
        if rank == 1:
            case = args["case"]
            if case == "set":
                payload = {"not json": {1, 2}}
            elif case == "deep":
                payload = _deep(100_000)  # RecursionError while encoding
            else:
                error = _UnprintableError()
        try:
            agree(error, payload, world_size=2, rank=rank, what="the test's meeting")
        except Exception as exc:  # every rank must get here, none left in the collective
            outcome = f"{type(exc).__name__}: {_described(exc)}"
        else:
            outcome = "no error"
        Path(args["out"], f"agree{rank}.json").write_text(json.dumps(outcome))
        agree(None, "after", world_size=2, rank=rank, what="the next meeting")  # still in step
    finally:
        dist.destroy_process_group()


def _described(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "(unprintable)"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("set", "rank 1's payload cannot be sent to the other ranks as JSON (TypeError"),
        ("deep", "rank 1's payload cannot be sent to the other ranks as JSON (RecursionError"),
        ("unprintable", "_UnprintableError: (its message could not be made: KeyError)"),
    ],
)
def test_what_one_rank_cannot_send_fails_every_rank_instead_of_hanging_its_peer(
    tmp_path: Path, case: str, expected: str
) -> None:
    args = run_args(tmp_path, case=case)
    ranks = [start(_agree_with_a_bad_payload, r, args) for r in range(2)]
    assert [join(process) for process in ranks] == [0, 0]
    first, second = (json.loads((tmp_path / f"agree{r}.json").read_text()) for r in range(2))
    assert first.startswith("CheckpointError: the test's meeting failed on rank 1 (this is rank 0)")
    assert expected in first
    if case != "unprintable":
        assert second.startswith("CheckpointError: the test's meeting: rank 1's payload")
