"""Quickstart: commit features, train on them, checkpoint, crash, resume, and verify by replay.

Run:  python examples/quickstart.py [WORKDIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from dataflow import Consumer, Ledger, Producer, StaleEpochError, replay
from stores import LocalFeatureStore


def save_checkpoint(workdir: Path, step: int) -> str:
    """The trainer's checkpoint files, durable before the ledger records them."""
    path = workdir / f"r1-step{step}.pt"
    torch.save({"step": step}, path)
    return str(path)


def main(workdir: Path) -> int:
    led = Ledger.open(f"sqlite:///{workdir / 'ledger.db'}")
    store = LocalFeatureStore("quickstart")

    # A rollout worker turns prompts into features and commits their refs.
    prod = Producer(led, store, run_id="r1", producer_id="rollout-0")
    for i in range(12):
        prod.emit(f"s-{i:06d}", {"hidden": torch.randn(4, 8), "ids": torch.arange(4)})
    assert prod.emit("s-000001", {"hidden": torch.randn(4, 8)}) is None  # already committed

    # A trainer rank leases refs, trains, and acks at the optimizer boundary.
    cons = Consumer(led, store, run_id="r1", consumer_id="rank0")
    cons.resume()
    for step in (1, 2, 3):
        refs = cons.lease(2)
        batch = [cons.load(ref)["hidden"] for ref in refs]
        _ = torch.stack(batch).mean()  # the training step
        cons.ack(refs, step=step)
        cons.record_checkpoint(step=step, path=save_checkpoint(workdir, step))
    cons.lease(2)  # in flight when the trainer dies

    # The trainer dies; its replacement resumes from an older checkpoint.
    new = Consumer(led, store, run_id="r1", consumer_id="rank0-restarted")
    plan = new.resume(2)
    print(
        f"resumed from step {plan.checkpoint_step}: {len(plan.trained)} trained, "
        f"{len(plan.requeued)} requeued, {len(plan.regenerate)} to regenerate"
    )
    try:
        cons.ack(["s-000000"], step=9)
    except StaleEpochError as exc:
        print(f"the old trainer is fenced off: {type(exc).__name__}")

    for sample_id in plan.regenerate:  # their features were released at checkpoint 3
        prod.regenerate(sample_id, {"hidden": torch.randn(4, 8), "ids": torch.arange(4)})
    prod.close()
    step = plan.checkpoint_step or 0
    for refs in new.batches(4, timeout=1.0):
        step += 1
        new.ack(refs, step=step)
    new.record_checkpoint(step=step, path=save_checkpoint(workdir, step))

    state = replay(led, "r1")
    print(
        f"replay: {len(state.committed)} committed, {len(state.trained)} trained once, "
        f"violations: {state.verify()}"
    )
    ok = state.verify() == [] and set(state.trained) == set(state.committed)
    led.close()
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(Path(tmp)))
