"""Trainer end to end on real components: a SQLite ledger, real stores, a real torch model.

In process: a whole run with grad accumulation, evals and checkpoints. In child
processes: a trainer SIGKILLed mid-run and resumed from the latest and from an older
checkpoint; and two gloo ranks training their shares of one run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gloo import forkserver_context, free_port, init_gloo

from dataflow import Consumer, Kind, Ledger, Producer, replay
from eval import Evaluator
from stores import LocalFeatureStore, SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

DIM, CLASSES = 8, 4
RUN = "run"
CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 30


# -- the toy task: a linear classifier learning a fixed linear teacher ---------------------
def _teacher() -> torch.Tensor:
    return torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0))


def sample_id(i: int) -> str:
    return f"s{i:03d}"


def features(i: int) -> dict[str, torch.Tensor]:
    x = torch.randn(DIM, generator=torch.Generator().manual_seed(1000 + i))
    return {"x": x, "y": (_teacher() @ x).argmax()}


def emit(producer: Producer, n: int) -> None:
    producer.emit_many((sample_id(i), features(i)) for i in range(n))
    producer.close()


def eval_batches(*, rank: int = 0, world_size: int = 1) -> list[dict[str, torch.Tensor]]:
    x = torch.randn(48, DIM, generator=torch.Generator().manual_seed(7))
    y = (x @ _teacher().T).argmax(dim=1)
    return [{"x": x[i : i + 8], "y": y[i : i + 8]} for i in range(rank * 8, 48, world_size * 8)]


class Task:
    """A model, its optimizer and the callbacks a Trainer takes."""

    def __init__(self, *, grad_accum: int, lr: float = 0.5) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(DIM, CLASSES)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.grad_accum = grad_accum
        self.steps: list[int] = []

    def step_fn(self, batch: Batch) -> torch.Tensor:
        logits = self.model(batch.features["x"])
        loss = F.cross_entropy(logits, batch.features["y"]) / self.grad_accum
        loss.backward()
        return loss

    def optimizer_fn(self, step: int) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps.append(step)

    def state_fn(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_fn(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def model_fn(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        logits = self.model(batch["x"])
        return {
            "loss": F.cross_entropy(logits, batch["y"]),
            "num_tokens": len(batch["y"]),
            "accuracy_correct": (logits.argmax(dim=1) == batch["y"]).sum(),
            "accuracy_denom": len(batch["y"]),
        }


def _ack_steps(led: Ledger) -> dict[int, list[int]]:
    """Optimizer step -> seqs of its ack events, a batch row's once per sample it names."""
    steps: dict[int, list[int]] = {}
    for event in led.events(RUN):
        if event.kind == Kind.ACK:
            steps.setdefault(event.step, []).extend([event.seq] * len(event.sample_ids))
    return steps


# -- in process ------------------------------------------------------------------------------
def test_trainer_trains_every_sample_once_with_evals_and_checkpoints(tmp_path: Path) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore()
    emit(Producer(led, store, run_id=RUN), 64)
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    task = Task(grad_accum=2)
    checkpoints = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))
    trainer = Trainer(
        consumer,
        step_fn=task.step_fn,
        optimizer_fn=task.optimizer_fn,
        checkpoints=checkpoints,
        state_fn=task.state_fn,
        load_fn=task.load_fn,
        evaluator=Evaluator(),
        eval_fn=(task.model_fn, eval_batches()),
        config=TrainerConfig(grad_accum=2, checkpoint_every=4, eval_every=2),
        loader_config=LoaderConfig(batch_size=3),
    )

    # 64 samples in batches of 3: 22 micro-batches, the last one short; 11 optimizer steps.
    assert trainer.run() == 11
    assert task.steps == list(range(1, 12))

    state = replay(led, RUN)
    assert state.verify() == []
    assert set(state.trained) == {sample_id(i) for i in range(64)}
    # One ack transaction per optimizer step, covering both of its micro-batches.
    acks = _ack_steps(led)
    assert sorted(acks) == list(range(1, 12))
    for seqs in acks.values():
        assert len(set(seqs)) == 1  # one batch row per step
    assert [len(acks[s]) for s in range(1, 12)] == [6] * 10 + [4]

    saved = checkpoints.saved()
    # The cadence, the final one, and every eval (each second step) that beat all before it.
    assert {2, 4, 8, 11} <= {c.step for c in saved}  # 2: the first eval is the best so far
    best_so_far = float("-inf")
    for checkpoint in saved:
        acc = checkpoint.metrics["eval/simulated_acc_len"]
        if checkpoint.step not in (4, 8, 11):
            assert checkpoint.step % 2 == 0 and acc > best_so_far
        best_so_far = max(best_so_far, acc)
    assert [(c.step, c.path) for c in state.checkpoints] == [(c.step, str(c.path)) for c in saved]
    for checkpoint in saved:
        assert "eval/simulated_acc_len" in checkpoint.metrics
        assert "eval/avg_loss" in checkpoint.metrics
    best = checkpoints.best()
    assert best is not None
    assert best.metrics["eval/simulated_acc_len"] == max(
        c.metrics["eval/simulated_acc_len"] for c in saved
    )
    assert trainer.metrics_step == 11
    # The task is learnable: the final model is far better than chance.
    assert saved[-1].metrics["eval/simulated_acc_len"] > 0.5
    # Trained into the final checkpoint, so every feature was released.
    assert store.stats().objects == 0
    final = checkpoints.load()
    for name, tensor in task.model.state_dict().items():
        assert torch.equal(final["model"][name], tensor)


def test_max_steps_stops_then_a_new_trainer_continues(tmp_path: Path) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore()
    emit(Producer(led, store, run_id=RUN), 40)

    def trainer_for(consumer_id: str, max_steps: int | None) -> tuple[Trainer, Task]:
        task = Task(grad_accum=1)
        trainer = Trainer(
            Consumer(led, store, run_id=RUN, consumer_id=consumer_id),
            step_fn=task.step_fn,
            optimizer_fn=task.optimizer_fn,
            checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN)),
            state_fn=task.state_fn,
            load_fn=task.load_fn,
            config=TrainerConfig(max_steps=max_steps, checkpoint_every=2),
            loader_config=LoaderConfig(batch_size=4, prefetch=1),
        )
        return trainer, task

    first, _ = trainer_for("first", max_steps=5)
    assert first.run() == 5  # stopped at max_steps, with a final checkpoint at 5
    assert [c.step for c in replay(led, RUN).checkpoints] == [2, 4, 5]
    second, task = trainer_for("second", max_steps=None)
    assert second.run() == 10
    assert task.steps == [6, 7, 8, 9, 10]
    state = replay(led, RUN)
    assert state.verify() == []
    assert set(state.trained) == {sample_id(i) for i in range(40)}


# -- a trainer killed mid-run, resumed in new processes -----------------------------------------
def _train_in_child(args: dict[str, Any]) -> None:
    """One trainer process: emit (idempotent), resume, train; optionally block at a step."""
    out = Path(args["out"])
    attempt = args["attempt"]
    led = Ledger.open(args["ledger"])
    store = SharedDirFeatureStore(args["features"])
    producer = Producer(led, store, run_id=RUN)
    emit(producer, args["samples"])
    task = Task(grad_accum=2)
    on_step = task.optimizer_fn

    def optimizer_fn(step: int) -> None:
        on_step(step)
        with open(out / "steps.log", "a") as log:
            log.write(f"{attempt} {step}\n")
        if step == args.get("block_at"):
            (out / f"blocked-{attempt}").touch()
            time.sleep(600)  # until the test SIGKILLs this process

    def state_fn() -> dict[str, Any]:
        state = task.state_fn()
        torch.save(state["model"], out / f"saved-{attempt}-{trainer.step}.pt")
        return state

    consumer = Consumer(led, store, run_id=RUN, consumer_id=f"trainer-{attempt}")
    trainer = Trainer(
        consumer,
        step_fn=task.step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN)),
        state_fn=state_fn,
        evaluator=Evaluator(),
        eval_fn=(task.model_fn, eval_batches()),
        config=TrainerConfig(grad_accum=2, checkpoint_every=3, eval_every=3),
        loader_config=LoaderConfig(batch_size=4, prefetch=1),
    )
    state = trainer.resume(args["checkpoint"])
    if state is not None:
        task.load_fn(state)
        torch.save(task.model.state_dict(), out / f"restored-{attempt}.pt")
    if trainer.plan.regenerate:
        for sid in trainer.plan.regenerate:
            producer.regenerate(sid, features(int(sid[1:])))
        producer.close()
    trainer.run()
    (out / f"done-{attempt}").touch()


def _start(target: Any, *args: Any) -> multiprocessing.Process:
    process = forkserver_context(__name__).Process(target=target, args=args)
    process.start()
    return process


def _wait_for(path: Path, process: multiprocessing.Process) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not path.exists():
        assert process.is_alive(), f"the child exited ({process.exitcode}) before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} did not appear in time"
        time.sleep(0.05)


def _join(process: multiprocessing.Process) -> None:
    process.join(CHILD_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("a child process hung")
    assert process.exitcode == 0


def _assert_same_model(left: Path, right: Path) -> None:
    a, b = torch.load(left, weights_only=True), torch.load(right, weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_sigkilled_trainer_resumes_from_latest_and_from_an_older_checkpoint(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    args = {
        "ledger": url,
        "features": str(tmp_path / "features"),
        "ckpt": str(tmp_path / "ckpt"),
        "out": str(tmp_path),
        "samples": 64,
    }
    # 1: checkpoints at steps 3 and 6, then killed inside step 7, before its ack.
    first = _start(_train_in_child, {**args, "attempt": 1, "checkpoint": "latest", "block_at": 7})
    _wait_for(tmp_path / "blocked-1", first)
    os.kill(first.pid, signal.SIGKILL)
    first.join(CHILD_TIMEOUT_S)
    assert first.exitcode == -signal.SIGKILL
    led = Ledger.open(url)
    assert [c.step for c in replay(led, RUN).checkpoints] == [3, 6]

    # 2: resumes from the latest checkpoint (6) and trains to the end.
    second = _start(_train_in_child, {**args, "attempt": 2, "checkpoint": "latest"})
    _join(second)
    _assert_same_model(tmp_path / "restored-2.pt", tmp_path / "saved-1-6.pt")
    state = replay(led, RUN)
    assert state.verify() == []
    assert set(state.trained) == {sample_id(i) for i in range(64)}

    # 3: goes back to the older checkpoint (3): what was trained after it is trained again.
    third = _start(_train_in_child, {**args, "attempt": 3, "checkpoint": 3})
    _join(third)
    _assert_same_model(tmp_path / "restored-3.pt", tmp_path / "saved-1-3.pt")
    state = replay(led, RUN)
    assert state.verify() == []
    assert set(state.trained) == {sample_id(i) for i in range(64)}
    assert state.plans[state.epoch].checkpoint_step == 3
    assert state.plans[state.epoch].regenerate  # released after 3 in the abandoned lineage
    # In the final lineage each sample was acked exactly once: before 3, or by attempt 3.
    before = {s for s, step in state.trained.items() if step <= 3}
    assert before == set(state.plans[state.epoch].trained)
    logged = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    third_steps = [int(step) for attempt, step in logged if attempt == "3"]
    assert third_steps == list(range(4, 4 + len(third_steps)))
    assert {step for s, step in state.trained.items() if step > 3} <= set(third_steps)
    # The final checkpoint of the lineage is the latest save, and it loads.
    checkpoints = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))
    latest = checkpoints.latest()
    assert latest is not None and str(latest.path) == state.checkpoints[-1].path
    assert latest.step == third_steps[-1]


# -- two gloo ranks ------------------------------------------------------------------------
def _rank_in_child(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    try:
        led = Ledger.open(args["ledger"])
        store = SharedDirFeatureStore(args["features"])
        if rank == 0:
            emit(Producer(led, store, run_id=RUN), args["samples"])
        task = Task(grad_accum=2)
        seen = torch.zeros(1)

        def step_fn(batch: Batch) -> torch.Tensor | None:
            if not len(batch):
                return None  # this rank's share ran out; optimizer_fn still joins in
            logits = task.model(batch.features["x"])
            loss = F.cross_entropy(logits, batch.features["y"], reduction="sum")
            loss.backward()
            seen.add_(len(batch))
            return loss

        def optimizer_fn(step: int) -> None:
            # Data parallel by hand: sum the gradients and the sample counts of both ranks.
            dist.all_reduce(seen)
            for p in task.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= seen.clamp(min=1)
            task.optimizer_fn(step)
            seen.zero_()

        trainer = Trainer(
            Consumer(led, store, run_id=RUN, consumer_id=f"rank{rank}", rank=rank, world_size=2),
            step_fn=step_fn,
            optimizer_fn=optimizer_fn,
            checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN)),
            state_fn=task.state_fn,
            load_fn=task.load_fn,
            evaluator=Evaluator(),
            eval_fn=(task.model_fn, eval_batches(rank=rank, world_size=2)),
            config=TrainerConfig(grad_accum=2, checkpoint_every=2, eval_every=1),
            loader_config=LoaderConfig(batch_size=8),
        )
        final_step = trainer.run()
        out = Path(args["out"])
        torch.save(task.model.state_dict(), out / f"model-rank{rank}.pt")
        result = {"step": final_step, "steps": task.steps, "metrics": trainer.metrics}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # neither rank tears its group down while the other still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_train_their_shares_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    args = {
        "port": free_port(),
        "ledger": url,
        "features": str(tmp_path / "features"),
        "ckpt": str(tmp_path / "ckpt"),
        "out": str(tmp_path),
        # 33 + 32 samples in batches of 8: rank 0 has 5 micro-batches, rank 1 only 4.
        "samples": 65,
    }
    ranks = [_start(_rank_in_child, rank, args) for rank in range(2)]
    for process in ranks:
        _join(process)

    led = Ledger.open(url)
    state = replay(led, RUN)
    assert state.verify() == []
    assert set(state.trained) == {sample_id(i) for i in range(65)}
    actors = {e.actor for e in led.events(RUN) if e.kind == Kind.ACK}
    assert actors == {"rank0", "rank1"}
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Lockstep: micro-batches 1-2, 3-4, then 5 (rank 1 joined with an empty batch).
    assert [r["steps"] for r in results] == [[1, 2, 3], [1, 2, 3]]
    assert results[0]["metrics"] == results[1]["metrics"]  # summed over both eval shards
    # Step 1's eval is the first, so the best: saved off the cadence; then 2 and the final 3.
    assert [c.step for c in state.checkpoints] == [1, 2, 3]
    _assert_same_model(tmp_path / "model-rank0.pt", tmp_path / "model-rank1.pt")
    final = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN)).load(3)
    _assert_same_model(tmp_path / "model-rank0.pt", _saved_model(tmp_path, final))


def _saved_model(tmp_path: Path, state: dict[str, Any]) -> Path:
    path = tmp_path / "final-model.pt"
    torch.save(state["model"], path)
    return path
