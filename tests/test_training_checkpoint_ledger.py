"""CheckpointManager against the ledger's record: digests, lineage-unique directories, removals,
pointers, the best record, components, absent entries, RNG state and asynchronous saves.

One process, a real SQLite ledger; the multi-rank and SIGKILL behaviours have their own files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import training
from dataflow import Consumer, InvalidArgumentError, Kind, Ledger, UnknownCheckpointError, replay
from stores import LocalFeatureStore
from training import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from training._layout import manifest_bytes

RUN = "run"
ACC = "eval/simulated_acc_len"


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


def _consumer(led: Ledger, name: str, run: str = RUN) -> Consumer:
    return Consumer(led, LocalFeatureStore(), run_id=run, consumer_id=name)


def _manager(root: Path, **config: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(root=root, **config))


def _resumed(root: Path, led: Ledger, name: str, which: object = "latest", **config: Any):
    manager = _manager(root, **config)
    plan, state = manager.resume(_consumer(led, name), which)
    return manager, plan, state


def _w(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), value)}}


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _events(led: Ledger, kind: str) -> list[Any]:
    return [e for e in led.events(RUN) if e.kind == kind]


# -- lineage-unique directories ------------------------------------------------------------------
def test_resuming_the_abandoned_lineage_loads_its_own_bytes(tmp_path: Path, led) -> None:
    """The issue's bug: two lineages' step 6 in one directory. Each now has its own."""
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    manager.save(4, _w(4.0))
    old_six = manager.save(6, _w(6.0))
    manager, plan, state = _resumed(root, led, "b", 4)
    assert plan.checkpoint.step == 4 and torch.equal(state["model"]["w"], torch.full((4,), 4.0))
    new_six = manager.save(6, _w(60.0))
    assert old_six != new_six and old_six.name == "step-00000006-epoch-1"
    assert new_six.name == "step-00000006-epoch-2"
    # The rewind removed the abandoned step 6, and the ledger says so ...
    run = replay(led, RUN)
    [abandoned] = [c for c in run.checkpoints if c.path == str(old_six)]
    assert run.removed_checkpoints == {abandoned.seq: "rewind"}
    assert not old_six.exists()
    # ... so a resume from it fails before anything is written, instead of loading lineage 2's.
    head = led.head_seq(RUN)
    with pytest.raises(UnknownCheckpointError, match="removed"):
        _manager(root).resume(_consumer(led, "c"), abandoned)
    assert led.head_seq(RUN) == head
    manager, plan, state = _resumed(root, led, "d", 6)
    assert plan.checkpoint.path == str(new_six)
    assert torch.equal(state["model"]["w"], torch.full((4,), 60.0))
    assert replay(led, RUN).verify() == []


def test_an_abandoned_lineage_below_the_rewind_stays_resumable(tmp_path: Path, led) -> None:
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    for step in (2, 4, 6):
        manager.save(step, _w(step))
    manager, _, _ = _resumed(root, led, "b", 2)
    manager.save(5, _w(50.0))  # rewinds 6 (>= 5), keeps the abandoned 4
    assert [(c.step, c.epoch) for c in manager.saved()] == [(2, 1), (4, 1), (5, 2)]
    manager, plan, state = _resumed(root, led, "c", 4)
    assert plan.checkpoint.epoch == 1 and torch.equal(state["model"]["w"], torch.full((4,), 4.0))
    [removed] = _events(led, Kind.CHECKPOINT_REMOVED)
    assert (removed.step, removed.payload["reason"]) == (6, "rewind")


# -- digests -------------------------------------------------------------------------------------
def test_a_flipped_byte_is_caught_on_load(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ckpt", run_id=RUN)
    path = manager.save(1, _w(1.0))
    _flip_a_byte(path / "state.pt")
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt is corrupt"):
        manager.load(1)
    with (
        pytest.warns(UserWarning, match="skipping checkpoint"),
        pytest.raises(CorruptCheckpointError, match="no intact checkpoint"),
    ):
        manager.load()


def test_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path, led) -> None:
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    manager.save(1, _w(1.0))
    manager.save(2, _w(2.0))
    latest = manager.save(3, _w(3.0))
    _flip_a_byte(latest / "state.pt")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-00000003"):
        assert torch.equal(manager.load()["model"]["w"], torch.full((4,), 2.0))
    # A resume falls back the same way, and checks before the resume event.
    with pytest.warns(UserWarning, match="not resuming from the checkpoint at step 3"):
        _, plan, state = _resumed(root, led, "b")
    assert plan.checkpoint.step == 2 and torch.equal(state["model"]["w"], torch.full((4,), 2.0))
    # A named step never falls back.
    head = led.head_seq(RUN)
    run = replay(led, RUN)
    [three] = [c for c in run.checkpoints if c.step == 3]
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt is corrupt"):
        _manager(root).resume(_consumer(led, "c"), three)
    assert led.head_seq(RUN) == head


def test_a_directory_that_differs_from_the_ledgers_record_is_refused(tmp_path: Path, led) -> None:
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    path = manager.save(1, _w(1.0))
    # Someone rewrites the checkpoint consistently (files and manifest): only the ledger knows.
    other = _manager(tmp_path / "elsewhere", run_id=RUN).save(1, _w(99.0))
    shutil.rmtree(path)
    shutil.copytree(other, path)
    head = led.head_seq(RUN)
    with pytest.raises(CorruptCheckpointError, match="does not match the ledger's record"):
        _manager(root).resume(_consumer(led, "b"), 1)
    assert led.head_seq(RUN) == head  # nobody was fenced off
    with pytest.raises(CorruptCheckpointError, match="does not match the ledger's record"):
        manager.load(replay(led, RUN).checkpoints[0])


def test_a_missing_file_names_it(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ckpt", run_id=RUN)
    path = manager.save(1, _w(1.0), rank_state={"rng": training.rng_state()})
    (path / "rank-00000.pt").unlink()
    assert torch.equal(manager.load(1)["model"]["w"], torch.full((4,), 1.0))
    with pytest.raises(CorruptCheckpointError, match=r"missing rank-00000\.pt"):
        manager.load_rank_state(1, rank=0)
    with pytest.raises(CheckpointError, match="holds the state of 1 ranks, not of rank 3"):
        manager.load_rank_state(1, rank=3)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is unreadable"):
        manager.load(path)


# -- a moved root, runs sharing a root ---------------------------------------------------------
def test_a_moved_root_still_resumes_checked_against_the_ledger(tmp_path: Path, led) -> None:
    manager, _, _ = _resumed(tmp_path / "ckpt", led, "a")
    manager.save(1, _w(1.0), metrics={ACC: 1.0})
    manager.save(2, _w(2.0))
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    manager, plan, state = _resumed(tmp_path / "moved", led, "b")
    assert plan.checkpoint.step == 2 and torch.equal(state["model"]["w"], torch.full((4,), 2.0))
    # The pointers are relative, so they survived the move.
    assert (tmp_path / "moved" / f"{RUN}-latest" / "manifest.json").is_file()
    assert (
        json.loads((tmp_path / "moved" / f"{RUN}-best" / "manifest.json").read_text())["step"] == 1
    )
    with (
        pytest.warns(UserWarning, match="not resuming from the checkpoint at step [12]"),
        pytest.raises(CheckpointNotFoundError, match="which is gone"),
    ):
        _resumed(tmp_path / "nowhere", led, "c")


def test_runs_sharing_a_root_never_touch_each_other(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    a = _manager(root, run_id="a", keep_latest_k=1)
    b = _manager(root, run_id="a/../b")  # escaped: never a path of its own
    b.save(1, _w(1.0))
    for step in (1, 2, 3):
        a.save(step, _w(step))
    assert [c.step for c in a.saved()] == [3]
    assert [c.step for c in b.saved()] == [1]
    assert sorted(p.name for p in root.iterdir()) == [
        "a",
        "a%2F..%2Fb",
        "a%2F..%2Fb-latest",
        "a-latest",
    ]
    for run_id in ("x-latest", "x-best", ".hidden", "..", "x.best_meta.json"):
        manager = _manager(root, run_id=run_id)
        manager.save(1, {})
        assert manager.run_dir.parent == root
        assert not manager.run_dir.name.endswith(("-latest", "-best", ".best_meta.json"))
        assert not manager.run_dir.name.startswith(".")


@pytest.mark.parametrize("first", ["x", "x.best_meta.json"])
def test_a_run_id_never_names_another_runs_best_record(tmp_path: Path, first: str) -> None:
    # Run "x" keeps its best record in {root}/x.best_meta.json, beside the runs' directories.
    root = tmp_path / "ckpt"
    order = [first, "x.best_meta.json" if first == "x" else "x"]
    runs = {run_id: _manager(root, run_id=run_id) for run_id in order}
    for step, manager in enumerate(runs.values(), start=1):
        manager.save(step, _w(step), metrics={ACC: float(step)})
    assert (root / "x.best_meta.json").is_file()
    assert json.loads((root / "x.best_meta.json").read_text())["run_id"] == "x"
    for run_id, manager in runs.items():
        assert [c.path.parent for c in manager.saved()] == [manager.run_dir]
        assert manager.best() is not None and manager.best().metrics is not None
        assert (
            json.loads((root / f"{manager.run_dir.name}.best_meta.json").read_text())["run_id"]
            == run_id
        )


def test_run_id_must_match_the_consumers(tmp_path: Path, led) -> None:
    with pytest.raises(ValueError, match="run_id='other' but the consumer is in run 'run'"):
        CheckpointManager(
            CheckpointConfig(root=tmp_path, run_id="other"), consumer=_consumer(led, "a")
        )
    with pytest.raises(ValueError, match="run_id is None and no consumer is attached"):
        _manager(tmp_path).save(1, {})


# -- pointers and the best record ---------------------------------------------------------------
def test_pointers_are_relative_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = _manager(root, run_id=RUN)
    manager.save(1, {}, metrics={ACC: 2.0})
    manager.save(2, {}, metrics={ACC: 1.0})
    assert os.readlink(root / f"{RUN}-latest") == f"{RUN}/step-00000002"
    assert os.readlink(root / f"{RUN}-best") == f"{RUN}/step-00000001"
    meta = json.loads((root / f"{RUN}.best_meta.json").read_text())
    assert meta == {
        "run_id": RUN,
        "metric": ACC,
        "mode": "max",
        "score": 2.0,
        "step": 1,
        "path": f"{RUN}/step-00000001",
    }


def test_pointer_files_where_symlinks_are_unsupported(tmp_path: Path, monkeypatch) -> None:
    def no_symlinks(*args: object, **kwargs: object) -> None:
        raise OSError("symlinks are not supported here")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    root = tmp_path / "ckpt"
    manager = _manager(root, run_id=RUN)
    manager.save(1, {}, metrics={ACC: 2.0})
    assert not (root / f"{RUN}-latest").is_symlink()
    assert (root / f"{RUN}-latest").read_text() == f"{RUN}/step-00000001\n"
    assert (root / f"{RUN}-best").read_text() == f"{RUN}/step-00000001\n"


def test_the_best_record_is_reloaded_on_construction(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _manager(root, run_id=RUN).save(1, {}, metrics={ACC: 2.0})
    manager = _manager(root, run_id=RUN)
    assert not manager.is_best({ACC: 1.5})
    assert not manager.is_best({ACC: 2.0})  # a tie does not beat it
    assert manager.is_best({ACC: 2.5})
    assert not manager.is_best({}) and not manager.is_best(None)
    assert not manager.is_best({ACC: float("nan")})
    # The record decides, not a scan: a record claiming a higher score is believed.
    meta_file = root / f"{RUN}.best_meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "score": 10.0}))
    assert not _manager(root, run_id=RUN).is_best({ACC: 5.0})


def test_a_best_record_of_a_checkpoint_that_is_gone_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A crash after retention removed the best checkpoint, before the record was updated.
    root = tmp_path / "ckpt"
    manager = _manager(root, run_id=RUN)
    manager.save(1, {}, metrics={ACC: 5.0})
    manager.save(2, {}, metrics={ACC: 2.0})
    shutil.rmtree(root / RUN / "step-00000001")
    with caplog.at_level("WARNING", logger="training"):
        manager = _manager(root, run_id=RUN)
    assert any(
        "its checkpoint" in r.getMessage() and "is gone" in r.getMessage() for r in caplog.records
    )
    assert manager.is_best({ACC: 3.0})  # beats the step 2 that is left, not the gone 5.0
    assert not manager.is_best({ACC: 1.0})
    manager.save(3, {}, metrics={ACC: 3.0})
    assert json.loads((root / f"{RUN}.best_meta.json").read_text())["step"] == 3
    assert manager.best() is not None and manager.best().step == 3


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{broken", "ignoring the corrupt best record"),
        (
            json.dumps({"run_id": RUN, "metric": ACC, "mode": "max", "score": 9.0, "step": 1}),
            "ignoring the corrupt best record .*: path None",
        ),
        ('{"score": "high", "step": 1}', "ignoring the corrupt best record"),
        (
            json.dumps({"run_id": "other", "metric": ACC, "mode": "max", "score": 9.0, "step": 1}),
            "ignoring the best record .* for \\(run, metric, mode\\) \\('other'",
        ),
        (
            json.dumps({"run_id": RUN, "metric": "loss", "mode": "min", "score": 9.0, "step": 1}),
            "ignoring the best record",
        ),
    ],
)
def test_a_corrupt_or_foreign_best_record_is_ignored(
    tmp_path: Path, content: str, match: str
) -> None:
    root = tmp_path / "ckpt"
    _manager(root, run_id=RUN).save(1, {}, metrics={ACC: 2.0})
    (root / f"{RUN}.best_meta.json").write_text(content)
    with pytest.warns(UserWarning, match=match):
        manager = _manager(root, run_id=RUN)
    assert manager.is_best({ACC: 3.0}) and not manager.is_best({ACC: 1.0})  # from the manifests
    manager.save(2, {}, metrics={ACC: 3.0})
    assert json.loads((root / f"{RUN}.best_meta.json").read_text())["step"] == 2


# -- retention and rewind in the ledger ----------------------------------------------------------
def test_retention_records_every_removal_in_the_ledger(tmp_path: Path, led) -> None:
    manager, _, _ = _resumed(tmp_path / "ckpt", led, "a", keep_latest_k=2)
    for step, acc in [(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)]:
        manager.save(step, {}, metrics={ACC: acc})
    assert [c.step for c in manager.saved()] == [1, 3, 4]  # 1 is the best
    run = replay(led, RUN)
    removed = [c.step for c in run.checkpoints if c.seq in run.removed_checkpoints]
    assert removed == [2] and set(run.removed_checkpoints.values()) == {"retention"}
    assert run.checkpoint_for(2) is None
    with pytest.raises(
        UnknownCheckpointError, match=r"step 2 to resume from \(removed: retention\)"
    ):
        _manager(tmp_path / "ckpt").resume(_consumer(led, "b"), 2)
    assert replay(led, RUN).epoch == 1 and replay(led, RUN).verify() == []


def test_a_removed_best_is_replaced_by_the_next_best(tmp_path: Path, led) -> None:
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    manager.save(1, {}, metrics={ACC: 0.5})
    manager.save(2, {}, metrics={ACC: 0.9})
    manager, _, _ = _resumed(root, led, "b", 1)
    manager.save(2, {}, metrics={ACC: 0.1})  # rewinds the abandoned best
    assert os.readlink(root / f"{RUN}-best") == f"{RUN}/step-00000001-epoch-1"
    assert json.loads((root / f"{RUN}.best_meta.json").read_text())["score"] == 0.5


def test_the_best_step_saved_again_is_scored_by_its_new_metrics(tmp_path: Path) -> None:
    # Without a ledger, saving a step again replaces its directory, so a record of the
    # replaced files' score would name a checkpoint that no longer scores so.
    root = tmp_path / "ckpt"
    manager = _manager(root, run_id=RUN)
    manager.save(5, _w(5.0), metrics={ACC: 0.9})
    manager.save(5, _w(55.0), metrics={ACC: 0.1})
    manager.save(6, _w(6.0), metrics={ACC: 0.5})
    assert manager.best().step == 6
    assert json.loads((root / f"{RUN}.best_meta.json").read_text())["score"] == 0.5
    assert os.readlink(root / f"{RUN}-best") == f"{RUN}/step-00000006"
    for fresh in (manager, _manager(root, run_id=RUN)):
        assert fresh.is_best({ACC: 0.6}) and not fresh.is_best({ACC: 0.4})


def test_checkpoints_saved_without_a_ledger_are_not_rewound(tmp_path: Path, led) -> None:
    # The rewind removes what an abandoned lineage saved; a checkpoint saved without a
    # ledger belongs to no lineage, and the ledger could not record its removal.
    root = tmp_path / "ckpt"
    plain = _manager(root, run_id=RUN)
    for step in (10, 20):
        plain.save(step, _w(step), metrics={ACC: step / 100})
    manager, plan, _ = _resumed(root, led, "a")
    assert plan.checkpoint is None
    manager.save(1, _w(1.0))
    assert sorted(p.name for p in (root / RUN).iterdir()) == [
        "step-00000001-epoch-1", "step-00000010", "step-00000020",
    ]  # fmt: skip
    assert replay(led, RUN).removed_checkpoints == {}


def test_resume_sweeps_directories_the_ledger_never_recorded(tmp_path: Path, led) -> None:
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    kept = manager.save(1, {})
    unrecorded = root / RUN / "step-00000002-epoch-1"  # published, then killed before the record
    shutil.copytree(kept, unrecorded)
    (root / RUN / ".trash-dead").mkdir()
    manager, plan, _ = _resumed(root, led, "b")
    assert plan.checkpoint.step == 1
    assert sorted(p.name for p in (root / RUN).iterdir()) == [kept.name]


def test_a_sweep_that_cannot_remove_a_directory_warns_and_resumes(
    tmp_path: Path, led, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 0 sweeps after the other ranks returned from their resume: it must not fail alone.
    root = tmp_path / "ckpt"
    manager, _, _ = _resumed(root, led, "a")
    kept = manager.save(1, {})
    unrecorded = root / RUN / "step-00000002-epoch-1"
    shutil.copytree(kept, unrecorded)

    def refuse(self: CheckpointManager, path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(CheckpointManager, "_discard", refuse)
    with caplog.at_level("WARNING", logger="training"):
        manager, plan, _ = _resumed(root, led, "b")
    assert plan.checkpoint.step == 1 and replay(led, RUN).epoch == 2
    assert f"could not remove {unrecorded}" in caplog.text
    assert "the next resume tries again" in caplog.text
    monkeypatch.undo()
    _resumed(root, led, "c")
    assert sorted(p.name for p in (root / RUN).iterdir()) == [kept.name]


# -- components and absent entries ------------------------------------------------------------
def test_an_unknown_component_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown: \['modle'\]"):
        CheckpointConfig(root="/tmp/x", components=("modle", "optimizer"))
    with pytest.raises(ValueError, match="the str 'model'"):
        CheckpointConfig(root="/tmp/x", components="model")
    with pytest.raises(ValueError, match="distinct names"):
        CheckpointConfig(root="/tmp/x", components=("model", "model"))


def test_a_declared_component_missing_from_the_state_is_refused(tmp_path: Path) -> None:
    manager = _manager(tmp_path, run_id=RUN, components=("model", "optimizer"))
    with pytest.raises(ValueError, match=r"components \['optimizer'\] are declared"):
        manager.save(1, _w(1.0))
    with pytest.raises(ValueError, match=r"holds \['rng'\], which .* leaves out"):
        manager.save(1, {**_w(1.0), "optimizer": {}}, rank_state={"rng": training.rng_state()})
    assert manager.saved() == [] and not (tmp_path / RUN).exists()


def test_a_model_less_checkpoint_is_valid_only_with_its_marker(tmp_path: Path) -> None:
    manager = _manager(tmp_path, run_id=RUN, components=("optimizer", "data"))
    path = manager.save(1, {"optimizer": {"lr": 0.1}, "data": {"position": 8}})
    assert (path / "NO_MODEL").is_file()
    assert manager.load(1) == {"optimizer": {"lr": 0.1}, "data": {"position": 8}}
    (path / "NO_MODEL").unlink()
    with pytest.raises(CorruptCheckpointError, match="missing NO_MODEL"):
        manager.load(1)
    # A manifest that does not even list the marker: still not a valid checkpoint.
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["NO_MODEL"]
    (path / "manifest.json").write_bytes(manifest_bytes(manifest))  # with its own sha256
    with pytest.raises(CorruptCheckpointError, match="holds no model and no NO_MODEL marker"):
        manager.load(1)


def test_absent_entries_keep_the_structure_constant(tmp_path: Path) -> None:
    manager = _manager(tmp_path, run_id=RUN)
    first = manager.save(1, {**_w(1.0), "scheduler": None})
    second = manager.save(2, {**_w(2.0), "scheduler": {"last_epoch": 2}, "extra": 1})
    third = manager.save(3, _w(3.0))  # the scheduler and extra went missing: stored as absent
    assert manager.load(1)["scheduler"] is None
    assert manager.load(2)["scheduler"] == {"last_epoch": 2}
    loaded = manager.load(3)
    assert (loaded["scheduler"], loaded["extra"]) == (None, None)
    entries = [
        json.loads((p / "manifest.json").read_text())["entries"]["state"]
        for p in (first, second, third)
    ]
    grown = ["extra", "model", "scheduler"]
    assert entries == [["model", "scheduler"], grown, grown]
    # A fresh manager learns the entries from the latest manifest.
    fourth = _manager(tmp_path, run_id=RUN).save(4, _w(4.0))
    assert json.loads((fourth / "manifest.json").read_text())["entries"]["state"] == [
        "extra",
        "model",
        "scheduler",
    ]


# -- RNG -----------------------------------------------------------------------------------
def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    manager = _manager(tmp_path, run_id=RUN)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    manager.save(1, {}, rank_state={"rng": training.rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    training.set_rng_state(manager.load_rank_state(1, rank=0)["rng"])
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(2), expected[2])
    with pytest.raises(ValueError, match="not an rng_state"):
        training.set_rng_state({"torch": torch.get_rng_state()})


@pytest.mark.parametrize(
    "broken",
    [
        {"python": 5},
        {"torch": "x"},
        {"numpy": {}},
        {
            "numpy": {
                "kind": "MT19937",
                "keys": "no",
                "pos": 0,
                "has_gauss": 0,
                "cached_gaussian": 0,
            }
        },
    ],
    ids=["python", "torch", "numpy-empty", "numpy-keys"],
)
def test_a_state_that_cannot_be_applied_changes_no_generator(broken: dict) -> None:
    # It raised TypeError or KeyError, with Python's generator already replaced.
    np = pytest.importorskip("numpy")
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    state = {**training.rng_state(), **broken}
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = training.rng_state()
    with pytest.raises(InvalidArgumentError, match=r"not an rng_state.* left as it was"):
        training.set_rng_state(state)
    after = training.rng_state()
    assert after["python"] == expected["python"] and torch.equal(after["torch"], expected["torch"])
    assert torch.equal(after["numpy"]["keys"], expected["numpy"]["keys"])


# -- asynchronous saves ------------------------------------------------------------------------
def test_an_async_save_is_recorded_once_durable(tmp_path: Path, led) -> None:
    manager, _, _ = _resumed(tmp_path / "ckpt", led, "a", async_save=True)
    weights = torch.full((4,), 1.0)
    path = manager.save(1, {"model": {"w": weights}})
    weights.add_(1.0)  # staged: later changes are not in the checkpoint
    manager.wait()
    assert [c.path for c in replay(led, RUN).checkpoints] == [str(path)]
    assert torch.equal(manager.load(1)["model"]["w"], torch.full((4,), 1.0))
    manager.save(2, {"model": {"w": weights}})
    manager.save(3, {"model": {"w": weights}})  # records step 2 first
    assert [c.step for c in replay(led, RUN).checkpoints] == [1, 2]
    manager.close()
    assert [c.step for c in replay(led, RUN).checkpoints] == [1, 2, 3]
    manager.wait()  # nothing in flight: a no-op


class _FailingWrite(CheckpointManager):
    def _write(self, file: Path, obj: dict[str, Any]) -> None:
        raise OSError(f"disk full writing {file.name}")


def test_an_async_error_surfaces_at_the_next_call(tmp_path: Path, led) -> None:
    manager = _FailingWrite(CheckpointConfig(root=tmp_path / "ckpt", async_save=True))
    manager.resume(_consumer(led, "a"))
    manager.save(1, {})  # returns before the write fails
    with pytest.raises(CheckpointError, match="background save at step 1 failed: disk full"):
        manager.save(2, {})
    assert replay(led, RUN).checkpoints == []
    assert not list((tmp_path / "ckpt" / RUN).iterdir())  # the temporary directory is gone


def test_the_ledger_digest_is_the_manifests_sha256(tmp_path: Path, led) -> None:
    manager, _, _ = _resumed(tmp_path / "ckpt", led, "a")
    path = manager.save(1, {})
    [event] = _events(led, Kind.CHECKPOINT)
    expected = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert event.payload == {"path": str(path), "digest": expected}
