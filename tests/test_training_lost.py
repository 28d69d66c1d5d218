"""Features that vanish or rot in a real shared-directory store while a run trains.

Files are deleted and bytes flipped on disk; the loader reports those samples lost
(not failed), the Trainer's ``regenerate_fn`` puts them back, and every committed
sample is trained exactly once. Without a ``regenerate_fn`` they wait, listed as lost,
until a producer regenerates them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, free_port, init_gloo, join

from dataflow import Consumer, Kind, Ledger, Producer, replay
from stores import SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

RUN = "run"
SAMPLES = 24
GONE = ("s003", "s010", "s017")
ROTTEN = "s021"


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    i = int(sample_id[1:])
    return {"x": torch.full((64,), float(i)), "y": torch.tensor([i % 3], dtype=torch.int64)}


def _regenerate(sample_ids: list[str]) -> Any:
    return ((sid, _features(sid)) for sid in sample_ids)


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Ledger, SharedDirFeatureStore]:
    """A committed dataset whose store lost three files and has one with a flipped bit."""
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = SharedDirFeatureStore(tmp_path / "features")
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i:03d}", _features(f"s{i:03d}")) for i in range(SAMPLES))
    producer.close()
    for sample_id in GONE:
        os.unlink(store._file(sample_id))
    path = Path(store._file(ROTTEN))
    data = bytearray(path.read_bytes())
    at = data.rindex(torch.tensor([21.0]).numpy().tobytes())  # inside the tensor "x"
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return led, store


def _trainer(led: Ledger, store: SharedDirFeatureStore, tmp_path: Path, **options: Any) -> Trainer:
    model = torch.nn.Linear(64, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[str] = []

    def step_fn(batch: Batch) -> None:
        loss = torch.nn.functional.cross_entropy(
            model(batch.features["x"]), batch.features["y"][:, 0]
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.extend(batch.sample_ids)

    trainer = Trainer(
        Consumer(led, store, run_id=RUN, consumer_id="trainer"),
        step_fn=step_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
        state_fn=lambda: {"model": model.state_dict()},
        load_fn=lambda state: model.load_state_dict(state["model"]),
        config=TrainerConfig(checkpoint_every=2),
        loader_config=LoaderConfig(batch_size=4),
        **options,
    )
    trainer.seen = seen  # type: ignore[attr-defined]
    return trainer


def test_lost_and_corrupt_features_are_regenerated_and_trained_once(damaged, tmp_path) -> None:
    led, store = damaged
    trainer = _trainer(led, store, tmp_path, regenerate_fn=_regenerate)
    with pytest.warns(UserWarning, match="reported lost and skipped") as caught:
        trainer.run()
    reasons = " ".join(str(w.message) for w in caught)
    assert "features corrupt" in reasons and ROTTEN in reasons
    assert "features gone" in reasons and all(sid in reasons for sid in GONE)
    state = replay(led, RUN)
    assert state.verify() == []
    assert sorted(state.trained) == [f"s{i:03d}" for i in range(SAMPLES)]
    assert sorted(trainer.seen) == sorted(state.trained)  # each sample stepped on once
    assert state.lost == {} and state.dead == {} and state.regenerate == {}
    events = list(led.events(RUN))
    assert sorted(e.sample_id for e in events if e.kind == Kind.LOST) == sorted((*GONE, ROTTEN))
    assert not any(e.kind == Kind.NACK for e in events)
    regenerated = [e for e in events if e.kind == Kind.COMMIT and e.revision]
    assert {e.actor for e in regenerated} == {"trainer-regenerate"}  # rank 0's id


def test_without_a_regenerate_fn_lost_samples_wait_for_a_producer(damaged, tmp_path) -> None:
    led, store = damaged
    with (
        pytest.warns(UserWarning, match="without a regenerate_fn, a producer must regenerate"),
        pytest.warns(UserWarning, match="reported lost and skipped") as skipped,
    ):
        _trainer(led, store, tmp_path).run()
    assert len([w for w in skipped if "reported lost and skipped" in str(w.message)]) == 4
    state = replay(led, RUN)
    assert set(state.lost) == {*GONE, ROTTEN} and set(state.regenerate) == {*GONE, ROTTEN}
    assert state.verify() == [] and state.dead == {}
    assert len(state.trained) == SAMPLES - 4

    producer = Producer(led, store, run_id=RUN, producer_id="rollout-again")
    for sample_id, tensors in _regenerate(sorted(state.regenerate)):
        producer.regenerate(sample_id, tensors)
    producer.close()
    _trainer(led, store, tmp_path).run()  # resumes from the last checkpoint
    state = replay(led, RUN)
    assert state.verify() == [] and state.lost == {}
    assert sorted(state.trained) == [f"s{i:03d}" for i in range(SAMPLES)]


# -- two ranks: lost after the ranks settled their count -----------------------------------------
def _rank(rank: int, port: int, where: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, port)
    led = Ledger.open(f"sqlite:///{where}/ledger.db")
    store = SharedDirFeatureStore(Path(where) / "features")
    trainer = Trainer(
        Consumer(led, store, run_id=RUN, consumer_id=f"rank{rank}", rank=rank, world_size=2),
        step_fn=lambda batch: None,
        checkpoints=CheckpointManager(CheckpointConfig(root=Path(where) / "ckpt")),
        state_fn=lambda: {"step": torch.tensor(0)},
        regenerate_fn=_regenerate,
        loader_config=LoaderConfig(batch_size=2, prefetch=1),
    )
    trainer.run()  # once: what comes back after the count was settled is trained in it
    Path(where, f"rank{rank}.json").write_text(json.dumps(trainer.consumer.finished))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_train_what_was_lost_after_their_count_was_settled_in_one_run(
    damaged, tmp_path
) -> None:
    led, _ = damaged  # a committed dataset: the ranks settle their count at the first batch
    port = free_port()
    ranks = [start(_rank, r, port, str(tmp_path)) for r in range(2)]
    assert [join(p) for p in ranks] == [0, 0]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [True] * 2
    state = replay(led, RUN)
    assert state.verify() == [] and state.leased == {} and state.regenerate == {}
    assert sorted(state.trained) == [f"s{i:03d}" for i in range(SAMPLES)]
    regenerated = [e for e in led.events(RUN) if e.kind == Kind.COMMIT and e.revision]
    assert sorted(e.sample_id for e in regenerated) == sorted((*GONE, ROTTEN))


def test_a_regenerate_fn_drawing_from_the_global_generators_leaves_the_training_s_alone(
    tmp_path: Path,
) -> None:
    # A deterministic producer that seeds the global generator per sample, and a step
    # that draws from it (dropout-like): a resume from an older checkpoint regenerates
    # released samples, and must still end with the uninterrupted run's weights.
    from stores import LocalFeatureStore
    from training import TrainerConfig

    def features(sample_id: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(int(sample_id[1:]))
        return {"x": torch.randn(2)}

    def run(where: Path, *, stop_at: int | None, resume_from: int | None = None) -> torch.Tensor:
        led = Ledger.open(f"sqlite:///{where}/ledger.db")
        store = LocalFeatureStore()
        producer = Producer(led, store, run_id=RUN)
        for i in range(12):
            producer.emit(f"s{i:02d}", features(f"s{i:02d}"))
        producer.close()
        weights = torch.zeros(2)

        def trainer(consumer_id: str, max_steps: int | None) -> Trainer:
            def step(batch: Any) -> None:
                weights.add_(batch.features["x"].sum(0) * torch.rand(1))

            return Trainer(
                Consumer(led, store, run_id=RUN, consumer_id=consumer_id, order_seed=5),
                step_fn=step,
                checkpoints=CheckpointManager(CheckpointConfig(root=where / "ckpt")),
                state_fn=lambda: {"w": weights.clone()},
                load_fn=lambda state: weights.copy_(state["w"]),
                regenerate_fn=lambda ids: ((i, features(i)) for i in ids),
                config=TrainerConfig(checkpoint_every=2, max_steps=max_steps),
                loader_config=LoaderConfig(batch_size=2),
            )

        torch.manual_seed(0)
        trainer("a", stop_at).run()
        if resume_from is not None:
            again = trainer("b", None)
            again.resume(resume_from)
            assert again.plan is not None and again.plan.regenerate  # released at step 4
            again.run()
        assert replay(led, RUN).verify() == []
        return weights

    uninterrupted = run(tmp_path / "a", stop_at=None)
    (tmp_path / "b").mkdir()
    resumed = run(tmp_path / "b", stop_at=4, resume_from=2)
    assert torch.equal(resumed, uninterrupted)
