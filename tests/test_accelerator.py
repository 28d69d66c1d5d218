"""What only an accelerator exercises: collectives under NCCL, and a GPU's state
through a checkpoint.

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
from training import CheckpointConfig, CheckpointManager

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CI machines have no GPU)"
)


def _collectives(backend: str, port: int, out: str) -> None:
    from dataflow import PeerFailedError
    from dataflow._dist import agree, broadcast_int, flag_device
    from training._dist import exchange

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
