"""Mixed precision: a bfloat16 model whose optimizer steps fp32 master weights.

A resume must restore the fp32 master weights themselves: re-deriving them from the
bfloat16 model loses the low bits, and the run drifts from one that never crashed. A
trainer process is SIGKILLed at a chosen step and resumed, from the latest checkpoint
and from an older one whose features must be regenerated; its bfloat16 weights and
fp32 master weights end ``torch.equal`` to an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import forkserver_start, join, kept_aside

from dataflow import Consumer, Ledger, Producer, replay
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
SAMPLES = 48  # 4 per micro-batch, 2 micro-batches per step: 6 steps
DIM = 8


start = forkserver_start(__name__)


def _sample_id(i: int) -> str:
    return f"s{i:03d}"


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(sample_id[1:]))
    x = torch.randn(DIM, generator=g)
    return {"x": x, "y": x.sum(dim=0, keepdim=True) * 0.3}


class MasterWeights:
    """The usual mixed-precision optimizer: fp32 copies of bf16 parameters take the steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(self.master, lr=1e-2)

    def step(self) -> None:
        for master, param in zip(self.master, self.model.parameters(), strict=True):
            master.grad = param.grad.float()
            param.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for master, param in zip(self.master, self.model.parameters(), strict=True):
                param.copy_(master)  # rounds to bfloat16: the master keeps the low bits

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": [m.detach().clone() for m in self.master],
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, from_model: bool = False) -> None:
        with torch.no_grad():
            for master, saved, param in zip(
                self.master, state["master"], self.model.parameters(), strict=True
            ):
                master.copy_(param.float() if from_model else saved)
        self.optimizer.load_state_dict(state["optimizer"])


def _train(args: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1).to(torch.bfloat16)
    mixed = MasterWeights(model)

    def step_fn(batch: Batch) -> None:
        out = model(batch.features["x"].to(torch.bfloat16)).float()
        torch.nn.functional.mse_loss(out, batch.features["y"]).backward()

    def optimizer_fn(step: int) -> None:
        mixed.step()
        if step == args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    def load_fn(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        mixed.load_state_dict(state["optimizer"], from_model=args["masters_from_model"])

    led = Ledger.open(args["ledger"])
    trainer = Trainer(
        Consumer(
            led,
            SharedDirFeatureStore(args["features"]),
            run_id=RUN,
            consumer_id=f"trainer-{args['attempt']}",
            order_seed=5,
        ),
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
        state_fn=lambda: {"model": model.state_dict(), "optimizer": mixed.state_dict()},
        load_fn=load_fn,
        regenerate_fn=lambda ids: ((sid, _features(sid)) for sid in ids),
        config=TrainerConfig(grad_accum=2, checkpoint_every=2),
        loader_config=LoaderConfig(batch_size=4),
        model=model,
    )
    trainer.resume(args["checkpoint"])
    trainer.run()
    torch.save(
        {"model": model.state_dict(), "master": mixed.state_dict()["master"]},
        Path(args["out"]) / f"{args['attempt']}.pt",
    )


def _setup(where: Path) -> dict[str, Any]:
    where.mkdir()
    args = {
        "ledger": f"sqlite:///{where}/ledger.db",
        "features": str(where / "features"),
        "ckpt": str(where / "ckpt"),
        "out": str(where),
        "checkpoint": "latest",
        "kill_at": 0,
        "masters_from_model": False,
    }
    producer = Producer(
        Ledger.open(args["ledger"]), SharedDirFeatureStore(args["features"]), run_id=RUN
    )
    producer.emit_many((_sample_id(i), _features(_sample_id(i))) for i in range(SAMPLES))
    producer.close()
    return args


def _attempt(args: dict[str, Any], attempt: str, **overrides: Any) -> int | None:
    return join(start(_train, {**args, "attempt": attempt, **overrides}))


def _result(args: dict[str, Any], attempt: str) -> dict[str, Any]:
    return torch.load(Path(args["out"]) / f"{attempt}.pt", weights_only=True)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    same_model = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    same_master = all(torch.equal(x, y) for x, y in zip(a["master"], b["master"], strict=True))
    return same_model and same_master


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = _setup(tmp_path_factory.mktemp("reference") / "run")
    assert _attempt(args, "only") == 0
    result = _result(args, "only")
    assert result["model"]["weight"].dtype == torch.bfloat16
    assert result["master"][0].dtype == torch.float32
    return result


@pytest.fixture(scope="module")
def killed_at_5(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Any]]:
    """``killed_at_5()``: a fresh copy of a run whose trainer was SIGKILLed at step 5.

    The trainer is killed once per module and the directory kept aside; each call puts an
    exact copy back at the same path (the ledger records absolute paths) for a resume.
    """
    where = tmp_path_factory.mktemp("killed") / "run"
    args = _setup(where)
    assert _attempt(args, "killed", kill_at=5) == -signal.SIGKILL
    return kept_aside(where, args)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["latest", 2])
def test_sigkill_then_resume_restores_the_fp32_master_weights(
    killed_at_5: Callable[[], dict[str, Any]], reference: dict[str, Any], checkpoint: int | str
) -> None:
    args = killed_at_5()
    assert _attempt(args, "resumed", checkpoint=checkpoint) == 0
    assert _equal(_result(args, "resumed"), reference)
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
        assert run.verify() == []
        assert sorted(run.trained) == [_sample_id(i) for i in range(SAMPLES)]
        if checkpoint == 2:
            assert run.plans[run.epoch].regenerate  # released after step 2, regenerated


@pytest.mark.slow
def test_masters_rebuilt_from_the_bf16_model_drift(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # The control: what the test above guards against does change the weights.
    args = _setup(tmp_path / "run")
    assert _attempt(args, "killed", kill_at=3) == -signal.SIGKILL
    assert _attempt(args, "resumed", masters_from_model=True) == 0
    assert not _equal(_result(args, "resumed"), reference)
