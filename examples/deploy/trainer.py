"""A trainer rank of the walk-through (docs/deploy.md): gloo, DDP, gradient accumulation,
refs from its own ZeroMQ receiver, features from the store, checkpoints through the ledger.

    RANK=0 python examples/deploy/trainer.py     # and RANK=1 on the other host
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from common import HIDDEN, env, features
from torch.nn.parallel import DistributedDataParallel

from dataflow import Consumer, Ledger
from dataflow.streams import ReceiverConfig, ZmqRefReceiver
from stores import open_store
from training import CheckpointConfig, CheckpointManager, LoaderConfig, Trainer, TrainerConfig


def main() -> None:
    rank, world_size = int(env("RANK")), int(env("WORLD_SIZE"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(60))
    torch.manual_seed(0)
    model = torch.nn.Linear(HIDDEN, 1)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    endpoint = env("ENDPOINTS").split(",")[rank]
    consumer = Consumer(
        Ledger.open(env("DATAFLOW_LEDGER")),
        open_store(env("STORE")),
        run_id=env("RUN"),
        consumer_id=f"rank{rank}",
        rank=rank,
        world_size=world_size,
        stream=ZmqRefReceiver(
            ReceiverConfig(endpoint=endpoint, expected_producers=int(env("PRODUCERS")))
        ),
        producers=[f"rollout-{i}" for i in range(int(env("PRODUCERS")))],
        metrics_port=int(env("METRICS_PORT")) + rank,
    )

    def step_fn(batch):
        # A rank whose share ran out before its peer's gets an empty batch; it still runs a
        # backward (of nothing) to join DDP's reduction at the step boundary.
        x = batch.features["hidden"] if len(batch) else torch.zeros(0, HIDDEN)
        y = batch.features["target"] if len(batch) else torch.zeros(0, 1)
        loss = torch.nn.functional.mse_loss(ddp(x), y, reduction="sum") / 16
        loss.backward()

    def optimizer_fn(step):
        optimizer.step()
        optimizer.zero_grad()

    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(
            CheckpointConfig(
                root=env("CHECKPOINTS"), components=("model", "optimizer", "rng", "trainer")
            )
        ),
        state_fn=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=lambda state: (
            model.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optimizer"]),
        ),
        regenerate_fn=lambda ids: ((sid, features(sid)) for sid in ids),
        config=TrainerConfig(grad_accum=2, checkpoint_every=int(env("CHECKPOINT_EVERY"))),
        loader_config=LoaderConfig(batch_size=8, prefetch=2),
        modules=[ddp],  # micro-batches off the step boundary run under ddp.no_sync()
    )
    trainer.resume("latest")  # from scratch, or from where a killed pair left off
    step = trainer.run()
    print(f"rank {rank}: done at step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    consumer.close()
    os._exit(0)  # skip the interpreter's teardown, which DDP's reducer can abort


if __name__ == "__main__":
    main()
