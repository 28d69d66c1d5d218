"""A rewind removes every later checkpoint directory of the run, intact or not, and says
which: with and without a ledger (issue 40, "rewind cleanup")."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, Kind, Ledger, replay
from stores import LocalFeatureStore
from training import CheckpointConfig, CheckpointManager

RUN = "run"


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


def _corrupt(path: Path) -> None:
    """Flip a byte in the middle of the checkpoint's manifest: no reader lists it any more."""
    manifest = path / "manifest.json"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 1
    manifest.write_bytes(bytes(data))


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / RUN).iterdir())


def test_without_a_ledger_saving_an_earlier_step_removes_every_later_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As a new user tries it: steps 2, 4 and 5 saved, step 5 corrupted on disk, the run
    # goes back to step 2 and saves step 3 with keep_latest_k=2.
    root = tmp_path / "ckpt"
    first = CheckpointManager(CheckpointConfig(root=root, run_id=RUN, keep_latest_k=3))
    paths = {step: first.save(step, {"w": torch.full((2,), float(step))}) for step in (2, 4, 5)}
    _corrupt(paths[5])
    manager = CheckpointManager(CheckpointConfig(root=root, run_id=RUN, keep_latest_k=2))
    assert manager.removed_by_last_save == {}
    assert torch.equal(manager.load(2)["w"], torch.full((2,), 2.0))
    with caplog.at_level(logging.INFO, logger="training"):
        manager.save(3, {"w": torch.zeros(2)})
    assert _dirs(root) == ["step-00000002", "step-00000003"]
    assert manager.removed_by_last_save == {paths[4]: "rewind", paths[5]: "rewind"}
    assert "the save of step 3 removed step-00000004 (rewind), step-00000005 (rewind)" in (
        caplog.text
    )
    # The next save removes nothing by rewind; retention keeps the newest two.
    manager.save(4, {"w": torch.ones(2)})
    assert _dirs(root) == ["step-00000003", "step-00000004"]
    assert manager.removed_by_last_save == {root / RUN / "step-00000002": "retention"}
    assert manager.latest().step == 4


def test_saving_the_same_or_a_later_step_without_a_ledger_rewinds_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(CheckpointConfig(root=root, run_id=RUN, keep_latest_k=0))
    for step in (1, 2, 2, 3):
        manager.save(step, {})
        assert manager.removed_by_last_save == {}
    assert _dirs(root) == ["step-00000001", "step-00000002", "step-00000003"]


def test_with_a_ledger_the_rewind_records_each_removal(tmp_path: Path, led: Ledger) -> None:
    root = tmp_path / "ckpt"

    def resumed(name: str, which: object, k: int) -> CheckpointManager:
        manager = CheckpointManager(CheckpointConfig(root=root, keep_latest_k=k))
        consumer = Consumer(led, LocalFeatureStore(), run_id=RUN, consumer_id=name)
        manager.resume(consumer, which)
        return manager

    manager = resumed("a", None, 3)
    paths = {step: manager.save(step, {"step": step}) for step in (2, 4, 5)}
    _corrupt(paths[5])
    manager = resumed("b", 2, 2)
    manager.save(3, {"step": 3})
    assert _dirs(root) == ["step-00000002-epoch-1", "step-00000003-epoch-2"]
    assert manager.removed_by_last_save == {paths[4]: "rewind", paths[5]: "rewind"}
    run = replay(led, RUN)
    by_path = {c.path: c.seq for c in run.checkpoints}
    assert run.removed_checkpoints == {
        by_path[str(paths[4])]: "rewind",
        by_path[str(paths[5])]: "rewind",
    }
    removals = [e for e in led.events(RUN) if e.kind == Kind.CHECKPOINT_REMOVED]
    assert sorted(e.payload["step"] for e in removals) == [4, 5]
    assert run.verify() == []
