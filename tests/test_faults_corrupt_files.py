"""Torn, truncated and bit-flipped files in the shared-directory store and in checkpoints.

Every damage is applied to real files on disk, at every byte where the file is small: a
read either raises the store's or the checkpoint's corruption error or returns exactly
what was written, never other numbers. A corrupt manifest makes a resume fall back to the
previous checkpoint, and the ledger's plan and the training after it follow that choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dataflow import (
    Consumer,
    CorruptFeatureError,
    Ledger,
    Producer,
    SampleRef,
    StaleRefError,
    replay,
)
from stores import SharedDirFeatureStore
from training import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)

RUN = "run"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedDirFeatureStore]:
    with SharedDirFeatureStore(tmp_path / "store") as feature_store:
        yield feature_store


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _read_is_whole_or_refused(
    store: SharedDirFeatureStore, ref: SampleRef, want: dict[str, torch.Tensor]
) -> bool:
    """True when the get returned exactly ``want``, False when it raised a store error."""
    try:
        got = store.get(ref)
    except (CorruptFeatureError, StaleRefError):
        return False
    assert _same(got, want), f"{ref.sample_id} read back other numbers: {got}"
    return True


def test_every_flipped_bit_cut_and_tear_of_a_sample_file_is_refused_or_harmless(
    store: SharedDirFeatureStore,
) -> None:
    first = {"x": torch.arange(8, dtype=torch.int32), "y": torch.ones(3)}
    second = {"x": torch.arange(8, 16, dtype=torch.int32), "y": torch.zeros(3)}
    path = store.path_for("s")
    old = store.put("s", first)
    old_bytes = path.read_bytes()
    new = store.put("s", second)
    new_bytes = path.read_bytes()
    assert len(old_bytes) == len(new_bytes)

    harmless = set()
    for at in range(len(new_bytes)):  # one bit flipped, at every byte
        damaged = bytearray(new_bytes)
        damaged[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(damaged))
        if _read_is_whole_or_refused(store, new, second):
            harmless.add(at)
    # Only zero padding (after the header, between and after tensors) has no checksum.
    padding = {at for at in harmless if new_bytes[at] == 0}
    assert harmless == padding

    for size in range(len(new_bytes)):  # cut short at every length
        path.write_bytes(new_bytes[:size])
        with pytest.raises(CorruptFeatureError, match=str(path)):
            store.get(new)

    # Torn: the start of one generation and the rest of the other, cut at every byte.
    for cut in range(len(new_bytes) + 1):
        path.write_bytes(old_bytes[:cut] + new_bytes[cut:])
        _read_is_whole_or_refused(store, old, first)
        _read_is_whole_or_refused(store, new, second)

    path.write_bytes(new_bytes)
    assert _same(store.get(new), second)


@pytest.fixture
def led(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as ledger:
        yield ledger


def _damage_each_way(file: Path) -> Iterator[str]:
    """Damage ``file`` in turn (truncated, emptied, torn, a flipped bit); yield what was done."""
    intact = file.read_bytes()
    damages: dict[str, Callable[[bytes], bytes]] = {
        "emptied": lambda b: b"",
        "cut to one byte": lambda b: b[:1],
        "cut in half": lambda b: b[: len(b) // 2],
        "cut by one byte": lambda b: b[:-1],
        "torn (its second half zeroed)": lambda b: b[: len(b) // 2] + bytes(len(b) - len(b) // 2),
        "one bit flipped": lambda b: (
            b[: len(b) // 3] + bytes([b[len(b) // 3] ^ 4]) + b[len(b) // 3 + 1 :]
        ),
    }
    for what, damage in damages.items():
        file.write_bytes(damage(intact))
        yield what
    file.write_bytes(intact)


def test_damaged_checkpoint_files_are_never_loaded(tmp_path: Path, led: Ledger) -> None:
    root = tmp_path / "ckpt"
    consumer = Consumer(led, SharedDirFeatureStore(tmp_path / "store"), run_id=RUN, consumer_id="a")
    manager = CheckpointManager(CheckpointConfig(root=root))
    manager.resume(consumer)
    manager.save(1, {"model": {"w": torch.full((64,), 1.0)}}, rank_state={"pos": 1})
    two = manager.save(2, {"model": {"w": torch.full((64,), 2.0)}}, rank_state={"pos": 2})
    [_, recorded] = replay(led, RUN).checkpoints
    for name in ("state.pt", "manifest.json"):
        for what in _damage_each_way(two / name):
            with pytest.raises(CorruptCheckpointError):
                manager.load(recorded)  # checked against the ledger's digest
            if name == "state.pt":  # the manifest's digests catch it also without the ledger
                with pytest.raises(CorruptCheckpointError, match=r"state\.pt"):
                    manager.load(2)
                with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000002"):
                    state = manager.load("latest")
                assert torch.equal(state["model"]["w"], torch.full((64,), 1.0)), what
    for what in _damage_each_way(two / "rank-00000.pt"):
        with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.pt"):
            manager.load_rank_state(recorded, rank=0)
        with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000002"):
            assert manager.load_rank_state("latest", rank=0) == {"pos": 1}, what
    assert torch.equal(manager.load(recorded)["model"]["w"], torch.full((64,), 2.0))


def _train(
    manager: CheckpointManager, consumer: Consumer, w: torch.Tensor, step: int, *, stop: int
) -> tuple[torch.Tensor, int]:
    """Two samples a step, each adding its value to ``w``; a checkpoint every second step."""
    while step < stop and (refs := consumer.lease(2)):
        for ref in refs:
            w = w + consumer.store.get(ref)["x"]
        step += 1
        consumer.ack(refs, step=step)
        if step % 2 == 0:
            manager.save(step, {"model": {"w": w}})
    return w, step


def test_a_corrupt_manifest_makes_resume_fall_back_and_the_plan_follows(
    tmp_path: Path, led: Ledger
) -> None:
    store = SharedDirFeatureStore(tmp_path / "store")
    producer = Producer(led, store, run_id=RUN)
    for i in range(12):
        producer.emit(f"s-{i}", {"x": torch.full((4,), float(2**i))})
    producer.close()
    root = tmp_path / "ckpt"
    manager = CheckpointManager(CheckpointConfig(root=root))
    manager.resume(Consumer(led, store, run_id=RUN, consumer_id="first"))
    _train(manager, manager.consumer, torch.zeros(4), 0, stop=5)  # saves at 2 and 4, dies at 5
    [two, four] = replay(led, RUN).checkpoints
    manifest = Path(four.path) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # torn by a crash or a bad disk

    manager = CheckpointManager(CheckpointConfig(root=root))
    with pytest.warns(UserWarning, match="not resuming from the checkpoint at step 4"):
        plan, state = manager.resume(Consumer(led, store, run_id=RUN, consumer_id="second"))
    assert plan.checkpoint == two and manager.resumed_from.step == 2
    trained_by_two = {f"s-{i}" for i in range(4)}
    assert set(plan.trained) == trained_by_two
    # Trained after step 2: again. Those the step-4 checkpoint released come back regenerated.
    assert set(plan.regenerate) == {f"s-{i}" for i in range(4, 8)}
    assert set(plan.requeued) == {f"s-{i}" for i in range(8, 12)}
    again = Producer(led, store, run_id=RUN, producer_id="regenerator")
    for sample_id in plan.regenerate:
        again.regenerate(sample_id, {"x": torch.full((4,), float(2 ** int(sample_id[2:])))})
    w = state["model"]["w"]
    assert torch.equal(w, torch.full((4,), float(sum(2**i for i in range(4)))))
    w, _ = _train(manager, manager.consumer, w, 2, stop=100)
    # Every sample counted once: the steps after the torn checkpoint were trained again.
    assert torch.equal(w, torch.full((4,), float(2**12 - 1)))
    assert replay(led, RUN).verify() == []
    store.close()


def test_a_bit_flipped_in_a_manifest_is_caught_without_the_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt", run_id=RUN))
    path = manager.save(1, {"model": {"w": torch.ones(4)}}, metrics={"eval/loss": 0.5})
    manifest = path / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"eval/loss": 0.5', b'"eval/loss": 0.7'))
    assert b'"eval/loss": 0.7' in manifest.read_bytes()
    # Listed nowhere (skipped with a warning naming the damage), so never read as true.
    assert manager.saved() == []
    with pytest.raises(CheckpointNotFoundError):
        manager.load(1)
    assert "manifest.json is corrupt: its content does not match its own sha256" in caplog.text
