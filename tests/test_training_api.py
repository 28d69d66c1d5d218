"""The public surface of `training`, TrainerConfig, and the Trainer's argument checks."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import training
from dataflow import Consumer, Ledger, Producer, replay
from eval import Evaluator
from stores import LocalFeatureStore
from training import CheckpointConfig, CheckpointManager, LoaderConfig, Trainer, TrainerConfig

RUN = "run"


def test_exported_names() -> None:
    assert training.__all__ == sorted(training.__all__)
    assert set(training.__all__) == {
        "Batch",
        "COMPONENTS",
        "CheckpointConfig",
        "CheckpointError",
        "CheckpointManager",
        "CheckpointNotFoundError",
        "CorruptCheckpointError",
        "FeatureLoader",
        "IncompatibleCheckpointError",
        "LoaderConfig",
        "PadCollate",
        "REGENERATE_PRODUCER_ID",
        "SavedCheckpoint",
        "StepHelper",
        "Trainer",
        "TrainerConfig",
        "TrainingError",
        "collate",
        "rng_state",
        "set_rng_state",
    }
    for name in training.__all__:
        assert hasattr(training, name), name


@pytest.mark.parametrize(
    "config", [training.CheckpointConfig, training.LoaderConfig, training.TrainerConfig]
)
def test_configs_are_keyword_only_frozen_and_documented(config: type) -> None:
    params = dataclasses.fields(config)
    assert config.__dataclass_params__.frozen
    assert all(field.kw_only for field in params)
    source = Path(training._config.__file__).read_text()
    for field in params:  # a docstring right under every field
        assert f"    {field.name}: " in source
        after = source.split(f"    {field.name}: ", 1)[1].splitlines()[1].strip()
        assert after.startswith('"""'), field.name


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"max_steps": 0}, "max_steps must be >= 1, got 0"),
        ({"grad_accum": 0}, "grad_accum must be >= 1, got 0"),
        ({"grad_accum": True}, "grad_accum must be an int, got bool True"),
        ({"checkpoint_every": -1}, "checkpoint_every must be >= 0, got -1"),
        ({"eval_every": 0.5}, "eval_every must be an int, got float 0.5"),
        ({"allow_resize": 1}, "allow_resize must be a bool, got 1"),
    ],
)
def test_trainer_config_rejects_bad_values(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**config)


def test_trainer_config_warns_when_checkpoints_miss_the_eval_cadence() -> None:
    with pytest.warns(UserWarning, match="checkpoint_every=3 is not a multiple of eval_every=2"):
        TrainerConfig(checkpoint_every=3, eval_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainerConfig(checkpoint_every=4, eval_every=2)


@pytest.fixture
def parts(tmp_path: Path) -> dict[str, Any]:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore()
    producer = Producer(led, store, run_id=RUN)
    for i in range(8):
        producer.emit(f"s{i}", {"x": torch.randn(2)})
    producer.close()
    yield {
        "led": led,
        "store": store,
        "consumer": Consumer(led, store, run_id=RUN, consumer_id="trainer"),
        "checkpoints": CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
    }
    store.close()
    led.close()


def _trainer(parts: dict[str, Any], **overrides: Any) -> Trainer:
    kwargs = {
        "step_fn": lambda batch: None,
        "checkpoints": parts["checkpoints"],
        "state_fn": lambda: {"w": torch.zeros(1)},
        **overrides,
    }
    return Trainer(parts["consumer"], **kwargs)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"step_fn": None}, "step_fn must be callable"),
        ({"state_fn": "state"}, "state_fn must be callable"),
        ({"load_fn": 3}, "load_fn must be callable"),
        ({"checkpoints": "ckpt"}, "checkpoints must be a CheckpointManager"),
        ({"config": {"grad_accum": 2}}, "config must be a TrainerConfig"),
        ({"config": TrainerConfig(grad_accum=2)}, "grad_accum=2 needs an optimizer_fn"),
        ({"evaluator": Evaluator()}, "an evaluator needs an eval_fn"),
        ({"evaluator": "eval"}, "evaluator must be an eval.Evaluator"),
        ({"eval_fn": (lambda b: b, iter([1]))}, "an iterator, which the first eval"),
        ({"eval_fn": [1, 2]}, "eval_fn must be a function"),
        ({"rank_state_fn": 1}, "rank_state_fn must be callable"),
        ({"rank_state_fn": dict}, "rank_state_fn and load_rank_fn come together"),
        ({"load_rank_fn": print}, "rank_state_fn and load_rank_fn come together"),
    ],
)
def test_trainer_rejects_bad_arguments(parts, overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _trainer(parts, **overrides)


def test_trainer_refuses_a_checkpoint_manager_of_another_consumer(parts) -> None:
    other = Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="other")
    checkpoints = CheckpointManager(parts["checkpoints"].config, consumer=other)
    with pytest.raises(ValueError, match="attached to another consumer"):
        _trainer(parts, checkpoints=checkpoints)


def test_trainer_warns_about_an_eval_that_never_runs(parts) -> None:
    with pytest.warns(UserWarning, match="eval_every=0: evaluation never runs"):
        _trainer(parts, eval_fn=lambda: [])
    with pytest.warns(UserWarning, match="eval_every=2 but no eval_fn"):
        _trainer(parts, config=TrainerConfig(eval_every=2))


def test_run_refuses_to_drop_a_resumed_state(parts) -> None:
    first = _trainer(parts, config=TrainerConfig(max_steps=1))
    assert first.run() == 1
    second = _trainer(
        {**parts, "consumer": Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="2")},
        checkpoints=CheckpointManager(parts["checkpoints"].config),
    )
    with pytest.raises(ValueError, match="resumed from the checkpoint at step 1, but there is no"):
        second.run()


def test_run_after_an_explicit_resume_continues_the_steps(parts) -> None:
    steps: list[int] = []
    one_by_one = LoaderConfig(batch_size=1)
    first = _trainer(
        parts,
        config=TrainerConfig(max_steps=2),
        optimizer_fn=steps.append,
        loader_config=one_by_one,
    )
    assert first.run() == 2
    consumer = Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="2")
    trainer = _trainer(
        {**parts, "consumer": consumer},
        optimizer_fn=steps.append,
        checkpoints=CheckpointManager(parts["checkpoints"].config),
        loader_config=one_by_one,
    )
    state = trainer.resume()
    assert state == {
        "w": torch.zeros(1),
        "trainer": {"grad_accum": 1, "world_size": 1, "order_seed": None, "dataset_size": None},
    }
    assert trainer.step == 2
    assert trainer.run() == 8
    assert steps == list(range(1, 9))
    state = replay(parts["led"], RUN)
    assert state.verify() == []
    assert sorted(state.trained.values()) == list(range(1, 9))
    assert [c.step for c in state.checkpoints] == [2, 8]


def test_a_multi_rank_trainer_needs_torch_distributed(parts) -> None:
    consumer = Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="r0", world_size=2)
    trainer = _trainer({**parts, "consumer": consumer})
    with pytest.raises(ValueError, match=r"world_size=2 needs torch\.distributed initialized"):
        trainer.run()


def test_evaluate_without_an_eval_fn(parts) -> None:
    with pytest.raises(ValueError, match="no eval_fn"):
        _trainer(parts).evaluate()


def test_a_trainer_saves_and_restores_each_ranks_own_state(parts) -> None:
    positions: list[int] = []
    first = _trainer(
        parts,
        config=TrainerConfig(max_steps=3, checkpoint_every=1),
        loader_config=LoaderConfig(batch_size=2),
        rank_state_fn=lambda: {"data": {"position": 2 * first.step}, "rng": training.rng_state()},
        load_rank_fn=lambda state: positions.append(state["data"]["position"]),
    )
    assert first.run() == 3
    consumer = Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="2")
    second = _trainer(
        {**parts, "consumer": consumer},
        checkpoints=CheckpointManager(parts["checkpoints"].config),
        loader_config=LoaderConfig(batch_size=2),
        rank_state_fn=dict,
        load_rank_fn=lambda state: positions.append(state["data"]["position"]),
    )
    with pytest.warns(UserWarning, match="must be trained again"):
        second.resume(2)  # the samples of step 3 were released: they need regenerating
    assert positions == [4]


def test_an_eval_that_beats_the_best_saves_off_the_cadence(parts) -> None:
    correct = iter([5, 4, 9, 1, 2, 3])  # of 10: the acceptance of each eval
    trainer = _trainer(
        parts,
        eval_fn=lambda: [
            {"loss": 1.0, "num_tokens": 10, "accuracy_correct": next(correct), "accuracy_denom": 10}
        ],
        config=TrainerConfig(max_steps=6, checkpoint_every=4, eval_every=1),
        loader_config=LoaderConfig(batch_size=1),
    )
    assert trainer.run() == 6
    saved = {c.step for c in parts["checkpoints"].saved()}
    # 1 (the first eval), 3 (0.9 beats 0.5), 4 (the cadence) and 6 (the final save).
    assert saved == {1, 3, 4, 6}


def _seeded_parts(tmp_path: Path, name: str) -> dict[str, Any]:
    led = Ledger.open(f"sqlite:///{tmp_path}/{name}.db")
    store = LocalFeatureStore()
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i:02d}", _features(i)) for i in range(24))
    producer.close()
    return {"led": led, "store": store, "ckpt": tmp_path / f"{name}-ckpt"}


def _features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(i % 5), float(i % 3)], dtype=torch.float64)}


def _seeded_trainer(
    parts: dict[str, Any], name: str, net: torch.nn.Module, *, world_size: int = 1, **kw: Any
) -> Trainer:
    optimizer = torch.optim.SGD(net.parameters(), lr=2**-6, momentum=0.5)

    def load_fn(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    consumer = Consumer(
        parts["led"],
        parts["store"],
        run_id=RUN,
        consumer_id=name,
        world_size=world_size,
        order_seed=3,
    )
    kw.setdefault("checkpoints", CheckpointManager(CheckpointConfig(root=parts["ckpt"])))
    return Trainer(
        consumer,
        step_fn=lambda batch: net(batch.features["x"]).pow(2).sum().backward(),
        optimizer_fn=optimizer_fn,
        state_fn=lambda: {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
        load_fn=load_fn,
        config=TrainerConfig(grad_accum=2, checkpoint_every=2),
        loader_config=LoaderConfig(batch_size=2),
        **kw,
    )


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(2, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    return model


def _first_two_steps(parts: dict[str, Any], **kw: Any) -> Trainer:
    """A first trainer that stops after step 2, its checkpoint saved."""
    first = _seeded_trainer(parts, "first", _model(), **kw)
    first.config = TrainerConfig(grad_accum=2, checkpoint_every=2, max_steps=2)
    assert first.run() == 2
    return first


def _commit_one_more(parts: dict[str, Any]) -> None:
    late = Producer(parts["led"], parts["store"], run_id=RUN, producer_id="late")
    late.emit("late", _features(0))
    late.close()


def test_a_resume_that_regenerates_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    reference = _model()
    parts = _seeded_parts(tmp_path, "reference")
    assert _seeded_trainer(parts, "ref", reference).run() == 6

    parts = _seeded_parts(tmp_path, "resumed")
    _seeded_trainer(parts, "first", _model()).run()  # to the end: everything released
    asked: list[list[str]] = []

    def regenerate_fn(sample_ids: list[str]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        asked.append(sample_ids)
        for sample_id in reversed(sample_ids):  # any order: the seed decides the places
            yield sample_id, _features(int(sample_id[1:]))

    model = _model()
    second = _seeded_trainer(parts, "second", model, regenerate_fn=regenerate_fn)
    second.resume(2)  # an older checkpoint: 16 samples after it were released
    assert len(asked[0]) == 16
    assert second.run() == 6
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    run = replay(parts["led"], RUN)
    assert run.verify() == [] and len(run.trained) == 24
    assert training.REGENERATE_PRODUCER_ID in run.producers


def test_a_regenerate_fn_that_leaves_samples_out_fails_the_resume(tmp_path: Path) -> None:
    parts = _seeded_parts(tmp_path, "run")
    _seeded_trainer(parts, "first", _model()).run()
    second = _seeded_trainer(parts, "second", _model(), regenerate_fn=lambda ids: iter(()))
    with pytest.raises(ValueError, match="regenerate_fn left out 16 samples"):
        second.resume(2)
    third = _seeded_trainer(
        parts, "third", _model(), regenerate_fn=lambda ids: [("zzz", _features(0))]
    )
    with pytest.raises(ValueError, match="returned 'zzz', which is not to regenerate"):
        third.resume(2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"config": TrainerConfig(grad_accum=1, checkpoint_every=2)}, "grad_accum was 2, now 1"),
        ({"order_seed": 4}, "order_seed was 3, now 4"),
        ({"order_seed": None}, "order_seed was 3, now None"),
        ({"extra_samples": 1}, "dataset_size was 24, now 25"),
    ],
)
def test_a_checkpoint_of_a_differently_set_up_run_is_refused_before_the_resume(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    parts = _seeded_parts(tmp_path, "run")
    _first_two_steps(parts)
    if change.get("extra_samples"):
        _commit_one_more(parts)
    second = _seeded_trainer(parts, "second", _model())
    consumer = second.consumer
    if "order_seed" in change:
        consumer.order_seed = change["order_seed"]
    if "config" in change:
        second.config = change["config"]
    head = parts["led"].head_seq(RUN)
    with pytest.raises(training.IncompatibleCheckpointError, match=match):
        second.resume()
    assert parts["led"].head_seq(RUN) == head  # nobody fenced off, nothing written
    assert issubclass(training.IncompatibleCheckpointError, ValueError)


@pytest.mark.parametrize(("batch_size", "ok"), [(2, True), (4, True), (1, True), (3, False)])
def test_a_resume_may_change_the_batch_size_where_it_divides_the_position(
    tmp_path: Path, batch_size: int, ok: bool
) -> None:
    parts = _seeded_parts(tmp_path, "run")
    first = _seeded_trainer(parts, "first", _model())
    first.config = TrainerConfig(grad_accum=2, checkpoint_every=2, max_steps=2)
    first.run()  # 2 steps x 2 micro-batches x 2 samples: position 8
    assert first.position == 8
    saved = first.checkpoints.load_rank_state(rank=0)
    assert saved["data"] == {"position": 8, "batch_size": 2}
    second = _seeded_trainer(parts, "second", _model())
    second.loader = training.FeatureLoader(
        second.consumer, config=LoaderConfig(batch_size=batch_size)
    )
    head = parts["led"].head_seq(RUN)
    if not ok:
        refused = training.IncompatibleCheckpointError
        with pytest.raises(refused, match="not a multiple of batch_size=3"):
            second.resume()
        assert parts["led"].head_seq(RUN) == head
        return
    second.resume()
    assert second.position == 8
    assert second.run() > 2
    assert replay(parts["led"], RUN).verify() == []


def _plain_trainer(
    led: Ledger, store: LocalFeatureStore, ckpt: Path, name: str, *, batch_size: int, **kw: Any
) -> Trainer:
    """A seeded trainer that checkpoints every step and trains nothing real."""
    seen = kw.pop("seen", [])
    return Trainer(
        Consumer(led, store, run_id=RUN, consumer_id=name, order_seed=3),
        step_fn=lambda batch: seen.extend(batch.sample_ids),
        checkpoints=CheckpointManager(CheckpointConfig(root=ckpt)),
        state_fn=lambda: {"w": torch.zeros(1)},
        load_fn=lambda state: None,
        config=TrainerConfig(checkpoint_every=1, max_steps=kw.pop("max_steps", None)),
        loader_config=LoaderConfig(batch_size=batch_size),
        **kw,
    )


def _emitted(tmp_path: Path, n: int) -> tuple[Ledger, LocalFeatureStore]:
    led = Ledger.open(f"sqlite:///{tmp_path}/plain.db")
    store = LocalFeatureStore()
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i:02d}", _features(i)) for i in range(n))
    producer.close()
    return led, store


@pytest.mark.parametrize(("batch_size", "ok"), [(4, True), (5, True), (3, False)])
def test_a_seeded_run_resumes_from_a_position_its_short_last_batch_left(
    tmp_path: Path, batch_size: int, ok: bool
) -> None:
    # 10 samples in batches of 4: the final checkpoint's position is 10, no multiple of 4.
    led, store = _emitted(tmp_path, 10)
    first = _plain_trainer(led, store, tmp_path / "ckpt", "first", batch_size=4)
    assert first.run() == 3 and first.position == 10
    again = _plain_trainer(led, store, tmp_path / "ckpt", "again", batch_size=batch_size)
    if not ok:  # another batch size still has to divide the position
        with pytest.raises(training.IncompatibleCheckpointError, match="batch_size=3"):
            again.resume()
        return
    again.resume()
    assert (again.step, again.position) == (3, 10)
    assert again.run() == 3
    assert replay(led, RUN).verify() == []


def test_a_seeded_run_resumes_after_a_batch_that_lost_a_sample(tmp_path: Path) -> None:
    led, store = _emitted(tmp_path, 16)
    seen: list[str] = []
    regenerate = {"regenerate_fn": lambda ids: ((sid, _features(int(sid[1:]))) for sid in ids)}
    first = _plain_trainer(
        led, store, tmp_path / "ckpt", "first", batch_size=4, max_steps=2, seen=seen, **regenerate
    )
    first.resume()
    lost = next(first.consumer.state.pending_for(0))
    store.delete(replay(led, RUN).ref(lost))
    with pytest.warns(UserWarning, match=lost):
        assert first.run() == 2
    assert first.position == 7  # the first batch was one short
    again = _plain_trainer(
        led, store, tmp_path / "ckpt", "again", batch_size=4, seen=seen, **regenerate
    )
    again.run()
    run = replay(led, RUN)
    assert run.verify() == [] and len(run.trained) == 16
    assert sorted(seen) == sorted(run.trained)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_trainer_resumed_again_in_its_process_hands_out_nothing_of_the_old_epoch(
    tmp_path: Path, grad_accum: int
) -> None:
    led, store = _emitted(tmp_path, 20)
    seen: list[str] = []
    calls = {"n": 0}

    def step_fn(batch: training.Batch) -> None:
        calls["n"] += 1
        if calls["n"] == 4:  # once the lease ahead has read its batches, as it may have
            ahead = trainer.loader._ahead
            while ahead is not None and not ahead.done():
                time.sleep(0.01)
            raise RuntimeError("the step failed")
        seen.extend(batch.sample_ids)

    trainer = Trainer(
        Consumer(led, store, run_id=RUN, consumer_id="t"),
        step_fn=step_fn,
        optimizer_fn=lambda step: None,
        checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
        state_fn=lambda: {"w": torch.zeros(1)},
        load_fn=lambda state: None,
        config=TrainerConfig(checkpoint_every=1, grad_accum=grad_accum),
        loader_config=LoaderConfig(batch_size=2, prefetch=2),
    )
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer.run()
    assert trainer.loader._ahead is not None  # batches of the old epoch, read ahead
    trained_before = set(replay(led, RUN).trained)
    trainer.resume()
    trainer.run()
    run = replay(led, RUN)
    assert run.verify() == [] and len(run.trained) == 20
    # The new epoch trained each sample the checkpoint had not, once, and nothing else.
    resumed = seen[len(trained_before) + 2 * (grad_accum == 2) :]
    assert sorted(resumed) == sorted(set(run.trained) - trained_before)


def test_feature_loader_state_dict(parts) -> None:
    consumer = parts["consumer"]
    consumer.resume()
    loader = training.FeatureLoader(consumer, config=LoaderConfig(batch_size=3))
    loader.next_batch()
    assert loader.state_dict() == {"position": 3, "batch_size": 3}
    other = training.FeatureLoader(consumer, config=LoaderConfig(batch_size=1))
    other.load_state_dict(loader.state_dict())
    assert other.position == 3
    # Arrival order: a position only counts what was handed out (a stream's batches may
    # be short), so any batch size continues from it.
    arrival = training.FeatureLoader(consumer, config=LoaderConfig(batch_size=2))
    arrival.load_state_dict({"position": 3})
    assert arrival.position == 3
    # A seeded order: a place in the rank's queue, where batches must line up.
    consumer.order_seed = 7
    seeded = training.FeatureLoader(consumer, config=LoaderConfig(batch_size=2))
    for state in ({"position": 3}, {"position": 3, "batch_size": 3}):
        with pytest.raises(ValueError, match="not a multiple of batch_size=2"):
            seeded.load_state_dict(state)
    seeded.load_state_dict({"position": 3, "batch_size": 2})  # its own batch size: any
    assert seeded.position == 3
    for bad in ({}, {"position": "3"}, [3]):
        with pytest.raises(ValueError, match="not a FeatureLoader state"):
            other.load_state_dict(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="position must be an int >= 0, got -1"):
        other.load_state_dict({"position": -1})


def test_a_model_with_other_keys_is_refused_before_the_resume(tmp_path: Path) -> None:
    parts = _seeded_parts(tmp_path, "run")
    first = _seeded_trainer(parts, "first", _model())
    first.config = TrainerConfig(grad_accum=2, checkpoint_every=2, max_steps=2)
    first.run()
    head = parts["led"].head_seq(RUN)
    other = torch.nn.Sequential(torch.nn.Linear(2, 1, dtype=torch.float64))  # keys "0.weight"
    second = _seeded_trainer(parts, "second", other, model=other)
    with pytest.raises(training.IncompatibleCheckpointError, match="no key in common"):
        second.resume()
    bigger = torch.nn.Linear(2, 1, dtype=torch.float64)
    bigger.register_buffer("scale", torch.ones(1))
    third = _seeded_trainer(parts, "third", bigger, model=bigger)
    with pytest.raises(training.IncompatibleCheckpointError, match=r"missing keys \['scale'\]"):
        third.resume()
    assert parts["led"].head_seq(RUN) == head
    same = _model()
    fourth = _seeded_trainer(parts, "fourth", same, model=same)
    fourth.resume()
    assert fourth.step == 2


def test_each_ranks_random_generators_come_back_on_a_resume(tmp_path: Path) -> None:
    parts = _seeded_parts(tmp_path, "run")
    first = _seeded_trainer(parts, "first", _model())
    first.config = TrainerConfig(grad_accum=2, checkpoint_every=2, max_steps=2)
    torch.manual_seed(5)
    first.run()  # saves at step 2 with the generators as they were then
    expected = torch.rand(3)  # the draw right after the save
    torch.manual_seed(99)
    _seeded_trainer(parts, "second", _model()).resume()
    assert torch.equal(torch.rand(3), expected)


# -- resizing: what one process shows (tests/test_training_resize.py has the real ranks) ---------
def _two_rank_trainer(
    parts: dict[str, Any], name: str, *, allow_resize: bool, **kw: Any
) -> Trainer:
    """Rank 0 of two: the rank that appends the resume event (it needs no peer for that)."""
    trainer = _seeded_trainer(parts, name, _model(), world_size=2, **kw)
    trainer.config = TrainerConfig(grad_accum=2, checkpoint_every=2, allow_resize=allow_resize)
    return trainer


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({}, r"world_size was 1, now 2\. .*pass TrainerConfig\(allow_resize=True\)"),
        ({"allow_resize": True, "grad_accum": 1}, "grad_accum was 2, now 1"),
        ({"allow_resize": True, "order_seed": 4}, "order_seed was 3, now 4"),
        ({"allow_resize": True, "extra_samples": 1}, "dataset_size was 24, now 25"),
    ],
)
def test_a_resize_still_refuses_any_other_change_of_the_set_up(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    """Saved without per-rank state, so the set-up check is what refuses the world size."""
    parts = _seeded_parts(tmp_path, "run")
    without_rank_state = CheckpointConfig(
        root=parts["ckpt"], components=("model", "optimizer", "trainer")
    )
    _first_two_steps(parts, checkpoints=CheckpointManager(without_rank_state))
    if change.get("extra_samples"):
        _commit_one_more(parts)
    second = _two_rank_trainer(
        parts,
        "second",
        allow_resize=change.get("allow_resize", False),
        checkpoints=CheckpointManager(without_rank_state),
    )
    if "grad_accum" in change:
        second.config = dataclasses.replace(second.config, grad_accum=change["grad_accum"])
    if "order_seed" in change:
        second.consumer.order_seed = change["order_seed"]
    head = parts["led"].head_seq(RUN)
    with pytest.raises(training.IncompatibleCheckpointError, match=match) as refused:
        second.resume()
    assert "world_size" not in str(refused.value) or not change
    assert parts["led"].head_seq(RUN) == head  # nobody fenced off, nothing written


def test_a_resize_hands_rank_0_its_old_state_and_restarts_its_position(tmp_path: Path) -> None:
    parts = _seeded_parts(tmp_path, "run")
    torch.manual_seed(5)
    first = _first_two_steps(parts)  # one rank, position 8, generators saved at step 2
    expected = torch.rand(3)
    assert first.position == 8
    loaded: list[Any] = []

    refused = _two_rank_trainer(parts, "refused", allow_resize=False)
    head = parts["led"].head_seq(RUN)
    with pytest.raises(training.IncompatibleCheckpointError, match="holds the state of 1 ranks"):
        refused.resume()
    assert parts["led"].head_seq(RUN) == head

    second = _two_rank_trainer(
        parts, "second", allow_resize=True, rank_state_fn=dict, load_rank_fn=loaded.append
    )
    torch.manual_seed(99)
    second.resume()
    assert torch.equal(torch.rand(3), expected)  # old rank 0's generators
    assert second.step == 2 and second.position == 0  # a new split starts here
    [state] = loaded
    assert state["data"] == {"position": 8, "batch_size": 2}  # old rank 0's, as it was
    saved = second.checkpoints.resumed_from
    assert saved is not None and (saved.step, saved.world_size) == (2, 1)
    run = replay(parts["led"], RUN)
    assert run.plans[run.epoch].world_size == 2
    assert run.verify() == []


def test_an_arrival_order_run_whose_last_batch_was_short_resumes(parts) -> None:
    """8 samples in batches of 3: the checkpoint after the short last batch saves
    position 8, which a seeded run could not line up with batches of 3 but an
    arrival-order one resumes from (the ledger alone says what is left)."""
    first = _trainer(
        parts,
        loader_config=LoaderConfig(batch_size=3),
        config=TrainerConfig(checkpoint_every=1),
    )
    first.run()
    assert first.position == 8
    assert first.checkpoints.load_rank_state(rank=0)["data"]["position"] == 8
    root = parts["checkpoints"].config.root
    parts["consumer"] = Consumer(parts["led"], parts["store"], run_id=RUN, consumer_id="again")
    parts["checkpoints"] = CheckpointManager(CheckpointConfig(root=root))  # a restart
    second = _trainer(parts, loader_config=LoaderConfig(batch_size=3))
    second.resume()
    assert second.position == 8 and second.step == 3
    acks = sum(len(e.sample_ids) for e in parts["led"].events(RUN) if e.kind == "ack")
    assert second.run() == 3  # everything was trained and checkpointed: no step left
    assert sum(len(e.sample_ids) for e in parts["led"].events(RUN) if e.kind == "ack") == acks == 8
    assert replay(parts["led"], RUN).verify() == []
