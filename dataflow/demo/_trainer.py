"""A demo trainer rank: one of two gloo ranks training the draft heads under DDP.

Each rank takes refs from its own ZeroMQ receiver (bound on the
same loopback endpoint in every attempt, so that the producers reconnect to a restarted
rank), reads the features from the store, and runs ``training.Trainer``: gradient
accumulation with acks at the optimizer boundary, evals through ``eval.Evaluator`` and
checkpoints through ``training.CheckpointManager`` on a cadence. A restarted rank resumes
from the latest checkpoint the ledger recorded; what the killed ranks had leased or had
in flight on the wire is requeued by the ledger.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # DDP's constructor imports it (seconds): import it once, in the fork server
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dataflow import Consumer, Ledger
from dataflow.demo._child import kill_self
from dataflow.demo._model import (
    DRAFT,
    HIDDEN,
    SEQ,
    DraftHeads,
    TargetNetwork,
    draft_loss,
    eval_outputs,
    producer_id,
    sample_index,
)
from dataflow.live._collectives import join_gloo, join_loopback_gloo
from dataflow.streams import CurveServerConfig, ReceiverConfig, ZmqRefReceiver
from eval import Evaluator
from stores import open_store
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

WORLD_SIZE = 2


class RecordingEvaluator(Evaluator):
    """An Evaluator whose rank 0 appends every eval's metrics, with the step, to a JSON
    lines file (the demo's progress line and timeline read it)."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__()
        self.path, self.rank = path, rank
        self.trainer: Trainer | None = None  # whose step an eval is recorded at

    def run(self, outputs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        metrics = super().run(outputs)
        if self.rank == 0:
            step = self.trainer.step if self.trainer is not None else None
            record = {"t": time.time(), "step": step, "metrics": metrics}
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")
        return metrics


class DyingCheckpointManager(CheckpointManager):
    """``dataflow chaos``: SIGKILLs its rank in the middle of the save at ``step``, once the
    rank's first file is written (the checkpoint neither published nor recorded)."""

    def __init__(self, config: CheckpointConfig, *, step: int, marker: str) -> None:
        super().__init__(config)
        self.kill_step, self.marker = step, marker
        self.saving: int | None = None

    def save(self, step: int, *args: Any, **kwargs: Any) -> Any:
        self.saving = step
        return super().save(step, *args, **kwargs)

    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        super()._write(file, obj)
        if self.saving == self.kill_step:
            kill_self(self.marker)


def train(config: dict, rank: int, attempt: int, port: int) -> None:
    torch.set_num_threads(1)
    gloo = config.get("gloo")  # chaos --hosts: between the trainer hosts' addresses
    if gloo is None:
        join_loopback_gloo(rank, WORLD_SIZE, port, timeout_s=60)
    else:
        _join_gloo(rank, port, **gloo)
    logging.getLogger("dataflow.demo").info("rank %d: in the gloo group", rank)
    run_dir = Path(config["run_dir"])
    target = TargetNetwork(config["seed"])
    torch.manual_seed(config["seed"])
    model = DraftHeads()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config["lr"])
    grad_accum = config["grad_accum"]

    def step_fn(batch: Batch) -> torch.Tensor:
        # A rank whose share ran out before its peer's gets an empty batch: it still runs a
        # backward (of nothing) so that it joins DDP's reduction at the step boundary.
        if len(batch):
            hidden, targets = batch.features["hidden"].float(), batch.features["targets"]
        else:
            hidden = torch.zeros(0, SEQ, HIDDEN)
            targets = torch.zeros(0, SEQ, DRAFT, dtype=torch.long)
        loss = draft_loss(ddp(hidden), targets) / max(targets.numel(), 1) / grad_accum
        loss.backward()
        return loss.detach()

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    def load_fn(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def regenerate_fn(ids: list[str]) -> Iterable[tuple[str, dict[str, torch.Tensor]]]:
        return ((sid, target.features(sample_index(sid))) for sid in ids)

    eval_batches = target.eval_batches(rank, WORLD_SIZE)

    def model_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        return eval_outputs(model, batch)  # under no_grad (Evaluator.evaluate)

    # Streaming: refs in arrival order over ZeroMQ. Without a stream: a committed dataset,
    # leased in the order `order_seed` fixes, so a resumed run trains what an uninterrupted
    # one does, batch for batch.
    streaming = config.get("stream", True)
    receiver = (
        ZmqRefReceiver(
            ReceiverConfig(
                endpoint=config["endpoints"][rank],
                window=config["window"],
                expected_producers=config["producers"],
                curve=_curve(config),
            )
        )
        if streaming
        else None
    )
    consumer = Consumer(
        Ledger.open(config["ledger_url"], busy_timeout=config.get("busy_timeout_s", 30.0)),
        open_store(config["store_uri"]),
        run_id=config["run_id"],
        consumer_id=f"rank{rank}-attempt{attempt}",
        rank=rank,
        world_size=WORLD_SIZE,
        stream=receiver,
        order_seed=None if streaming else config["seed"],
        # Offline, a producer killed before its first commit is unknown to the ledger:
        # without its name, the seeded order could start as soon as the other closed.
        producers=[producer_id(index) for index in range(config["producers"])],
    )
    checkpoint_config = CheckpointConfig(
        root=config["checkpoint_root"],
        # No "data" (the rank's position in its queue) when streaming: refs come in arrival
        # order, a batch holds what has arrived, so a position is no batch boundary to line
        # up with; the ledger alone says what is trained and what comes next.
        components=("model", "optimizer", "rng", "trainer") if streaming else None,
    )
    kill = config.get("kill_in_save")
    checkpoints = (
        DyingCheckpointManager(
            checkpoint_config, step=kill["step"], marker=f"{kill['marker']}{rank}"
        )
        if kill is not None and attempt == 1
        else CheckpointManager(checkpoint_config)
    )
    evaluator = RecordingEvaluator(run_dir / "evals.jsonl", rank)
    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=checkpoints,
        state_fn=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=load_fn,
        regenerate_fn=regenerate_fn,
        evaluator=evaluator,
        eval_fn=(model_fn, eval_batches),
        config=TrainerConfig(
            grad_accum=grad_accum,
            checkpoint_every=config["checkpoint_every"],
            eval_every=config["eval_every"],
        ),
        loader_config=LoaderConfig(batch_size=config["batch_size"], prefetch=4),
        modules=[ddp],
        model=model,
    )
    evaluator.trainer = trainer
    with warnings.catch_warnings():
        # Every demo starts a new run in a ledger that may hold earlier demos' runs.
        warnings.filterwarnings("ignore", message=r"run '.*' has no events")
        trainer.resume("latest")  # from scratch, or where the killed ranks left off
    step = trainer.run()
    # A sample reported lost and regenerated after the ranks settled how many micro-batches
    # they take (the store lost features near the end) waits for the next run(): run again
    # until no rank holds work, or the run ends with it leased and never trained.
    while _any_rank(not consumer.finished):
        step = trainer.run()
    if rank == 0:
        final = {"step": step, "metrics": trainer.metrics, "attempt": attempt}
        (run_dir / "final.json").write_text(json.dumps(final))
        torch.save(model.state_dict(), run_dir / "weights.pt")
    dist.barrier()  # neither rank tears its group down while the other still talks to it
    dist.destroy_process_group()
    consumer.close()


def _join_gloo(rank: int, port: int, *, master_addr: str, ifname: str, timeout_s: float) -> None:
    """Join the gloo group whose rank 0 listens on ``master_addr``, over ``ifname``
    (``timeout_s`` bounds each collective, not the join: a slow start is no failure)."""
    join_gloo(rank, WORLD_SIZE, master_addr, port, timeout_s=timeout_s, interface=ifname)


def _curve(config: dict) -> CurveServerConfig | None:
    """The receiver's CURVE keys, when the config names them (chaos --hosts)."""
    curve = config.get("curve")
    if curve is None:
        return None
    return CurveServerConfig(
        secret_key_file=curve["secret"], authorized_keys_dir=curve["authorized"]
    )


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (every rank calls it: a collective)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def main(config: dict, rank: int, attempt: int, port: int) -> None:
    """The rank process (``dataflow.demo._child.run_child`` calls it)."""
    train(config, rank, attempt, port)
    # Leave without the interpreter's teardown, which DDP's reducer can abort ("terminate
    # called without an active exception"); everything is written.
    logging.shutdown()
    os._exit(0)
