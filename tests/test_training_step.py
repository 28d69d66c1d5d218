"""StepHelper: the optimizer boundary known before backward, no_sync() off it, one ack per step.

In process on a real SQLite ledger for the helper's own logic; two processes
with a real gloo group and real DistributedDataParallel for the deferred reductions.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, free_port, init_gloo, join

from dataflow import Consumer, Kind, Ledger, LedgerStateError, Producer, replay
from stores import LocalFeatureStore, SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    StepHelper,
    Trainer,
    TrainerConfig,
)

# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

RUN = "run"
CHILD_TIMEOUT_S = 120


class _CountsNoSync(torch.nn.Linear):
    """A module with a no_sync() that counts how often it was entered (our logic only)."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.entered = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.entered += 1
        yield


@pytest.fixture
def consumer(tmp_path: Path) -> Iterator[Consumer]:
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as led:
        store = LocalFeatureStore()
        producer = Producer(led, store, run_id=RUN)
        producer.emit_many((f"s{i}", {"x": torch.ones(2)}) for i in range(12))
        producer.close()
        consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
        consumer.resume()
        yield consumer


def _batch(consumer: Consumer, n: int = 2) -> Batch:
    return Batch(tuple(consumer.lease(n)))


def test_off_the_boundary_micro_steps_run_under_no_sync(consumer: Consumer) -> None:
    module, plain = _CountsNoSync(), torch.nn.Linear(2, 1)  # plain: no no_sync(), left alone
    helper = StepHelper(consumer, grad_accum=3, modules=[module, plain])
    seen = []
    for _ in range(3):
        assert helper.is_boundary() == (len(seen) == 2)
        with helper.micro_step(_batch(consumer)) as boundary:
            seen.append((boundary, module.entered))
    assert seen == [(False, 1), (False, 2), (True, 2)]
    assert helper.deferred == 2 and len(helper.pending_refs) == 6
    acked = helper.finish(1)
    assert len(acked) == 6 and helper.pending_refs == () and helper.micro_batches == 0
    # One ledger transaction: the six acks are one batch row at step 1.
    acks = [e for e in consumer.ledger.events(RUN) if e.kind == Kind.ACK]
    assert [(e.step, len(e.sample_ids)) for e in acks] == [(1, 6)]
    assert sorted(s for e in acks for s in e.sample_ids) == sorted(r.sample_id for r in acked)


def test_last_ends_a_step_early(consumer: Consumer) -> None:
    module = _CountsNoSync()
    helper = StepHelper(consumer, grad_accum=4, modules=[module])
    with helper.micro_step(_batch(consumer)) as boundary:
        assert not boundary
    with helper.micro_step(_batch(consumer), last=True) as boundary:
        assert boundary
    assert module.entered == 1 and helper.deferred == 1
    helper.finish(1)
    # An empty batch (a rank whose share ran out) still counts as a micro-step.
    with helper.micro_step(Batch(), last=True) as boundary:
        assert boundary
    assert helper.finish(2) == []
    assert replay(consumer.ledger, RUN).verify() == []


def test_refs_of_a_failed_micro_step_are_not_acked(consumer: Consumer) -> None:
    helper = StepHelper(consumer, grad_accum=1)
    with pytest.raises(RuntimeError, match="backward failed"), helper.micro_step(_batch(consumer)):
        raise RuntimeError("backward failed")
    assert helper.pending_refs == () and helper.micro_batches == 0
    with pytest.raises(ValueError, match=r"finish.* before the boundary"):
        helper.finish(1)


def test_a_finish_whose_ack_failed_acks_the_step_when_tried_again(consumer: Consumer) -> None:
    # The step's gradients are in the weights: its refs must stay pending until an ack
    # lands, or a resume would requeue them and they would be trained twice.
    helper = StepHelper(consumer, grad_accum=2)
    for _ in range(2):
        with helper.micro_step(_batch(consumer)):
            pass
    with pytest.raises(LedgerStateError, match="ack step must be >= 1, got 0"):
        helper.finish(0)
    assert len(helper.pending_refs) == 4
    acked = helper.finish(1)
    assert len(acked) == 4 and helper.pending_refs == () and helper.micro_batches == 0
    state = replay(consumer.ledger, RUN)
    assert sorted(state.trained) == sorted(r.sample_id for r in acked)
    assert state.verify() == []


def test_one_module_alone_is_refused_not_iterated(consumer: Consumer) -> None:
    # A Sequential iterates its layers: none has a no_sync(), every micro-step would be
    # reduced without a word.
    for alone in (torch.nn.Sequential(torch.nn.Linear(2, 1)), torch.nn.Linear(2, 1), None, 5):
        with pytest.raises(TypeError, match=r"modules must be a collection .* modules=\[ddp"):
            StepHelper(consumer, modules=alone)  # type: ignore[arg-type]


class _LikeFSDP2(torch.nn.Linear):
    """What tells an FSDP2 module apart: set_requires_gradient_sync, no no_sync (our logic
    only; the two-rank test below runs a real one)."""

    def set_requires_gradient_sync(self, requires: bool) -> None:
        raise AssertionError("StepHelper must not defer an FSDP2 module's reductions")


def test_an_fsdp2_module_is_reduced_every_micro_batch_and_says_so(consumer: Consumer) -> None:
    with pytest.warns(UserWarning, match=r"_LikeFSDP2 is an FSDP2 module .* every micro-batch"):
        helper = StepHelper(consumer, grad_accum=2, modules=[_LikeFSDP2(2, 1)])
    for last in (False, True):
        with helper.micro_step(_batch(consumer), last=last):
            pass
    helper.finish(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to defer without accumulation
        StepHelper(consumer, grad_accum=1, modules=[_LikeFSDP2(2, 1)])


def test_bad_input(consumer: Consumer) -> None:
    with pytest.raises(ValueError, match=r"consumer must be a dataflow\.Consumer"):
        StepHelper("trainer")  # type: ignore[arg-type]
    for bad in (0, 1.5, True, None):
        with pytest.raises(ValueError, match=f"grad_accum must be an int >= 1, got {bad!r}"):
            StepHelper(consumer, grad_accum=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"modules must be torch\.nn\.Modules, got str"):
        StepHelper(consumer, modules=["model"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="ack must be callable, got str"):
        StepHelper(consumer, ack="consumer.ack")  # type: ignore[arg-type]
    helper = StepHelper(consumer, grad_accum=1)
    with pytest.raises(ValueError, match=r"batch must be a training\.Batch, got list"):  # noqa: SIM117
        with helper.micro_step([1, 2]):  # type: ignore[arg-type]
            pass
    with helper.micro_step(_batch(consumer)):
        pass
    with pytest.raises(ValueError, match=r"call finish\(step\)"):  # noqa: SIM117
        with helper.micro_step(_batch(consumer)):
            pass
    with pytest.raises(ValueError, match="before the boundary"):
        StepHelper(consumer, grad_accum=2).finish(1)


# -- two ranks, real DDP and FSDP2 --------------------------------------------------------------
SAMPLES, BATCH, ACCUM = 36, 2, 3  # 18 per rank: 9 micro-batches, 3 optimizer steps each


def _wrapped(model: torch.nn.Module, wrap: str, reductions: list[int]) -> torch.nn.Module:
    """``model`` in DDP (its reductions counted by a comm hook) or sharded by FSDP2."""
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)

    # No annotations: DDP insists they be dist.GradBucket objects, not strings.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        reductions[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    return ddp


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole on every rank (FSDP2 shards them as DTensors)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach()


def _rank(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    try:
        led = Ledger.open(args["ledger"])
        store = SharedDirFeatureStore(args["features"])
        if rank == 0:
            producer = Producer(led, store, run_id=RUN)
            # Small integers in float64: every sum of gradients is exact, in any order.
            producer.emit_many(
                (f"s{i:02d}", {"x": torch.tensor([i % 5, i % 3], dtype=torch.float64)})
                for i in range(SAMPLES)
            )
            producer.close()
        model = torch.nn.Linear(2, 1, dtype=torch.float64)
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias.fill_(0.25)
        reductions = [0]
        wrapped = _wrapped(model, args["wrap"], reductions)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=2**-8)

        def step_fn(batch: Batch) -> None:
            x = batch.features["x"]
            wrapped(x).pow(2).sum().backward()
            if args["wrap"] == "fsdp2" and all(p.grad is not None for p in model.parameters()):
                reductions[0] += 1  # reduce-scattered into the sharded gradients

        def optimizer_fn(step: int) -> None:
            optimizer.step()
            optimizer.zero_grad()

        trainer = Trainer(
            Consumer(led, store, run_id=RUN, consumer_id=f"rank{rank}", rank=rank, world_size=2),
            step_fn=step_fn,
            optimizer_fn=optimizer_fn,
            checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
            state_fn=lambda: {"model": {k: _full(v) for k, v in model.state_dict().items()}},
            config=TrainerConfig(grad_accum=ACCUM),
            loader_config=LoaderConfig(batch_size=BATCH),
            modules=[wrapped] if args["defer"] else [],
        )
        steps = trainer.run()
        result = {
            "steps": steps,
            "reductions": reductions[0],
            "deferred": trainer.helper.deferred,
            "weight": _full(model.weight).flatten().tolist(),
            "bias": _full(model.bias).tolist(),
        }
        Path(args["out"], f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # neither rank tears its group down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # A DDP reducer holding a Python comm hook can abort the interpreter's teardown
    # ("terminate called without an active exception", torch's C++ state): the result is
    # written, so leave without that teardown.
    os._exit(0)


def _train_two_ranks(tmp_path: Path, *, wrap: str, defer: bool) -> list[dict[str, Any]]:
    where = tmp_path / f"{wrap}-{'deferred' if defer else 'every_step'}"
    where.mkdir()
    args = {
        "port": free_port(),
        "ledger": f"sqlite:///{where}/ledger.db",
        "features": str(where / "features"),
        "ckpt": str(where / "ckpt"),
        "out": str(where),
        "wrap": wrap,
        "defer": defer,
    }
    ranks = [start(_rank, r, args) for r in range(2)]
    assert [join(process) for process in ranks] == [0, 0]
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
        assert run.verify() == [] and len(run.trained) == SAMPLES
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_deferred_reductions_give_the_weights_of_reducing_every_micro_step(
    tmp_path: Path, wrap: str
) -> None:
    # DDP through no_sync(). FSDP2 (fully_shard) has no no_sync() and is not deferred:
    # it reduce-scatters every micro-batch, in modules= or not, with the same weights.
    deferred = _train_two_ranks(tmp_path, wrap=wrap, defer=True)
    every = _train_two_ranks(tmp_path, wrap=wrap, defer=False)
    steps = SAMPLES // (2 * BATCH * ACCUM)
    for rank in range(2):
        assert deferred[rank]["steps"] == every[rank]["steps"] == steps
        # DDP: one reduction per optimizer step instead of one per micro-batch.
        assert deferred[rank]["reductions"] == (steps if wrap == "ddp" else steps * ACCUM)
        assert every[rank]["reductions"] == steps * ACCUM
        assert deferred[rank]["deferred"] == steps * (ACCUM - 1)
        assert (deferred[rank]["weight"], deferred[rank]["bias"]) == (
            every[rank]["weight"],
            every[rank]["bias"],
        )
    assert deferred[0]["weight"] == deferred[1]["weight"]
