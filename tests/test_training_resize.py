"""Resizing a run on resume: two gloo ranks SIGKILLed mid-run, resumed on three, or on one.

Every rank is a real process in a real gloo group, training a committed,
seeded dataset under DDP with ``no_sync`` accumulation; the first pair kills itself
with SIGKILL at optimizer step 3 (after the checkpoint at step 2). A new world
resumes with ``TrainerConfig(allow_resize=True)``: the ledger re-splits what
remains (sample ``i`` of the seeded order to rank ``i % world_size``), each rank
gets its per-rank state as docs/operations.md describes, steps and checkpoints go
on with one rank file per rank of the new world, and the final lineage trains each
committed sample exactly once. A resized lineage killed again and resumed on its own
number of ranks (no opt-in needed) ends with the weights of the resized run that was
not. Without the opt-in, the resize is refused before the resume event.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, free_port, init_gloo, join, kept_aside

import training
from dataflow import Consumer, Kind, Ledger, Producer, replay, seeded_order
from stores import SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)
from training._trainer import _derived_seed, _seed_generators

RUN = "run"
SAMPLES = 42  # 2 ranks: 8 a step, so 16 trained at the step-2 checkpoint; 26 left to re-split
SEED = 11
KILLED_AT = 3
IDS = [f"s{i:03d}" for i in range(SAMPLES)]


start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    i = int(sample_id[1:])
    return {"x": torch.tensor([i % 5, i % 3, i % 2], dtype=torch.float64)}


# -- a rank's process ----------------------------------------------------------------------------
def _train(rank: int, args: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    world_size = args["world_size"]
    init_gloo(rank, args["port"], world_size=world_size)
    torch.manual_seed(100 + rank)  # each rank's generators differ (a resume overwrites them)
    random.seed(100 + rank)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=2**-8, momentum=0.5)
    trained_here: list[str] = []
    loaded: list[Any] = []

    def step_fn(batch: Batch) -> None:
        x = batch.features["x"] if len(batch) else torch.zeros(0, 3, dtype=torch.float64)
        ddp(x).pow(2).sum().backward()
        trained_here.extend(batch.sample_ids)

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()
        if step == args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank, at the same point

    def load_fn(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    led = Ledger.open(args["ledger"])
    consumer = Consumer(
        led,
        SharedDirFeatureStore(args["features"]),
        run_id=RUN,
        consumer_id=f"{args['attempt']}-rank{rank}",
        rank=rank,
        world_size=world_size,
        order_seed=SEED,
    )
    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
        state_fn=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=load_fn,
        rank_state_fn=lambda: {"trained": len(trained_here)},
        # With a resize, a rank the old world did not have gets None.
        load_rank_fn=lambda state: loaded.append(None if state is None else state["trained"]),
        config=TrainerConfig(grad_accum=2, checkpoint_every=2, allow_resize=args["resize"]),
        loader_config=LoaderConfig(batch_size=2),
        modules=[ddp],
    )
    trainer.resume()
    plan = trainer.plan
    assert plan is not None
    result = {
        "resumed_from": plan.checkpoint.step if plan.checkpoint else None,
        "checkpoint_trained": sorted(plan.trained),
        "loaded": loaded,
        "position_after_resume": trainer.position,
        # What the generators give right after the resume (the training draws nothing).
        "draws": {"torch": torch.rand(3).tolist(), "python": random.random()},
    }
    result["step"] = trainer.run()
    result["trained"] = trained_here
    result["position"] = trainer.position
    torch.save(model.state_dict(), Path(args["out"], f"{args['attempt']}-rank{rank}.pt"))
    Path(args["out"], f"{args['attempt']}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its group down while another still talks to it
    dist.destroy_process_group()
    os._exit(0)  # past DDP's teardown, as in tests/test_training_resume_ranks.py


# -- the parent ------------------------------------------------------------------------------------
def _setup(where: Path) -> dict[str, Any]:
    """A committed dataset, trained by two ranks that are SIGKILLed at step ``KILLED_AT``."""
    args = {
        "ledger": f"sqlite:///{where}/ledger.db",
        "features": str(where / "features"),
        "ckpt": str(where / "ckpt"),
        "out": str(where),
    }
    with Ledger.open(args["ledger"]) as led:
        producer = Producer(led, SharedDirFeatureStore(args["features"]), run_id=RUN)
        producer.emit_many((sid, _features(sid)) for sid in IDS)
        producer.close()
    killed = _ranks(args, "killed", world_size=2, kill_at=KILLED_AT)
    assert killed == [-signal.SIGKILL] * 2
    with Ledger.open(args["ledger"]) as led:
        assert [c.step for c in replay(led, RUN).checkpoints] == [2]
    return args


@pytest.fixture(scope="module")
def killed_pair(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Any]]:
    """``killed_pair()``: a fresh copy of ``_setup``'s run, the two ranks just SIGKILLed.

    The pair is killed once per module and its directory kept aside; each call puts an
    exact copy back at the same path (the ledger records absolute paths) and returns its
    args. The tests resume and kill on it again; a call after that starts from the copy.
    """
    where = tmp_path_factory.mktemp("resize") / "run"
    args = _setup(where)
    return kept_aside(where, args)


def _ranks(
    args: dict[str, Any], attempt: str, *, world_size: int, kill_at: int = 0, resize: bool = False
) -> list[int | None]:
    args = {
        **args,
        "attempt": attempt,
        "port": free_port(),
        "world_size": world_size,
        "kill_at": kill_at,
        "resize": resize,
    }
    ranks = [start(_train, rank, args) for rank in range(world_size)]
    return [join(process) for process in ranks]


def _results(args: dict[str, Any], attempt: str, world_size: int) -> list[dict[str, Any]]:
    out = Path(args["out"])
    return [json.loads((out / f"{attempt}-rank{r}.json").read_text()) for r in range(world_size)]


def _assert_each_sample_once(args: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """The final lineage: what the checkpoint resumed from had trained, plus what each rank
    of the last attempt trained, is the committed set, each sample once."""
    lineage = results[0]["checkpoint_trained"] + [s for r in results for s in r["trained"]]
    assert sorted(lineage) == IDS
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
    assert run.verify() == []
    assert sorted(run.trained) == IDS


def _share(rank: int, world_size: int, trained: list[str]) -> list[str]:
    """What the ledger gives ``rank`` of ``world_size``: its places in the seeded order."""
    order = seeded_order(IDS, SEED)
    done = set(trained)
    return [s for i, s in enumerate(order) if i % world_size == rank and s not in done]


def _rank_files(args: dict[str, Any]) -> dict[int, list[str]]:
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    return {
        c.step: sorted(n for n in c.manifest["files"] if n.startswith("rank-"))
        for c in manager.saved()
    }


def _draws_after(rng: dict[str, Any] | None, seed: int | None = None) -> dict[str, Any]:
    """What a rank draws right after its generators were restored (or seeded)."""
    before = training.rng_state()
    try:
        if rng is not None:
            training.set_rng_state(rng)
        else:
            assert seed is not None
            _seed_generators(seed)
        return {"torch": torch.rand(3).tolist(), "python": random.random()}
    finally:
        training.set_rng_state(before)


@pytest.mark.slow
def test_two_killed_ranks_resumed_on_three_train_each_sample_once(
    killed_pair: Callable[[], dict[str, Any]],
) -> None:
    args = killed_pair()
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    [at_2] = manager.saved()
    old = [manager.load_rank_state(2, rank=r) for r in range(2)]

    assert _ranks(args, "three", world_size=3, resize=True) == [0, 0, 0]
    results = _results(args, "three", 3)
    trained_before = results[0]["checkpoint_trained"]
    assert len(trained_before) == 16
    assert sorted(trained_before) == sorted(seeded_order(IDS, SEED)[:16])
    for rank, result in enumerate(results):
        assert result["resumed_from"] == 2
        # Re-split by the ledger: rank r trains the rest of the places r, r+3, ... in order.
        assert result["trained"] == _share(rank, 3, trained_before), rank
        # The data position belonged to the old split: it restarts, and counts this split.
        assert result["position_after_resume"] == 0
        assert result["position"] == len(result["trained"])
        assert result["step"] == 5  # 26 samples, 12 a step: steps 3, 4 and a last half one
    # Old ranks 0 and 1 hand their state on; rank 2 is new: None, and generators seeded
    # from old rank 0's file digest and its rank.
    assert [r["loaded"] for r in results] == [[8], [8], [None]]
    assert results[0]["draws"] == _draws_after(old[0]["rng"])
    assert results[1]["draws"] == _draws_after(old[1]["rng"])
    sha256 = at_2.manifest["files"]["rank-00000.pt"]["sha256"]
    assert results[2]["draws"] == _draws_after(None, _derived_seed(sha256, 2))
    assert len({json.dumps(r["draws"]) for r in results}) == 3

    # Steps and checkpoints went on; the new world's checkpoints have three rank files.
    three = [f"rank-{r:05d}.pt" for r in range(3)]
    assert _rank_files(args) == {2: three[:2], 4: three, 5: three}
    for rank in range(3):
        saved = manager.load_rank_state(4, rank=rank)
        assert saved["data"] == {"position": 8, "batch_size": 2}
    _assert_each_sample_once(args, results)
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
    assert run.plans[run.epoch].world_size == 3


def _weights(args: dict[str, Any], attempt: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(args["out"], f"{attempt}-rank0.pt"), weights_only=True)


@pytest.mark.slow
def test_two_killed_ranks_resumed_on_one_train_each_sample_once(
    killed_pair: Callable[[], dict[str, Any]],
) -> None:
    reference = killed_pair()  # resized once, never killed after
    assert _ranks(reference, "one", world_size=1, resize=True) == [0]
    expected = _weights(reference, "one")  # read now: the next killed_pair() replaces it
    args = killed_pair()
    # The one rank is killed too, at step 7: the resized lineage's checkpoint at step 6
    # resumes like any other (same world size: no opt-in needed, the position checked).
    assert _ranks(args, "one", world_size=1, resize=True, kill_at=7) == [-signal.SIGKILL]
    one = ["rank-00000.pt"]
    assert _rank_files(args) == {2: ["rank-00000.pt", "rank-00001.pt"], 4: one, 6: one}
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    assert manager.load_rank_state(6, rank=0)["data"] == {"position": 16, "batch_size": 2}

    assert _ranks(args, "again", world_size=1) == [0]
    [result] = _results(args, "again", 1)
    assert result["resumed_from"] == 6
    assert result["position_after_resume"] == 16
    assert result["loaded"] == [16]
    assert result["step"] == 9  # 26 samples, 4 a step: steps 3 to 9
    assert result["trained"] == _share(0, 1, result["checkpoint_trained"])
    _assert_each_sample_once(args, [result])
    assert sorted(_rank_files(args)) == [2, 4, 6, 8, 9]
    # From the resize on, a crash and resume changes nothing: the weights of the resized
    # run that was not killed again, bit for bit.
    for name, tensor in _weights(args, "again").items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.slow
def test_without_the_opt_in_a_resize_is_refused_before_the_resume_event(
    killed_pair: Callable[[], dict[str, Any]],
) -> None:
    args = killed_pair()
    led = Ledger.open(args["ledger"])
    store = SharedDirFeatureStore(args["features"])
    events = len(list(led.events(RUN)))
    # Rank 0 is the one that would append the resume event; here it needs no peers.
    for world_size in (1, 3):
        for checkpoint in ("latest", 2):
            consumer = Consumer(
                led,
                store,
                run_id=RUN,
                consumer_id=f"refused-{world_size}-{checkpoint}",
                world_size=world_size,
                order_seed=SEED,
            )
            trainer = Trainer(
                consumer,
                step_fn=lambda batch: None,
                checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
                state_fn=dict,
                load_fn=lambda state: None,
            )
            refused = (
                f"holds the state of 2 ranks; this run resumes with {world_size}. "
                rf"To re-split the run over {world_size} ranks, pass allow_resize=True "
                r"\(TrainerConfig\(allow_resize=True\) for a Trainer"
            )
            with pytest.raises(training.IncompatibleCheckpointError, match=refused):
                trainer.resume(checkpoint)
    assert len(list(led.events(RUN))) == events
    run = replay(led, RUN)
    assert [e.epoch for e in led.events(RUN) if e.kind == Kind.RESUME] == [1]
    assert run.epoch == 1 and run.verify() == []
