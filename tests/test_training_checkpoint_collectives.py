"""How many collectives one ``CheckpointManager.save`` runs, counted in two real gloo ranks.

Every torch.distributed collective is wrapped with a counter in each rank's process,
so a save that grows a meeting (or a meeting that grows a collective) fails here. The
count and why each meeting is needed: docs/training.md, "Collectives of a save".
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, init_gloo, join, rank_consumer, run_args

from dataflow import Ledger, replay
from training import CheckpointConfig, CheckpointManager

#: Meetings of one save with a consumer: the manager's start, files and last one, and
#: the consumer's two (docs/training.md); each is one all_gather of small messages.
# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

WITH_CONSUMER = 5
#: Without a consumer nothing is recorded: start, files, and the last meeting.
WITHOUT_CONSUMER = 3

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


def _counted() -> Counter[str]:
    """Wrap each collective of torch.distributed so that it counts its calls."""
    calls: Counter[str] = Counter()
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kw)

        setattr(dist, name, counting)
    return calls


def _calls_of(calls: Counter[str], save: Any) -> dict[str, int]:
    calls.clear()
    save()
    return dict(calls)


def _rank(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    try:
        consumer = rank_consumer(args, rank)
        config = CheckpointConfig(root=args["ckpt"], run_id="run", keep_latest_k=1)
        manager = CheckpointManager(config)
        manager.resume(consumer)
        alone = CheckpointManager(CheckpointConfig(root=args["ckpt"], run_id="alone"))
        calls = _counted()
        state = {"model": {"w": torch.ones(2)}}
        own = {"shard": torch.full((2,), float(rank))}
        metrics = {"eval/simulated_acc_len": 1.0}
        result = {
            "first": _calls_of(calls, lambda: manager.save(1, state, rank_state=own)),
            # Retention removes the first one (recorded in the ledger) in this save.
            "second": _calls_of(calls, lambda: manager.save(2, state, metrics=metrics)),
            "without_consumer": _calls_of(calls, lambda: alone.save(1, state, rank_state=own)),
        }
        Path(args["out"], f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_save_runs_one_all_gather_per_meeting_and_no_more_meetings(tmp_path: Path) -> None:
    args = run_args(tmp_path)
    ranks = [start(_rank, rank, args) for rank in range(2)]
    assert [join(process) for process in ranks] == [0, 0]
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["first"] == {"all_gather": WITH_CONSUMER}
        assert result["second"] == {"all_gather": WITH_CONSUMER}
        assert result["without_consumer"] == {"all_gather": WITHOUT_CONSUMER}
    with Ledger.open(args["ledger"]) as led:
        run = replay(led, "run")
        assert [c.step for c in run.checkpoints] == [1, 2]
        assert len(run.removed_checkpoints) == 1  # the second save's retention
        assert run.verify() == []
