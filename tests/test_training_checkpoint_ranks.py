"""CheckpointManager across two real gloo ranks (real processes, one SQLite ledger file).

Covers: every rank saving its own ``rank-XXXXX.pt`` next to rank 0's ``state.pt``
and loading it back (RNG included) after a resume in new processes; an error on
one rank during a save raised on both ranks (never a hang), with nothing
published and nothing recorded; ``is_best`` taking rank 0's verdict on every
rank; a two-rank checkpoint refused by a one-rank resume without fencing anyone
off, and resumed by one with ``allow_resize`` (rank 0's own state only); and
asynchronous saves recorded once every rank waited.

Each child writes a small JSON result that the test asserts on; a child that
hangs is killed and fails the test.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, init_gloo, join, run_args

import training
from dataflow import Consumer, Kind, Ledger, replay
from stores import SharedDirFeatureStore
from training import CheckpointConfig, CheckpointError, CheckpointManager

# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

RUN = "run"
ACC = "eval/simulated_acc_len"
CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 30
RANK_FILES = ["rank-00000.pt", "rank-00001.pt"]


class Opaque:
    """Not a tensor, container or scalar: weights_only loading refuses it."""


class _FailsOnRank0(CheckpointManager):
    """Rank 0's disk fails while it writes its files; rank 1's works."""

    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        super()._write(file, obj)
        assert self.consumer is not None
        if self.consumer.rank == 0:
            raise OSError("disk failed on rank 0")


def _model() -> dict[str, Any]:
    """The replicated state: the same on both ranks."""
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}


def _shard(rank: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def _draws() -> dict[str, Any]:
    """What a rank draws from its RNGs next."""
    return {"torch": torch.rand(4).tolist(), "python": random.random()}


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "kinds": [cls.__name__ for cls in type(exc).__mro__],  # ValueError for its subclasses too
        "message": str(exc),
        "checkpoint_error": isinstance(exc, CheckpointError),
    }


# -- what each rank does ---------------------------------------------------------------------
def _save(rank: int, args: dict[str, Any], consumer: Consumer) -> dict[str, Any]:
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    plan, state = manager.resume(consumer)
    torch.manual_seed(100 + rank)  # each rank's RNG differs
    random.seed(100 + rank)
    rng = training.rng_state()
    draws = _draws()
    path = manager.save(
        args["step"],
        _model(),
        rank_state={"shard": _shard(rank), "rng": rng, "position": rank * 10},
    )
    return {
        "path": str(path),
        "resumed_from": plan.checkpoint,
        "state": state,
        "draws": draws,
    }


def _resume(rank: int, args: dict[str, Any], consumer: Consumer) -> dict[str, Any]:
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    plan, state = manager.resume(consumer)
    assert plan.checkpoint is not None and state is not None
    mine = manager.load_rank_state(plan.checkpoint, rank=rank)
    torch.manual_seed(999)  # whatever this process drew so far is overwritten below
    random.seed(999)
    training.set_rng_state(mine["rng"])
    return {
        "resumed_from": plan.checkpoint.step,
        "model_matches": torch.equal(state["model"]["w"], _model()["model"]["w"]),
        "shard": mine["shard"].tolist(),
        "position": mine["position"],
        "draws": _draws(),
    }


def _fail(rank: int, args: dict[str, Any], consumer: Consumer) -> dict[str, Any]:
    kind = _FailsOnRank0 if args["failure"] == "write_on_rank0" else CheckpointManager
    manager = kind(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    manager.resume(consumer)
    rank_state: dict[str, Any] = {"shard": _shard(rank)}
    if args["failure"] == "opaque_on_rank1" and rank == 1:
        rank_state["counter"] = Opaque()
    result: dict[str, Any] = {}
    try:
        manager.save(1, _model(), rank_state=rank_state)
    except Exception as exc:
        result["error"] = _error(exc)
    # Both ranks left the save at the same meeting: the next collective lines up.
    result["then_is_best"] = manager.is_best({ACC: 1.0})
    return result


def _best(rank: int, args: dict[str, Any], consumer: Consumer) -> dict[str, Any]:
    manager = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id=RUN))
    manager.resume(consumer)
    manager.save(1, _model(), rank_state={"shard": _shard(rank)}, metrics={ACC: 0.5})
    # Rank 0's metrics beat the saved 0.5, rank 1's do not; then the other way round.
    better = manager.is_best({ACC: 0.7} if rank == 0 else {ACC: 0.1})
    worse = manager.is_best({ACC: 0.3} if rank == 0 else {ACC: 0.9})
    unmeasured = manager.is_best(None if rank == 0 else {ACC: 0.9})
    result: dict[str, Any] = {"better": better, "worse": worse, "unmeasured": unmeasured}
    try:
        manager.is_best({ACC: "high"} if rank == 0 else {ACC: 0.9})  # type: ignore[dict-item]
    except Exception as exc:
        result["error"] = _error(exc)
    return result


def _async(rank: int, args: dict[str, Any], consumer: Consumer) -> dict[str, Any]:
    config = CheckpointConfig(root=args["ckpt"], run_id=RUN, async_save=True)
    manager = CheckpointManager(config)
    manager.resume(consumer)
    shard = _shard(rank)
    model = _model()
    first = manager.save(2, model, rank_state={"shard": shard, "position": rank})
    # Training goes on while the files are written: in-place updates after save
    # returned must not reach the checkpoint.
    shard.add_(100.0)
    model["model"]["w"].add_(100.0)
    manager.wait()
    after_wait = [(c.step, c.path) for c in replay(consumer.ledger, RUN).checkpoints]
    second = manager.save(4, model, rank_state={"shard": shard, "position": rank + 1})
    manager.close()
    after_close = [(c.step, c.path) for c in replay(consumer.ledger, RUN).checkpoints]
    return {
        "paths": [str(first), str(second)],
        "after_wait": after_wait,
        "after_close": after_close,
    }


MODES = {"save": _save, "resume": _resume, "fail": _fail, "best": _best, "async": _async}


def _rank_in_child(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    try:
        led = Ledger.open(args["ledger"])
        consumer = Consumer(
            led,
            SharedDirFeatureStore(args["features"]),
            run_id=RUN,
            consumer_id=f"{args['mode']}-rank{rank}",
            rank=rank,
            world_size=2,
        )
        result = MODES[args["mode"]](rank, args, consumer)
        out = Path(args["out"]) / f"{args['mode']}-rank{rank}.json"
        out.write_text(json.dumps(result))
        dist.barrier()  # neither rank tears its group down while the other still talks to it
    finally:
        dist.destroy_process_group()


# -- the parent side -------------------------------------------------------------------------
def _run_ranks(tmp_path: Path, mode: str, **extra: Any) -> list[dict[str, Any]]:
    """Run ``mode`` on two gloo ranks in fresh processes; their results, in rank order."""
    args = run_args(tmp_path, mode=mode, **extra)
    ranks = [start(_rank_in_child, r, args) for r in range(2)]
    assert [join(process) for process in ranks] == [0, 0]
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def _ledger(tmp_path: Path) -> Ledger:
    return Ledger.open(f"sqlite:///{tmp_path}/ledger.db")


def _manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _run_dir_entries(tmp_path: Path) -> list[str]:
    run_dir = tmp_path / "ckpt" / RUN
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []


@pytest.mark.slow
def test_each_rank_saves_its_own_state_and_gets_it_back_after_a_resume(tmp_path: Path) -> None:
    saved = _run_ranks(tmp_path, "save", step=3)
    path = tmp_path / "ckpt" / RUN / "step-00000003-epoch-1"
    assert [r["path"] for r in saved] == [str(path), str(path)]
    assert [(r["resumed_from"], r["state"]) for r in saved] == [(None, None), (None, None)]
    assert saved[0]["draws"] != saved[1]["draws"]  # so a mixed-up rank file would show

    manifest_bytes = (path / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    assert manifest["world_size"] == 2
    assert sorted(manifest["files"]) == ["rank-00000.pt", "rank-00001.pt", "state.pt"]
    for name, entry in manifest["files"].items():
        assert entry == {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    assert sorted(p.name for p in path.iterdir()) == sorted(["manifest.json", *manifest["files"]])
    assert _run_dir_entries(tmp_path) == [path.name]  # no temporary directory left

    manager = _manager(tmp_path)
    assert torch.equal(manager.load(3)["model"]["w"], _model()["model"]["w"])
    for rank in range(2):
        mine = manager.load_rank_state(3, rank=rank)
        assert sorted(mine) == ["position", "rng", "shard"]
        assert torch.equal(mine["shard"], _shard(rank))
        assert mine["position"] == rank * 10
    with pytest.raises(CheckpointError, match="holds the state of 2 ranks, not of rank 2"):
        manager.load_rank_state(3, rank=2)

    led = _ledger(tmp_path)
    run = replay(led, RUN)
    [recorded] = run.checkpoints
    assert (recorded.step, recorded.path) == (3, str(path))
    assert recorded.digest == hashlib.sha256(manifest_bytes).hexdigest()
    assert run.verify() == []

    resumed = _run_ranks(tmp_path, "resume")
    for rank, result in enumerate(resumed):
        assert result["resumed_from"] == 3
        assert result["model_matches"]
        assert result["shard"] == _shard(rank).tolist()
        assert result["position"] == rank * 10
        # The RNG continues exactly where the first run's rank stood when it saved.
        assert result["draws"] == saved[rank]["draws"]
    run = replay(led, RUN)
    assert run.epoch == 2 and run.plans[2].checkpoint_step == 3
    assert run.verify() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failure", "failing", "error", "match"),
    [
        ("opaque_on_rank1", 1, "ValueError", "weights_only"),
        ("write_on_rank0", 0, "OSError", "disk failed on rank 0"),
    ],
)
def test_a_save_failing_on_one_rank_fails_on_both_and_publishes_nothing(
    tmp_path: Path, failure: str, failing: int, error: str, match: str
) -> None:
    results = _run_ranks(tmp_path, "fail", failure=failure)
    own = results[failing]["error"]
    assert error in own["kinds"] and match in own["message"]
    assert not own["checkpoint_error"]
    other_rank = 1 - failing
    other = results[other_rank]["error"]
    assert other["checkpoint_error"]
    assert f"checkpoint save at step 1 failed on rank {failing}" in other["message"]
    assert f"this is rank {other_rank}" in other["message"]
    assert match in other["message"]  # the failing rank's reason travels along
    # A gloo timeout would have been a different error; and the ranks stayed in step.
    assert [r["then_is_best"] for r in results] == [True, True]

    assert _run_dir_entries(tmp_path) == []  # neither step-* nor .tmp-*
    assert not (tmp_path / "ckpt" / f"{RUN}-latest").exists()
    assert _manager(tmp_path).saved() == []
    run = replay(_ledger(tmp_path), RUN)
    assert run.checkpoints == []
    assert run.verify() == []


@pytest.mark.slow
def test_is_best_is_rank_0s_verdict_on_every_rank(tmp_path: Path) -> None:
    results = _run_ranks(tmp_path, "best")
    for result in results:
        assert (result["better"], result["worse"], result["unmeasured"]) == (True, False, False)
    assert "ValueError" in results[0]["error"]["kinds"]
    assert "must be a number" in results[0]["error"]["message"]
    assert results[1]["error"]["checkpoint_error"]
    assert "best-checkpoint decision failed on rank 0" in results[1]["error"]["message"]
    best = _manager(tmp_path).best()
    assert best is not None and best.step == 1


@pytest.mark.slow
def test_a_two_rank_checkpoint_is_refused_by_a_one_rank_resume(tmp_path: Path) -> None:
    _run_ranks(tmp_path, "save", step=3)
    led = _ledger(tmp_path)
    before = replay(led, RUN)
    events = len(list(led.events(RUN)))
    manager = _manager(tmp_path)
    store = SharedDirFeatureStore(tmp_path / "features")

    def single(name: str) -> Consumer:
        return Consumer(led, store, run_id=RUN, consumer_id=name, world_size=1)

    refused = "holds the state of 2 ranks; this run resumes with 1.* pass allow_resize=True"
    with pytest.raises(training.IncompatibleCheckpointError, match=refused):
        manager.resume(single("by-step"), 3)
    # Not damaged, so "latest" does not fall back to an older checkpoint: it refuses.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(training.IncompatibleCheckpointError, match=refused):
            manager.resume(single("latest"))
    assert manager.resumed_from is None
    after = replay(led, RUN)
    assert after.epoch == before.epoch == 1  # nobody was fenced off
    assert len(list(led.events(RUN))) == events
    assert not [e for e in led.events(RUN) if e.kind == Kind.RESUME and e.epoch > 1]
    assert after.verify() == []


@pytest.mark.slow
def test_with_allow_resize_one_rank_resumes_a_two_rank_checkpoint(tmp_path: Path) -> None:
    saved = _run_ranks(tmp_path, "save", step=3)
    led = _ledger(tmp_path)
    manager = _manager(tmp_path)
    consumer = Consumer(
        led, SharedDirFeatureStore(tmp_path / "features"), run_id=RUN, consumer_id="one"
    )
    checked: list[Any] = []
    plan, state = manager.resume(
        consumer, check=lambda state, own: checked.append(own), allow_resize=True
    )
    assert plan.checkpoint is not None and plan.checkpoint.step == 3
    assert state is not None and torch.equal(state["model"]["w"], _model()["model"]["w"])
    [own] = checked  # rank 0's own state, from the rank-00000.pt of the old world
    assert torch.equal(own["shard"], _shard(0)) and own["position"] == 0
    training.set_rng_state(own["rng"])
    assert _draws() == saved[0]["draws"]
    resumed = manager.resumed_from
    assert resumed is not None and (resumed.step, resumed.world_size) == (3, 2)
    run = replay(led, RUN)
    assert run.epoch == 2 and run.plans[2].world_size == 1
    # Saves go on with the files of the new world: one rank file.
    path = manager.save(4, _model(), rank_state={"shard": _shard(0)})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["rank-00000.pt", "state.pt"]
    assert replay(led, RUN).verify() == []
    with pytest.raises(ValueError, match="allow_resize must be a bool"):
        manager.resume(consumer, allow_resize="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_async_saves_on_two_ranks_are_recorded_once_both_waited(tmp_path: Path) -> None:
    results = _run_ranks(tmp_path, "async")
    run_dir = tmp_path / "ckpt" / RUN
    first, second = run_dir / "step-00000002-epoch-1", run_dir / "step-00000004-epoch-1"
    for result in results:
        assert result["paths"] == [str(first), str(second)]
        assert result["after_wait"] == [[2, str(first)]]
        assert result["after_close"] == [[2, str(first)], [4, str(second)]]

    run = replay(_ledger(tmp_path), RUN)
    assert [(c.step, c.digest) for c in run.checkpoints] == [
        (2, _sha256(first / "manifest.json")),
        (4, _sha256(second / "manifest.json")),
    ]
    assert run.verify() == []
    manager = _manager(tmp_path)
    # Saved as they were when save() returned; the updates after it went into step 4.
    assert torch.equal(manager.load(2)["model"]["w"], _model()["model"]["w"])
    assert torch.equal(manager.load(4)["model"]["w"], _model()["model"]["w"] + 100)
    for rank in range(2):
        at_2 = manager.load_rank_state(2, rank=rank)
        assert torch.equal(at_2["shard"], _shard(rank)) and at_2["position"] == rank
        at_4 = manager.load_rank_state(4, rank=rank)
        assert torch.equal(at_4["shard"], _shard(rank) + 100) and at_4["position"] == rank + 1
    assert _run_dir_entries(tmp_path) == [first.name, second.name]
