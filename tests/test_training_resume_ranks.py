"""Two gloo ranks under DDP, SIGKILLed together, resumed: the weights of a run that never crashed.

Every process is real: producer processes commit the dataset, trainer ranks run a
``Trainer`` (DDP, ``no_sync`` accumulation, per-rank state, a seeded order) and
kill themselves with SIGKILL at a random optimizer step. A new pair resumes from
the latest checkpoint, or from an older one whose features were released and must
be regenerated, and must end with weights ``torch.equal`` to an uninterrupted run.
In streaming mode (no seed) it must train every committed sample exactly once.
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

from dataflow import Consumer, Kind, Ledger, Producer, replay
from stores import SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
    rng_state,
    set_rng_state,
)

RUN = "run"
SAMPLES = 48  # 2 ranks x 2 per micro-batch x 2 micro-batches: 8 per step, 6 steps
SEED = 11
CHILD_TIMEOUT_S = 120


start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)


def _sample_id(i: int) -> str:
    return f"s{i:03d}"


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    i = int(sample_id[1:])
    # Small integers in float64: every sum of gradients is exact, in any order.
    return {"x": torch.tensor([i % 5, i % 3, i % 2], dtype=torch.float64)}


# -- the processes -----------------------------------------------------------------------------
def _produce(args: dict[str, Any], share: int) -> None:
    """One of two producers: commits every other sample, racing the other producer."""
    led = Ledger.open(args["ledger"])
    producer = Producer(
        led, SharedDirFeatureStore(args["features"]), run_id=RUN, producer_id=f"p{share}"
    )
    for i in range(share, SAMPLES, 2):
        producer.emit(_sample_id(i), _features(_sample_id(i)))
    producer.close()


def _train(rank: int, args: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    init_gloo(rank, args["port"])
    led = Ledger.open(args["ledger"])
    store = SharedDirFeatureStore(args["features"])
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=2**-8, momentum=0.5)
    trained_here: list[str] = []

    def step_fn(batch: Batch) -> None:
        x = batch.features["x"] if len(batch) else torch.zeros(0, 3, dtype=torch.float64)
        ddp(x).pow(2).sum().backward()
        trained_here.extend(batch.sample_ids)

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()
        if step == args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)  # both ranks, at the same point

    def load_fn(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def regenerate_fn(sample_ids: list[str]) -> Any:
        return ((sid, _features(sid)) for sid in sample_ids)

    consumer = Consumer(
        led,
        store,
        run_id=RUN,
        consumer_id=f"{args['attempt']}-rank{rank}",
        rank=rank,
        world_size=2,
        order_seed=args["order_seed"],
    )
    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"], keep_latest_k=0)),
        state_fn=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=load_fn,
        rank_state_fn=lambda: {"rng": rng_state(), "trained": len(trained_here)},
        load_rank_fn=lambda state: set_rng_state(state["rng"]),
        regenerate_fn=regenerate_fn,
        config=TrainerConfig(grad_accum=2, checkpoint_every=2),
        loader_config=LoaderConfig(batch_size=2),
        modules=[ddp],
    )
    trainer.resume(args["checkpoint"])
    step = trainer.run()
    torch.save(model.state_dict(), Path(args["out"]) / f"{args['attempt']}-rank{rank}.pt")
    Path(args["out"], f"{args['attempt']}-rank{rank}.json").write_text(
        json.dumps({"step": step, "agreements": trainer.agreements})
    )
    dist.barrier()  # neither rank tears its group down while the other still talks to it
    dist.destroy_process_group()
    # A child process tears the interpreter down on exit, and torch's DDP reducer can
    # abort that teardown ("terminate called without an active exception"): the results
    # are written, so leave without it (fork children, as in the docs, exit this way).
    os._exit(0)


# -- the parent ----------------------------------------------------------------------------------
def _setup(where: Path, *, concurrent_producers: bool = True) -> dict[str, Any]:
    where.mkdir()
    args = {
        "ledger": f"sqlite:///{where}/ledger.db",
        "features": str(where / "features"),
        "ckpt": str(where / "ckpt"),
        "out": str(where),
        "order_seed": SEED,
        "checkpoint": "latest",
        "kill_at": 0,
    }
    if concurrent_producers:
        producers = [start(_produce, args, share) for share in range(2)]
        assert [join(p) for p in producers] == [0, 0]
    return args


def _ranks(args: dict[str, Any], attempt: str, **overrides: Any) -> list[int | None]:
    args = {**args, "attempt": attempt, "port": free_port(), **overrides}
    ranks = [start(_train, rank, args) for rank in range(2)]
    return [join(process) for process in ranks]


def _weights(args: dict[str, Any], attempt: str) -> list[dict[str, torch.Tensor]]:
    return [
        torch.load(Path(args["out"]) / f"{attempt}-rank{r}.pt", weights_only=True) for r in (0, 1)
    ]


def _assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, a[name], b[name])


def _assert_each_sample_once(args: dict[str, Any]) -> None:
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
        assert run.verify() == []  # among others: nothing trained twice in the lineage
        assert sorted(run.trained) == [_sample_id(i) for i in range(SAMPLES)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted seeded run."""
    args = _setup(tmp_path_factory.mktemp("reference") / "run")
    assert _ranks(args, "only") == [0, 0]
    first, second = _weights(args, "only")
    _assert_equal_weights(first, second)
    for rank in (0, 1):
        result = json.loads(Path(args["out"], f"only-rank{rank}.json").read_text())
        assert result["agreements"] == 1  # a committed dataset: one collective settles the count
    _assert_each_sample_once(args)
    return first


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Any]]:
    """``committed()``: a fresh copy of a dataset the two producer processes committed.

    The producers race once per module and the directory is kept aside; each call puts an
    exact copy back at the same path (the ledger records absolute paths). The
    uninterrupted test below races them again for itself: another interleaving is its point.
    """
    where = tmp_path_factory.mktemp("committed") / "run"
    args = _setup(where)
    return kept_aside(where, args)


@pytest.mark.slow
def test_two_uninterrupted_seeded_runs_end_with_equal_weights(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Two producer processes race to commit the dataset: another interleaving each time."""
    args = _setup(tmp_path / "again")
    assert _ranks(args, "only") == [0, 0]
    _assert_equal_weights(_weights(args, "only")[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize("resume_from", ["latest", "older"])
def test_sigkill_both_ranks_then_resume_ends_with_the_uninterrupted_weights(
    committed: Callable[[], dict[str, Any]],
    reference: dict[str, torch.Tensor],
    resume_from: str,
) -> None:
    # A random optimizer step; resuming from step 2 regenerates what later checkpoints released.
    kill_at = random.choice([3, 4, 5, 6] if resume_from == "latest" else [5, 6])
    args = committed()
    assert _ranks(args, "killed", kill_at=kill_at) == [-signal.SIGKILL, -signal.SIGKILL]
    with Ledger.open(args["ledger"]) as led:
        recorded = [c.step for c in replay(led, RUN).checkpoints]
    assert recorded == list(range(2, kill_at, 2)), kill_at  # killed before that step's save
    checkpoint = "latest" if resume_from == "latest" else 2
    assert _ranks(args, "resumed", checkpoint=checkpoint) == [0, 0]
    first, second = _weights(args, "resumed")
    _assert_equal_weights(first, second)
    _assert_equal_weights(first, reference)
    _assert_each_sample_once(args)
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
        regenerated = [e.sample_id for e in led.events(RUN) if e.kind == Kind.COMMIT and e.revision]
    if resume_from == "older" and recorded[-1] > 2:
        # Trained into checkpoints after step 2, so released: regenerated by rank 0.
        assert regenerated and "trainer-regenerate" in run.producers
        assert len(regenerated) == len(set(regenerated))


@pytest.mark.slow
def test_streaming_sigkill_then_resume_trains_every_sample_once(tmp_path: Path) -> None:
    """No seed: producers commit while the ranks train; arrival order, each sample once."""
    args = {**_setup(tmp_path / "run", concurrent_producers=False), "order_seed": None}
    producers = [start(_produce, args, share) for share in range(2)]
    killed = _ranks(args, "killed", kill_at=3)
    assert [join(p) for p in producers] == [0, 0]
    assert killed == [-signal.SIGKILL, -signal.SIGKILL]
    assert _ranks(args, "resumed") == [0, 0]
    _assert_each_sample_once(args)
    with Ledger.open(args["ledger"]) as led:
        acked = [s for e in led.events(RUN) if e.kind == Kind.ACK for s in e.sample_ids]
        run = replay(led, RUN)
    # Acks of the killed lineage after its last checkpoint are void; the final lineage
    # holds every committed sample exactly once.
    assert len(acked) >= SAMPLES and set(run.trained) == set(run.committed)


@pytest.mark.slow
def test_after_a_lineage_re_saved_a_step_the_resume_ends_with_the_uninterrupted_weights(
    committed: Callable[[], dict[str, Any]], reference: dict[str, torch.Tensor]
) -> None:
    args = committed()
    assert _ranks(args, "first", kill_at=5) == [-signal.SIGKILL] * 2  # saved steps 2 and 4
    # Back to step 2; this lineage saves step 4 again, then dies at step 5 too.
    assert _ranks(args, "second", checkpoint=2, kill_at=5) == [-signal.SIGKILL] * 2
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, RUN)
    fours = [c for c in run.checkpoints if c.step == 4]
    assert len(fours) == 2 and fours[0].path != fours[1].path  # one directory per lineage
    assert run.removed_checkpoints == {fours[0].seq: "rewind"}  # the abandoned step 4
    assert _ranks(args, "third") == [0, 0]  # from the latest: the new lineage's step 4
    _assert_equal_weights(_weights(args, "third")[0], reference)
    _assert_each_sample_once(args)
