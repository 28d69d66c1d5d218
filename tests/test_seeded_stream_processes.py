"""A seeded streaming run across real processes: two producer processes racing (random
timing) stream to two gloo ranks training a real model; the ranks are SIGKILLed and
resumed from the latest and from an older checkpoint, and the final model is
``torch.equal`` to that of an uninterrupted run whose producers had other timings."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gloo import forkserver_start, free_port, init_gloo, join

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from stores import SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

RUN = "run"
PRODUCERS = ("p0", "p1")
PER_PRODUCER = 24  # 48 samples, batches of 4 on 2 ranks: 6 steps
DIM, CLASSES = 6, 3
WAIT_S = 120

start = forkserver_start("dataflow.streams")


def features(name: str, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(name[1:]) * 1000 + k)
    x = torch.randn(DIM, generator=g)
    return {"x": x, "y": torch.tensor(k % CLASSES)}


def _wait_file(path: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.02)
    return path.read_text()


def produce(name: str, args: dict[str, Any]) -> None:
    out = Path(args["out"])
    endpoints = tuple(_wait_file(out / f"endpoint-{r}") for r in range(2))
    sender = ZmqRefSender(SenderConfig(endpoints=endpoints, producer_id=name))
    led = Ledger.open(args["ledger"])
    producer = Producer(
        led, SharedDirFeatureStore(args["features"]), run_id=RUN, producer_id=name, stream=sender
    )
    rng = random.Random(args["timing"] * 31 + int(name[1:]))
    for k in range(PER_PRODUCER):
        time.sleep(rng.uniform(0, 0.03))  # racing: which producer commits first varies
        producer.emit(f"{name}-{k:02d}", features(name, k))
    producer.close()


def rank_main(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    out = Path(args["out"])
    try:
        receiver = ZmqRefReceiver(ReceiverConfig(window=512, expected_producers=2))
        tmp = out / f".endpoint-{rank}"
        tmp.write_text(receiver.endpoint)
        tmp.rename(out / f"endpoint-{rank}")
        consumer = Consumer(
            Ledger.open(args["ledger"]),
            SharedDirFeatureStore(args["features"]),
            run_id=RUN,
            consumer_id=f"rank{rank}",
            rank=rank,
            world_size=2,
            stream=receiver,
            order_seed=11,
            producers=PRODUCERS,
            release_policy="never",
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(DIM, CLASSES)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        seen = torch.zeros(1)

        def step_fn(batch: Batch) -> torch.Tensor | None:
            if not len(batch):
                return None
            loss = F.cross_entropy(model(batch.features["x"]), batch.features["y"], reduction="sum")
            loss.backward()
            seen.add_(len(batch))
            return loss

        def optimizer_fn(step: int) -> None:
            dist.all_reduce(seen)
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= seen.clamp(min=1)
            optimizer.step()
            optimizer.zero_grad()
            seen.zero_()
            if step == args.get("block_at"):
                (out / f"blocked-{rank}").touch()
                time.sleep(600)  # until the test SIGKILLs this process

        def state_fn() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        def load_fn(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        trainer = Trainer(
            consumer,
            step_fn=step_fn,
            optimizer_fn=optimizer_fn,
            checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN)),
            state_fn=state_fn,
            load_fn=load_fn,
            config=TrainerConfig(checkpoint_every=2),
            loader_config=LoaderConfig(batch_size=4, prefetch=1),
        )
        trainer.resume(args["checkpoint"])
        trainer.run()
        torch.save(model.state_dict(), out / f"model-{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _attempt(base: dict[str, Any], out: Path, **more: Any) -> dict[str, Any]:
    out.mkdir()
    return {**base, "port": free_port(), "out": str(out), **more}


def _equal(left: Path, right: Path) -> None:
    a, b = torch.load(left, weights_only=True), torch.load(right, weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _run(args: dict[str, Any], *, producers: bool) -> None:
    ranks = [start(rank_main, r, args) for r in range(2)]
    made = [start(produce, p, args) for p in PRODUCERS] if producers else []
    for process in made + ranks:
        assert join(process) == 0


@pytest.mark.slow
def test_a_sigkilled_seeded_streaming_run_ends_equal_to_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    def base(name: str, timing: int) -> dict[str, Any]:
        root = tmp_path / name
        root.mkdir()
        return {
            "ledger": f"sqlite:///{root}/ledger.db",
            "features": str(root / "features"),
            "ckpt": str(root / "ckpt"),
            "timing": timing,
            "checkpoint": "latest",
        }

    straight = base("straight", timing=1)
    _run(_attempt(straight, tmp_path / "straight-1"), producers=True)

    killed = base("killed", timing=2)
    first = _attempt(killed, tmp_path / "killed-1", block_at=5)
    ranks = [start(rank_main, r, first) for r in range(2)]
    made = [start(produce, p, first) for p in PRODUCERS]
    for process in made:
        assert join(process) == 0
    for r in range(2):
        _wait_file(Path(first["out"]) / f"blocked-{r}")
    for process in ranks:
        os.kill(process.pid, signal.SIGKILL)
        process.join(WAIT_S)
        assert process.exitcode == -signal.SIGKILL
    led = Ledger.open(killed["ledger"])
    assert [c.step for c in replay(led, RUN).checkpoints] == [2, 4]

    # From the latest checkpoint (4), then again from the older one (2).
    for name, which in (("killed-2", "latest"), ("killed-3", 2)):
        args = _attempt(killed, tmp_path / name, checkpoint=which)
        for r in range(2):  # the producers closed: nothing connects to the new endpoints
            (Path(args["out"]) / f"endpoint-{r}").write_text("unused")
        _run(args, producers=False)
        for r in range(2):
            _equal(tmp_path / "straight-1" / "model-0.pt", Path(args["out"]) / f"model-{r}.pt")
        state = replay(led, RUN)
        assert state.verify() == []
        assert len(state.trained) == 2 * PER_PRODUCER
    # The same samples at the same steps on the same ranks as the uninterrupted run.
    straight_led = Ledger.open(straight["ledger"])
    assert replay(straight_led, RUN).trained == replay(led, RUN).trained
