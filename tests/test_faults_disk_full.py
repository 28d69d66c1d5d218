"""A disk that fills up under a put and under a checkpoint save: a real, size-limited tmpfs.

Each test mounts its own 4 MiB tmpfs (root only; elsewhere it skips) and writes more than
fits. What must hold: a DataflowError that names the path and says the disk is full,
nothing half-visible (no partial sample file, no temporary file left, no half checkpoint
listed), and what was there before intact and loadable.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, Kind, Ledger, Producer, StoreFullError, replay
from stores import SharedDirFeatureStore
from tests.conftest import unavailable
from training import CheckpointConfig, CheckpointError, CheckpointManager

RUN = "run"
FULL = 8 << 20  # bytes: twice the file system


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a real file system that runs out of space (ENOSPC)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        unavailable("mounting a size-limited tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        unavailable(f"cannot mount a size-limited tmpfs: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazily: a test that failed may still hold files open there.
        subprocess.run(["umount", "--lazy", str(where)], check=True)


@pytest.fixture
def led(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as ledger:
        yield ledger


def _bytes(n: int, value: int = 1) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


def test_a_put_on_a_full_disk_is_store_full_and_leaves_nothing_half_visible(
    small_disk: Path, led: Ledger, request: pytest.FixtureRequest
) -> None:
    store = SharedDirFeatureStore(small_disk / "store")
    request.addfinalizer(store.close)
    producer = Producer(led, store, run_id=RUN)
    kept = producer.emit("kept", {"x": _bytes(1000, 7)})
    assert kept is not None

    # The second put of one emit fills the disk: the first one's features go again.
    with pytest.raises(StoreFullError, match=r"the file system under .* is full") as caught:
        producer.emit_many([("a", {"x": _bytes(1 << 20)}), ("b", {"x": _bytes(FULL)})])
    assert str(store.path_for("b")) in str(caught.value)
    assert [e.sample_id for e in led.events(RUN) if e.kind == Kind.COMMIT] == ["kept"]
    assert [o.sample_id for o in store.scan()] == ["kept"]
    assert not store.path_for("a").exists() and not store.path_for("b").exists()
    assert not os.listdir(small_disk / "store" / "tmp")

    # A new generation of a stored sample that does not fit leaves the old one readable.
    with pytest.raises(StoreFullError, match="previous generation, if any, is intact"):
        store.put("kept", {"x": _bytes(FULL)})
    assert torch.equal(store.get(kept)["x"], _bytes(1000, 7))
    assert not os.listdir(small_disk / "store" / "tmp")

    # The space the failed writes took was given back: the next emit fits.
    assert producer.emit("c", {"x": _bytes(1 << 20)}) is not None
    assert replay(led, RUN).verify() == []


def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_checkpoint(
    small_disk: Path, led: Ledger, tmp_path: Path
) -> None:
    root = small_disk / "ckpt"
    manager = CheckpointManager(CheckpointConfig(root=root))
    consumer = Consumer(led, SharedDirFeatureStore(tmp_path / "store"), run_id=RUN, consumer_id="a")
    manager.resume(consumer, None)
    manager.save(1, {"model": {"w": torch.full((4,), 1.0)}})

    with pytest.raises(CheckpointError, match=f"disk is full writing {root}/{RUN}/") as caught:
        manager.save(2, {"model": {"w": torch.zeros(FULL // 4)}})
    assert "earlier checkpoints are intact" in str(caught.value)
    assert [c.step for c in manager.saved()] == [1]
    assert sorted(p.name for p in (root / RUN).iterdir()) == ["step-00000001-epoch-1"]
    assert [c.step for c in replay(led, RUN).checkpoints] == [1]
    assert torch.equal(manager.load()["model"]["w"], torch.full((4,), 1.0))

    # A new trainer resumes from step 1, and saving fits again once the state does.
    manager = CheckpointManager(CheckpointConfig(root=root))
    plan, state = manager.resume(Consumer(led, consumer.store, run_id=RUN, consumer_id="again"))
    assert plan.checkpoint.step == 1 and torch.equal(state["model"]["w"], torch.full((4,), 1.0))
    manager.save(2, {"model": {"w": torch.full((4,), 2.0)}})
    assert [c.step for c in replay(led, RUN).checkpoints] == [1, 2]
    assert replay(led, RUN).verify() == []
