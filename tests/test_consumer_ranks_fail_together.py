"""Consumer.checkpoint and Consumer.resume fail on every rank or on none.

Two real processes in a real gloo group: when a ``before_checkpoint`` callback
fails on one rank, when rank 0's checkpoint write is refused, when rank 0's
resume fails, or when rank 1 fails to join the epoch rank 0 started, the rank
where it failed raises its own error and the other one raises PeerFailedError
at once, instead of waiting in a collective until the group's timeout (or going
on alone); the ledger records nothing of the failed checkpoint, and the ranks
stay in step for the next call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, init_gloo, join, rank_consumer, run_args

from dataflow import Consumer, Ledger, replay
from dataflow.live._collectives import flag_device
from stores import SharedDirFeatureStore

start = forkserver_start("torch.distributed", __name__)


def _outcome(call: Any) -> list[str]:
    """``[error type, message]`` of ``call()``, or ``["ok", repr of what it returned]``."""
    try:
        got = call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["ok", "None" if got is None else type(got).__name__]


def _rank(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    consumer = rank_consumer(args, rank)
    path = args["checkpoint_dir"]
    failures = [RuntimeError(f"flush failed on purpose on rank {rank}")]

    def flush() -> None:
        if rank == args["failing_rank"] and failures:
            raise failures.pop()

    consumer.before_checkpoint(flush)
    mismatched = consumer
    if rank == 1:
        ledger, store = Ledger.open(args["ledger"]), SharedDirFeatureStore(args["features"])
        mismatched = Consumer(
            ledger, store, run_id="run", consumer_id="rank1", rank=1, world_size=3
        )
    outcomes = {
        "resume": _outcome(lambda: consumer.resume(None)),
        "callback fails": _outcome(lambda: consumer.checkpoint(1, path)),
        "then succeeds": _outcome(lambda: consumer.checkpoint(1, path)),
        "write refused": _outcome(lambda: consumer.checkpoint(1, path)),
        "resume fails": _outcome(lambda: consumer.resume(7 if rank == 0 else "latest")),
        # Rank 1 joins the epoch rank 0 started with another world size: it fails there.
        "resume mismatched": _outcome(lambda: mismatched.resume("latest")),
        "resume again": _outcome(lambda: consumer.resume("latest")),
        "epoch": ["ok", str(consumer.epoch)],
    }
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_on_one_rank_raises_on_every_rank_at_once(
    tmp_path: Path, failing_rank: int
) -> None:
    checkpoint_dir = tmp_path / "step-1"
    checkpoint_dir.mkdir()
    args = run_args(tmp_path, failing_rank=failing_rank, checkpoint_dir=str(checkpoint_dir))
    ranks = [start(_rank, rank, args) for rank in (0, 1)]
    assert [join(p) for p in ranks] == [0, 0]
    got = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    other = 1 - failing_rank

    assert got[0]["resume"][0] == got[1]["resume"][0] == "ok"

    mine, theirs = got[failing_rank]["callback fails"], got[other]["callback fails"]
    assert mine == ["RuntimeError", f"flush failed on purpose on rank {failing_rank}"]
    assert theirs[0] == "PeerFailedError"
    assert f"failed on rank {failing_rank} (this is rank {other})" in theirs[1]
    assert "checkpoint at step 1" in theirs[1]

    # Still in step: the same checkpoint goes through on both ranks.
    assert got[0]["then succeeds"] == ["ok", "Checkpoint"]
    assert got[1]["then succeeds"] == ["ok", "None"]

    # Rank 0's write is refused (the step does not increase): rank 1 hears of it.
    assert got[0]["write refused"][0] == "LedgerStateError"
    assert "checkpoint steps must increase" in got[0]["write refused"][1]
    assert got[1]["write refused"][0] == "PeerFailedError"
    assert "failed on rank 0 (this is rank 1)" in got[1]["write refused"][1]

    # Rank 0's resume names a checkpoint the run does not have: rank 1 does not wait.
    assert got[0]["resume fails"][0] == "UnknownCheckpointError"
    assert got[1]["resume fails"][0] == "PeerFailedError"
    assert "resume of run 'run' failed on rank 0 (this is rank 1)" in got[1]["resume fails"][1]

    # Rank 1 fails after rank 0 started the epoch: rank 0 does not go on alone.
    assert got[1]["resume mismatched"][0] == "LedgerStateError"
    assert "world_size" in got[1]["resume mismatched"][1]
    assert got[0]["resume mismatched"][0] == "PeerFailedError"
    assert "resume of run 'run' failed on rank 1 (this is rank 0)" in got[0]["resume mismatched"][1]

    assert got[0]["resume again"][0] == got[1]["resume again"][0] == "ok"
    assert got[0]["epoch"] == got[1]["epoch"] == ["ok", "3"]

    with Ledger.open(args["ledger"]) as led:
        run = replay(led, "run")
        assert [c.step for c in run.checkpoints] == [1]
        assert run.verify() == []


@pytest.mark.parametrize(
    ("backend", "device"),
    [("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3"), ("mpi", "cpu")],
)
def test_the_collectives_run_on_the_device_the_backend_communicates_from(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str
) -> None:
    # No NCCL here: the backend's name alone decides, as on every rank of a real group.
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert flag_device() == torch.device(device)
