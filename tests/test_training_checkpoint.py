"""CheckpointManager on a real SQLite ledger: atomic, durable-before-recorded, weights_only."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataflow import Consumer, Ledger, Producer, StaleEpochError, replay
from stores import LocalFeatureStore
from training import (
    CheckpointConfig,
    CheckpointManager,
    CorruptCheckpointError,
    SavedCheckpoint,
)
from training._layout import manifest_bytes

RUN = "run"
ACC = "eval/simulated_acc_len"


class Opaque:
    """Not a tensor, container or scalar: loading it would run arbitrary unpickling."""


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:  # conftest has the store fixture
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


def _consumer(led: Ledger, store: LocalFeatureStore, name: str = "trainer") -> Consumer:
    return Consumer(led, store, run_id=RUN, consumer_id=name)


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "extra": torch.arange(5),
        "epoch": 3,
        "lr": 0.5,
        "name": "run-a",
    }


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def _manager(tmp_path: Path, **config: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", **{"run_id": RUN, **config}))


def _step_dirs(tmp_path: Path) -> list[str]:
    """The entries of the run's checkpoint directory (temporary ones included)."""
    root = tmp_path / "ckpt" / RUN
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# -- saving and loading ------------------------------------------------------------------------
def test_save_then_load_round_trips_state_dicts_tensors_and_scalars(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    state = _state()
    path = manager.save(7, state, metrics={ACC: 1.5, "eval/avg_loss": torch.tensor(0.25)})
    assert path == tmp_path / "ckpt" / RUN / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7
    assert manifest["files"]["state.pt"]["size"] == (path / "state.pt").stat().st_size
    assert manifest["metrics"] == {ACC: 1.5, "eval/avg_loss": 0.25}
    assert manifest["time"] > 0
    for which in (7, path, str(path), None, manager.latest()):
        _assert_equal(manager.load(which), state)
    assert _step_dirs(tmp_path) == ["step-00000007"]  # no temp directory left


def test_ledger_records_the_checkpoint_after_the_files(tmp_path: Path, led, store) -> None:
    consumer = _consumer(led, store)
    manager = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt"), consumer=consumer)
    assert manager.run_id == RUN  # taken from the consumer
    consumer.resume()
    path = manager.save(2, _state())
    [recorded] = replay(led, RUN).checkpoints
    assert (recorded.step, recorded.path) == (2, str(path))
    assert path.name == "step-00000002-epoch-1"
    assert recorded.digest == hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert Path(recorded.path).is_absolute()
    _assert_equal(manager.load(Path(recorded.path)), _state())


class _CrashingManager(CheckpointManager):
    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        super()._write(file, obj)  # the files are there ...
        raise OSError("disk failed")  # ... and then the save dies


def test_a_crash_inside_the_write_leaves_no_checkpoint_and_no_ledger_entry(
    tmp_path: Path, led, store
) -> None:
    consumer = _consumer(led, store)
    consumer.resume()
    manager = _CrashingManager(CheckpointConfig(root=tmp_path / "ckpt"), consumer=consumer)
    with pytest.raises(OSError, match="disk failed"):
        manager.save(1, _state())
    assert _step_dirs(tmp_path) == []
    assert manager.latest() is None
    assert replay(led, RUN).checkpoints == []


def test_a_state_weights_only_loading_would_refuse_is_refused_at_save(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    with pytest.raises(ValueError, match="weights_only"):
        manager.save(1, {"counter": Opaque()})
    assert _step_dirs(tmp_path) == []


def _self_containing() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["again"] = loop
    return {"loop": loop}


def _deeply_nested() -> dict[str, Any]:
    inner: dict[str, Any] = {}
    for _ in range(5000):  # deeper than the recursion limit
        inner = {"x": inner}
    return {"deep": inner}


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"schedule": lambda step: 0.1}, r"state\['schedule'\] is function .*code, not data"),
        ({"fn": {"hook": print}}, r"state\['fn'\]\['hook'\] is builtin_function_or_method"),
        (
            {"model": {"w": torch.empty(3, device="meta")}},
            r"state\['model'\]\['w'\] is a meta tensor: it has no data",
        ),
        ({"where": slice(0, 2)}, r"state\['where'\] is of type slice"),
        ({"ids": frozenset({1})}, r"state\['ids'\] is of type frozenset"),
        ({"counts": collections.defaultdict(int)}, "is of type collections.defaultdict"),
        ({"nested": [1, {"deep": Opaque()}]}, r"state\['nested'\]\[1\]\['deep'\] is of type"),
        ({"keys": {(1, 2): 3}}, r"state\['keys'\] has a key of type tuple"),
        (_self_containing(), r"state\['loop'\]\['again'\] contains itself"),
        (_deeply_nested(), r"state is nested deeper than Python can walk"),
    ],
)
def test_state_a_weights_only_load_cannot_read_back_is_refused_before_writing(
    tmp_path: Path, led, store, state: dict[str, Any], match: str
) -> None:
    consumer = _consumer(led, store)
    consumer.resume()
    manager = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt"), consumer=consumer)
    with pytest.raises(ValueError, match=match):
        manager.save(1, state)
    with pytest.raises(ValueError, match=match.replace("state", "rank_state", 1)):
        manager.save(1, {}, rank_state=state)
    assert not (tmp_path / "ckpt").exists()  # nothing written, not even a directory
    assert replay(led, RUN).checkpoints == []


def test_load_uses_weights_only(tmp_path: Path) -> None:
    """A checkpoint holding an arbitrary pickled object is never unpickled."""
    manager = _manager(tmp_path)
    path = manager.save(1, {"w": torch.ones(2)})
    torch.save({"w": Opaque()}, path / "state.pt")  # tampered with ...
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt is corrupt"):
        manager.load(1)
    manifest = json.loads((path / "manifest.json").read_text())  # ... and the manifest too
    data = (path / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_bytes(manifest_bytes(manifest))  # with its own sha256
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        manager.load(1)


class _PlainPickleFormat(CheckpointManager):
    """A subclass with its own file format: only the hooks change."""

    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        torch.save({k: v.tolist() for k, v in obj.items()}, file)

    def _read(self, file: Path) -> Any:
        loaded = torch.load(file, weights_only=True)
        return {k: torch.tensor(v) for k, v in loaded.items()}


class _SavedAgainBeforeTheRead(CheckpointManager):
    """Another writer saves the step again between the digest check and the read (each
    time, or ``times`` times)."""

    other: CheckpointManager
    state: dict[str, Any]
    moment = "before"  # or "during": saved again after the read opened the file
    times = 1_000

    def _read(self, file: Path) -> Any:
        if self.times <= 0:
            return super()._read(file)
        self.times -= 1
        if self.moment == "before":
            self.other.save(1, self.state)
            return super()._read(file)
        with open(file, "rb") as f:  # the checked file, open: it is what is read
            self.other.save(1, self.state)
            return torch.load(f, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("moment", ["before", "during"])
def test_a_file_replaced_between_its_check_and_its_read_is_checked_again(
    tmp_path: Path, moment: str
) -> None:
    # Without a ledger a step saved again replaces its directory: a load that checked the
    # old files must not hand out the new ones unchecked, nor fail with a bare OSError. It
    # finds and checks the step again; while every try is overtaken, it gives up.
    first, again = _state(1), _state(2)
    _manager(tmp_path).save(1, first)
    racing = _SavedAgainBeforeTheRead(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))
    racing.other, racing.state, racing.moment = _manager(tmp_path), again, moment
    with pytest.raises(CorruptCheckpointError, match="load again"):
        racing.load(1)  # saved again before every read
    racing.times = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_equal(racing.load(1), again)  # saved again once: the second try loads it
    listed = racing.latest()
    racing.times = 1
    with pytest.raises(CorruptCheckpointError, match="replaced after its digest was checked"):
        racing.load(listed)  # names one save: it is gone, no other is taken in its place


@pytest.mark.parametrize("which", [2, "latest"])
def test_a_file_replaced_while_its_digest_is_checked_is_checked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: object
) -> None:
    from training import _layout

    _manager(tmp_path).save(1, _state(1))
    _manager(tmp_path).save(2, _state(2))
    hash_file = hashlib.file_digest

    def saved_again_meanwhile(f: Any, name: str) -> Any:
        monkeypatch.setattr(_layout.hashlib, "file_digest", hash_file)
        _manager(tmp_path).save(2, _state(3))  # the old file is hashed, the path names a new one
        return hash_file(f, name)

    monkeypatch.setattr(_layout.hashlib, "file_digest", saved_again_meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "skipping checkpoint": nothing is corrupt
        _assert_equal(_manager(tmp_path).load(which), _state(3))  # not step 1: the new step 2


def test_a_subclass_changes_the_format_through_the_hooks(tmp_path: Path) -> None:
    manager = _PlainPickleFormat(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))
    path = manager.save(3, {"w": torch.tensor([1.0, 2.0])}, metrics={ACC: 1.0})
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    assert torch.load(path / "state.pt", weights_only=True) == {"w": [1.0, 2.0]}
    assert torch.equal(manager.load(3)["w"], torch.tensor([1.0, 2.0]))
    assert manager.best().step == 3


# -- latest, best, retention -------------------------------------------------------------------
def test_latest_is_the_newest_save(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    assert manager.latest() is None and manager.best() is None and manager.saved() == []
    for step in (1, 5, 3):  # 3 after 5: a resume from an older checkpoint
        manager.save(step, {"step": step})
    # Going back is a rewind: the later step 5 is removed (issue 40, "rewind cleanup").
    assert [c.step for c in manager.saved()] == [1, 3]
    assert manager.latest().step == 3
    assert manager.load() == {"step": 3}


def test_a_checkpoint_copied_in_from_another_run_or_step_is_skipped(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    other = _manager(tmp_path, run_id="other")
    manager.save(2, {"w": torch.zeros(3)}, metrics={ACC: 1.0})
    for step in (2, 4, 6):
        other.save(step, {"w": torch.full((3,), 99.0)}, metrics={ACC: 9.0})
    run_dir = manager.run_dir
    # An operator's mistakes: another run's newest checkpoint under a name this run would
    # use, this run's own checkpoint renamed to another step, and to an epoch it never had.
    shutil.copytree(other.latest().path, run_dir / "step-00000004")
    shutil.copytree(run_dir / "step-00000002", run_dir / "step-00000009")
    shutil.copytree(run_dir / "step-00000002", run_dir / "step-00000002-epoch-5")
    with pytest.warns(UserWarning) as caught:
        assert [c.path.name for c in manager.saved()] == ["step-00000002"]
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 3
    assert "step-00000002-epoch-5: its manifest is of epoch None" in messages[0]
    assert "step-00000004: its manifest belongs to run 'other', not 'run'" in messages[1]
    assert "step-00000009: its manifest is of step 2" in messages[2]
    with pytest.warns(UserWarning) as caught:
        assert torch.equal(manager.load("latest")["w"], torch.zeros(3))
    assert any("belongs to run 'other'" in str(w.message) for w in caught)
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match=r"saved: \[2\]"):
        manager.load(4)
    with pytest.warns(UserWarning):
        assert manager.latest().step == 2 and manager.best().step == 2


def test_best_ignores_missing_and_empty_metrics(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    manager.save(1, {}, metrics={})  # an eval that saw no batch
    manager.save(2, {}, metrics=None)
    manager.save(3, {}, metrics={"eval/avg_loss": 0.1})  # no simulated_acc_len
    assert manager.best() is None
    manager.save(4, {}, metrics={ACC: 0.5})
    manager.save(5, {}, metrics={ACC: float("nan")})
    manager.save(6, {}, metrics={ACC: 0.25})
    best = manager.best()
    assert isinstance(best, SavedCheckpoint)
    assert (best.step, best.metrics) == (4, {ACC: 0.5})


def test_best_mode_min_and_ties_go_to_the_latest(tmp_path: Path) -> None:
    manager = _manager(tmp_path, best_metric="eval/avg_loss", best_mode="min")
    for step, loss in [(1, 2.0), (2, 0.5), (3, 0.9), (4, 0.5)]:
        manager.save(step, {}, metrics={"eval/avg_loss": loss, ACC: 1.0 / step})
    assert manager.best().step == 4


def test_retention_keeps_the_latest_k_and_the_best(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_latest_k=2)
    for step, acc in [(1, 0.1), (2, 0.9), (3, 0.2), (4, 0.3), (5, 0.4)]:
        manager.save(step, {"step": step}, metrics={ACC: acc})
    assert [c.step for c in manager.saved()] == [2, 4, 5]
    assert _step_dirs(tmp_path) == ["step-00000002", "step-00000004", "step-00000005"]
    assert os.readlink(tmp_path / "ckpt" / f"{RUN}-best") == f"{RUN}/step-00000002"
    assert os.readlink(tmp_path / "ckpt" / f"{RUN}-latest") == f"{RUN}/step-00000005"
    assert manager.best().step == 2


def test_retention_without_keep_best(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_latest_k=1, keep_best=False)
    for step, acc in [(1, 0.9), (2, 0.1), (3, 0.2)]:
        manager.save(step, {}, metrics={ACC: acc})
    assert [c.step for c in manager.saved()] == [3]


def test_keep_latest_k_zero_keeps_everything(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    for step in range(1, 6):
        manager.save(step, {})
    assert [c.step for c in manager.saved()] == [1, 2, 3, 4, 5]


# -- resume ------------------------------------------------------------------------------------
def test_resume_from_scratch_latest_and_an_older_checkpoint(tmp_path: Path, led, store) -> None:
    Producer(led, store, run_id=RUN).emit("a", {"x": torch.ones(1)})
    manager = _manager(tmp_path)
    plan, state = manager.resume(_consumer(led, store, "first"))
    assert plan.checkpoint is None and state is None
    assert manager.consumer.consumer_id == "first"
    manager.save(1, {"step": 1})
    manager.save(2, {"step": 2})

    manager = _manager(tmp_path)
    plan, state = manager.resume(_consumer(led, store, "second"))
    assert (plan.checkpoint.step, state) == (2, {"step": 2})
    plan, state = manager.resume(_consumer(led, store, "third"), 1)
    assert (plan.checkpoint.step, state) == (1, {"step": 1})

    # Back at 1, step 2 is saved again into a directory of its own lineage; the
    # abandoned step-2 directory is removed (a rewind), and the ledger says so.
    manager.save(2, {"step": "2 again"})
    assert manager.load(2) == {"step": "2 again"}
    assert manager.latest().step == 2
    run = replay(led, RUN)
    assert [(c.step, c.epoch) for c in run.checkpoints] == [(1, 1), (2, 1), (2, 3)]
    assert run.removed_checkpoints == {run.checkpoints[1].seq: "rewind"}
    assert _step_dirs(tmp_path) == ["step-00000001-epoch-1", "step-00000002-epoch-3"]


def test_resume_from_a_checkpoint_whose_files_are_gone(tmp_path: Path, led, store) -> None:
    manager = _manager(tmp_path)
    manager.resume(_consumer(led, store, "first"))
    path = manager.save(1, {"w": torch.ones(1)})
    (path / "state.pt").unlink()
    (path / "manifest.json").unlink()
    path.rmdir()
    with pytest.raises(FileNotFoundError, match="step-00000001"):
        manager.resume(_consumer(led, store, "second"), 1)
    assert replay(led, RUN).epoch == 1  # nobody was fenced off by the failed resume


def test_resume_sweeps_what_a_killed_save_left(tmp_path: Path, led, store) -> None:
    root = tmp_path / "ckpt" / RUN
    (root / ".tmp-step-00000004-dead").mkdir(parents=True)
    (root / ".tmp-step-00000004-dead" / "state.pt").write_bytes(b"half")
    manager = _manager(tmp_path)
    manager.resume(_consumer(led, store))
    assert _step_dirs(tmp_path) == []


def test_a_fenced_off_trainer_saves_nothing(tmp_path: Path, led, store) -> None:
    zombie = _manager(tmp_path)
    zombie.resume(_consumer(led, store, "zombie"))
    _manager(tmp_path).resume(_consumer(led, store, "live"))
    with pytest.raises(StaleEpochError, match="nothing was saved"):
        zombie.save(1, {"w": torch.ones(1)})
    assert _step_dirs(tmp_path) == []


# -- bad inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None, 2**63])
def test_save_rejects_a_bad_step(tmp_path: Path, step: object) -> None:
    with pytest.raises(ValueError, match=f"step must .*{step!r}"):
        _manager(tmp_path).save(step, {})
    assert _step_dirs(tmp_path) == []


def test_a_step_past_64_bits_is_refused_before_anything_is_written(
    tmp_path: Path, led, store
) -> None:
    manager = _manager(tmp_path)
    manager.resume(_consumer(led, store))
    with pytest.raises(ValueError, match=r"step must fit in 64 bits \(<= 2\*\*63 - 1\)"):
        manager.save(2**63, {})
    assert not (tmp_path / "ckpt" / RUN).exists() or _step_dirs(tmp_path) == []
    assert replay(led, RUN).checkpoints == []


def test_is_best_rejects_a_metric_too_large_for_a_float(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is too large for a float"):
        _manager(tmp_path).is_best({ACC: 10**400})


@pytest.mark.parametrize(
    ("state", "metrics", "match"),
    [
        ([1, 2], None, "state must be a dict"),
        ({}, [1.0], "metrics must be a dict"),
        ({}, {ACC: "high"}, "metric 'eval/simulated_acc_len' must be a number, got 'high'"),
        ({}, {1: 1.0}, "metric names must be strs, got 1"),
        ({}, {ACC: True}, "must be a number, got True"),
        ({}, {ACC: 10**400}, "metric 'eval/simulated_acc_len' is too large for a float"),
    ],
)
def test_save_rejects_bad_state_or_metrics(
    tmp_path: Path, state: object, metrics: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _manager(tmp_path).save(1, state, metrics=metrics)
    assert _step_dirs(tmp_path) == []


def test_save_refuses_a_step_not_after_the_lineages_checkpoint(tmp_path: Path, led, store) -> None:
    manager = _manager(tmp_path)
    manager.resume(_consumer(led, store))
    manager.save(4, {})
    for step in (4, 3):
        with pytest.raises(ValueError, match=f"step {step}: .* already has one at step 4"):
            manager.save(step, {})
    assert _step_dirs(tmp_path) == ["step-00000004-epoch-1"]


def test_save_with_a_consumer_that_has_not_resumed(tmp_path: Path, led, store) -> None:
    manager = CheckpointManager(
        CheckpointConfig(root=tmp_path / "ckpt"), consumer=_consumer(led, store)
    )
    with pytest.raises(ValueError, match="has not resumed"):
        manager.save(1, {})
    assert _step_dirs(tmp_path) == []


def test_load_names_what_is_missing(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint of run 'run' under"):
        manager.load()
    manager.save(1, {})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 99 .* saved: \[1\]"):
        manager.load(99)
    missing = tmp_path / "elsewhere"
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        manager.load(missing)
    with pytest.raises(ValueError, match="step must be >= 0, got -2"):
        manager.load(-2)
    with pytest.raises(ValueError, match=r"step must be an int, got float 1\.0"):
        manager.load(1.0)


def test_a_saved_checkpoint_whose_step_was_saved_again_is_refused(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    manager.save(1, {"w": torch.zeros(2)})
    listed = manager.latest()
    assert listed is not None
    assert torch.equal(manager.load(listed)["w"], torch.zeros(2))
    manager.save(1, {"w": torch.ones(2)})  # the same step saved again: other files
    with pytest.raises(CorruptCheckpointError, match="changed since this SavedCheckpoint"):
        manager.load(listed)
    with pytest.raises(CorruptCheckpointError, match="list the checkpoints again"):
        manager.load_rank_state(listed, rank=0)
    assert torch.equal(manager.load(manager.latest())["w"], torch.ones(2))


def test_resume_rejects_bad_arguments(tmp_path: Path, led, store) -> None:
    manager = _manager(tmp_path)
    with pytest.raises(ValueError, match=r"consumer must be a dataflow\.Consumer"):
        manager.resume("trainer")
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        manager.resume(_consumer(led, store), -1)
    with pytest.raises(ValueError, match="step must be an int, got str 'newest'"):
        manager.resume(_consumer(led, store), "newest")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"root": ""}, "root must be a non-empty path"),
        ({"keep_latest_k": -1}, "keep_latest_k must be >= 0, got -1"),
        ({"keep_latest_k": 1.0}, "keep_latest_k must be an int"),
        ({"best_mode": "avg"}, "best_mode must be one of"),
        ({"best_metric": ""}, "best_metric must be a non-empty str"),
        ({"keep_best": 1}, "keep_best must be a bool"),
        ({"root": "ckpt\x00x"}, r"root 'ckpt\\x00x' holds the control character '\\x00'"),
        ({"components": 5}, "components must be a collection of names, got int 5"),
    ],
)
def test_config_rejects_bad_values(tmp_path: Path, config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(**{"root": tmp_path, **config})


def test_a_root_with_dot_dot_saves_checkpoints_the_ledger_records(
    tmp_path: Path, led, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    manager = CheckpointManager(CheckpointConfig(root="../ckpt", run_id=RUN))
    manager.resume(_consumer(led, store))
    saved = manager.save(1, {})
    assert saved == tmp_path / "ckpt" / RUN / "step-00000001-epoch-1"
    assert [c.path for c in replay(led, RUN).checkpoints] == [str(saved)]


def test_config_is_keyword_only_and_frozen(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        CheckpointConfig(tmp_path)  # type: ignore[misc]
    config = CheckpointConfig(root=str(tmp_path / "x" / ".." / "ckpt"))
    assert config.root == tmp_path / "ckpt"  # '..' folded away: the ledger refuses it
    with pytest.raises(AttributeError):
        config.keep_latest_k = 3  # type: ignore[misc]
