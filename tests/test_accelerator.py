"""What only an accelerator exercises: collectives under NCCL, a GPU's state
through a checkpoint, and batches in pinned memory.

The core's and training's collectives run on the device the backend communicates
from: a CPU tensor fails under NCCL. One GPU admits a one-rank NCCL group only
(NCCL refuses two ranks on one device), so these call the collectives that the
multi-rank paths run (the epoch's broadcast, the agreements, the exchange)
directly, in a real NCCL group. Skipped without CUDA: CI machines have none; a
GPU machine runs them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import free_port, join, start

import training
from dataflow import Consumer, Ledger, Producer, replay
from stores import LocalFeatureStore
from training import CheckpointConfig, CheckpointManager, FeatureLoader, LoaderConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CI machines have no GPU)"
)


def _collectives(backend: str, port: int, out: str) -> None:
    from dataflow import PeerFailedError
    from dataflow.live._collectives import agree, broadcast_int, exchange, flag_device

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    got: dict[str, Any] = {"device": str(flag_device()), "broadcast": broadcast_int(41)}
    agree(None, what="nothing")
    try:
        agree(KeyError("rank 0's own"), what="a checkpoint")
    except KeyError as exc:
        got["agree"] = ["KeyError", str(exc)]
    except PeerFailedError as exc:
        got["agree"] = ["PeerFailedError", str(exc)]
    got["exchange"] = exchange("héllo, ranks") + exchange("")
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(got))


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_the_collectives_run_on_the_gpu_under_nccl(tmp_path: Path, backend: str) -> None:
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    out = tmp_path / "got.json"
    assert join(start(_collectives, backend, free_port(), str(out))) == 0
    got = json.loads(out.read_text())
    assert got == {
        "device": "cuda:0",
        "broadcast": 41,
        "agree": ["KeyError", '"rank 0\'s own"'],
        "exchange": ["héllo, ranks", ""],
    }


def test_the_gpus_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(CheckpointConfig(root=tmp_path, run_id="run"))
    random.seed(1)
    torch.manual_seed(3)  # seeds the GPU's generator too
    manager.save(1, {}, rank_state={"rng": training.rng_state()})
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(99)
    assert not torch.equal(torch.rand(3, device="cuda"), expected)
    training.set_rng_state(manager.load_rank_state(1, rank=0)["rng"])
    assert torch.equal(torch.rand(3, device="cuda"), expected)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_models_gpu_weights_are_saved_as_they_were_at_save(
    tmp_path: Path, async_save: bool
) -> None:
    model = torch.nn.Linear(8, 4).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    optimizer.step()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(
        CheckpointConfig(root=tmp_path, run_id="run", async_save=async_save)
    )
    manager.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    with torch.no_grad():  # training goes on while a background save writes
        for parameter in model.parameters():
            parameter.add_(1.0)
    manager.wait()
    state = manager.load(1)
    assert state["model"].keys() == saved.keys()
    for key, value in state["model"].items():
        assert value.device == torch.device("cpu")
        assert torch.equal(value, saved[key]), key
    restored = torch.nn.Linear(8, 4).cuda()
    restored.load_state_dict(state["model"])
    assert all(p.is_cuda for p in restored.parameters())
    assert torch.equal(restored.weight.cpu(), saved["weight"])
    assert state["optimizer"]["state"][0]["exp_avg"].shape == (4, 8)
    manager.close()


def _samples(tmp_path: Path, n: int) -> tuple[Ledger, LocalFeatureStore, Consumer]:
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore(f"pin-{tmp_path.name}")
    producer = Producer(ledger, store, run_id="run")
    for i in range(n):
        producer.emit(f"s{i}", {"x": torch.full((3,), float(i)), "y": torch.tensor(i)})
    producer.close()
    consumer = Consumer(ledger, store, run_id="run", consumer_id="trainer")
    consumer.resume()
    return ledger, store, consumer


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in _tensors(item)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_pinned_batches_go_to_the_gpu_without_blocking(tmp_path: Path, prefetch: int) -> None:
    ledger, _, consumer = _samples(tmp_path, 5)
    config = LoaderConfig(batch_size=2, prefetch=prefetch, pin_memory=True)
    seen = []
    for step, batch in enumerate(FeatureLoader(consumer, config=config), start=1):
        assert all(t.is_pinned() for t in batch.features.values())
        on_gpu = {k: v.to("cuda", non_blocking=True) for k, v in batch.features.items()}
        torch.cuda.synchronize()
        seen += on_gpu["y"].tolist()
        assert torch.equal(on_gpu["x"][:, 0].cpu(), on_gpu["y"].float().cpu())
        consumer.ack(batch.refs, step=step)
    assert seen == [0, 1, 2, 3, 4]
    assert replay(ledger, "run").verify() == []


def test_a_collate_fns_tensors_and_a_batch_with_lost_rows_are_pinned(tmp_path: Path) -> None:
    _, store, consumer = _samples(tmp_path, 6)
    store.delete(consumer.state.ref("s1"))

    def pairs(samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        return {
            "x": [s["x"] for s in samples],
            "xy": tuple((s["x"], s["y"]) for s in samples),
            "y_on_gpu": torch.stack([s["y"] for s in samples]).cuda(),  # stays there
        }

    custom = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=3, pin_memory=True), collate_fn=pairs
    )
    with pytest.warns(UserWarning, match="features gone"):
        batch = custom.next_batch()
    assert batch.sample_ids == ["s0", "s2"] and len(_tensors(batch.features)) == 7
    assert batch.features["y_on_gpu"].is_cuda and batch.features["y_on_gpu"].tolist() == [0, 2]
    assert all(t.is_pinned() for t in _tensors(batch.features) if not t.is_cuda)
    consumer.nack(batch.refs, reason="again, stacked")
    stacked = FeatureLoader(consumer, config=LoaderConfig(batch_size=3, pin_memory=True))
    store.delete(consumer.state.ref("s3"))
    with pytest.warns(UserWarning, match="features gone"):
        batch = stacked.next_batch()
    assert len(batch) == 2 and "s3" not in batch.sample_ids
    assert batch.features["y"].tolist() == [int(sid[1:]) for sid in batch.sample_ids]
    assert all(t.is_pinned() for t in batch.features.values())
