"""A trainer rank: one of two gloo ranks training the EAGLE-3 draft under DDP.

Refs come from the ledger in the order the seed fixes (``Consumer(order_seed=...)``), so a
resumed run trains the batches an uninterrupted one does. ``training.Trainer`` runs the
loop: micro-batches padded by ``training.PadCollate`` (the store reads each sample straight
into its row of the batch), gradient accumulation under ``no_sync``, acks at the optimizer
boundary, evals through ``eval.Evaluator`` and checkpoints through ``CheckpointManager``
on a cadence. Rank 0 regenerates the features a resume needs and the store no longer
holds, with the producers' code (``target.features``).
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from draft import Eagle3Draft, draft_logits, eval_outputs, ttt_loss
from target import Sizes, build_target, features, load_prompts, sample_index
from torch.nn.parallel import DistributedDataParallel

from dataflow import Consumer, Ledger
from eval import Evaluator
from stores import open_store
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    PadCollate,
    Trainer,
    TrainerConfig,
)

WORLD_SIZE = 2
#: Every sequence feature, padded to the longest sample of a batch.
COLLATE = PadCollate(pad=("input_ids", "hidden_states", "last_hidden", "loss_mask"))
EVAL_BATCH = 8
#: DDP's name for "do not broadcast the buffers in every forward" (renamed in torch 2.13).
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def train(job: dict[str, Any], rank: int, attempt: int, port: int) -> None:
    torch.set_num_threads(1)
    began = time.monotonic()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{job.get('master_addr', '127.0.0.1')}:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=300),
    )
    out = Path(job["out_dir"])
    target = build_target(Sizes(**job["sizes"]), job["seed"], job["model"])
    prompts = load_prompts(Path(job["prompts"]))
    torch.manual_seed(job["seed"])
    draft = Eagle3Draft(target, steps=job["ttt_steps"])
    # Rank 0's weights to every rank; the frozen buffers (embedding, LM head: vocab x
    # hidden each) are the same everywhere, so not broadcast again before every forward.
    ddp = DistributedDataParallel(draft, **NO_BUFFER_SYNC)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=job["lr"])
    grad_accum = job["grad_accum"]

    largest_batch = 0  # bytes: the loader holds this, the batches read ahead and no more

    def step_fn(batch: Batch) -> torch.Tensor:
        nonlocal largest_batch
        # A rank whose share ran out before its peer's gets an empty batch: it still runs a
        # forward and backward (of nothing) to join DDP's reduction at the step boundary.
        feats = batch.features if len(batch) else empty_features(draft)
        largest_batch = max(largest_batch, sum(t.nbytes for t in feats.values()))
        loss, terms = ttt_loss(draft, draft_logits(ddp, feats), feats)
        (loss / max(terms, 1) / grad_accum).backward()
        return loss.detach()

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()
        if step == job["hold_at"] and attempt == 1:
            hold(out / f"rank{rank}.holding")

    def load_fn(state: dict) -> None:
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def regenerate_fn(ids: list[str]):
        return ((sid, features(target, prompts[sample_index(sid)])) for sid in ids)

    evaluator = RecordingEvaluator(out / "evals.jsonl", rank)
    eval_batches = held_out_batches(target, job, rank)
    consumer = Consumer(
        Ledger.open(job["ledger_url"]),
        open_store(job["store_uri"]),
        run_id=job["run_id"],
        consumer_id=f"rank{rank}-attempt{attempt}",
        rank=rank,
        world_size=WORLD_SIZE,
        order_seed=job["seed"],
        producers=[f"rollout-{i}" for i in range(job["producers"])],
    )
    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=job["checkpoint_root"])),
        state_fn=lambda: {"model": draft.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=load_fn,
        regenerate_fn=regenerate_fn,
        evaluator=evaluator,
        eval_fn=(lambda b: eval_outputs(draft, b), eval_batches),
        config=TrainerConfig(
            grad_accum=grad_accum,
            checkpoint_every=job["checkpoint_every"],
            eval_every=job["eval_every"],
        ),
        loader_config=LoaderConfig(batch_size=job["batch_size"], prefetch=job["prefetch"]),
        collate_fn=COLLATE,
        modules=[ddp],  # micro-batches off the step boundary run under ddp.no_sync()
        model=draft,
    )
    evaluator.trainer = trainer
    print(f"rank {rank}: set up in {time.monotonic() - began:.1f} s", flush=True)
    trainer.resume(job["resume"])
    if trainer.plan is not None and trainer.plan.checkpoint is None:
        draft.eval()  # the draft before any training: the acceptance it starts from
        evaluator.evaluate(lambda b: eval_outputs(draft, b), eval_batches)
        draft.train()
    step = trainer.run()
    print(f"rank {rank}: step {step} at {time.monotonic() - began:.1f} s", flush=True)
    memory = {
        "largest_batch_bytes": largest_batch,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    (out / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps(memory))
    if rank == 0:
        torch.save(draft.state_dict(), out / "weights.pt")
    dist.barrier()  # neither rank tears its group down while the other still talks to it
    dist.destroy_process_group()
    consumer.close()


class RecordingEvaluator(Evaluator):
    """An Evaluator whose rank 0 appends each eval's metrics, with the step, to a file."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__()
        self.path, self.rank = path, rank
        self.trainer: Trainer | None = None

    def run(self, outputs):  # type: ignore[no-untyped-def]
        metrics = super().run(outputs)
        if self.rank == 0:
            step = self.trainer.step if self.trainer is not None else 0
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, "t": time.time(), "metrics": metrics}) + "\n")
        return metrics


def held_out_batches(target: torch.nn.Module, job: dict, rank: int) -> list[dict]:
    """This rank's shard of the held-out prompts, as padded batches."""
    prompts = load_prompts(Path(job["eval_prompts"]))
    mine = [features(target, p) for p in prompts[rank::WORLD_SIZE]]
    return [COLLATE(mine[i : i + EVAL_BATCH]) for i in range(0, len(mine), EVAL_BATCH)]


def empty_features(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """A padded batch of no samples."""
    hidden = draft.fc.in_features // 3
    return {
        "input_ids": torch.zeros(0, 1, dtype=torch.long),
        "hidden_states": torch.zeros(0, 1, 3 * hidden),
        "last_hidden": torch.zeros(0, 1, hidden),
        "loss_mask": torch.zeros(0, 1, dtype=torch.bool),
        "attention_mask": torch.zeros(0, 1, dtype=torch.bool),
    }


def hold(marker: Path) -> None:
    """Say this rank reached the step the job kills it at, and wait for the SIGKILL."""
    parent = os.getppid()
    marker.write_text(str(os.getpid()))
    for _ in range(6000):  # 10 minutes at most
        time.sleep(0.1)
        if os.getppid() != parent:
            break  # the conductor, and with it the fork server, is gone
    os._exit(3)


def main(job_path: str, rank: int, attempt: int, port: int) -> None:
    """The rank process (``run.py`` starts it)."""
    train(json.loads(Path(job_path).read_text()), rank, attempt, port)
    # Leave without the interpreter's teardown, which DDP's reducer can abort.
    os._exit(0)
