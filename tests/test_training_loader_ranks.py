"""Two gloo ranks, each with a prefetching FeatureLoader holding acks, record a checkpoint
through Consumer.checkpoint directly (no Trainer): every rank's held acks reach the ledger
before rank 0 records it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _gloo import forkserver_start, init_gloo, join, rank_consumer, run_args

from dataflow import Kind, Ledger, Producer, replay
from stores import SharedDirFeatureStore
from training import FeatureLoader, LoaderConfig

# Forked from a server that imported these once: a spawned rank imports torch again.
start = forkserver_start("torch.distributed", "torch.nn.parallel", __name__)

RUN = "run"
SAMPLES = 16


def _rank(rank: int, args: dict[str, Any]) -> None:
    init_gloo(rank, args["port"])
    consumer = rank_consumer(args, rank, run_id=RUN)
    consumer.resume()
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=2))
    first = loader.next_batch()
    assert first is not None
    loader.ack(first.refs, step=1)  # held by the loader
    checkpoint_dir = Path(args["ckpt"])
    checkpoint_dir.mkdir(exist_ok=True)
    consumer.checkpoint(1, checkpoint_dir)  # every rank; no loader.flush() before it
    trained = list(first.sample_ids)
    for step, batch in enumerate(loader, start=2):
        loader.ack(batch.refs, step=step)
        trained += batch.sample_ids
    loader.close()
    Path(args["out"], f"rank{rank}.json").write_text(
        json.dumps({"first": first.sample_ids, "trained": trained})
    )
    dist.barrier()
    dist.destroy_process_group()


def test_each_ranks_held_acks_land_before_the_checkpoint(tmp_path: Path) -> None:
    args = run_args(tmp_path)
    with Ledger.open(args["ledger"]) as led:
        producer = Producer(led, SharedDirFeatureStore(args["features"]), run_id=RUN)
        for i in range(SAMPLES):
            producer.emit(f"s{i:02d}", {"x": torch.full((3,), float(i))})
        producer.close()
    ranks = [start(_rank, rank, args) for rank in range(2)]
    assert [join(p) for p in ranks] == [0, 0]
    got = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    with Ledger.open(args["ledger"]) as led:
        events = list(led.events(RUN))
        run = replay(led, RUN)
    (checkpoint,) = [e.seq for e in events if e.kind == Kind.CHECKPOINT]
    acked_at = {s: e.seq for e in events if e.kind == Kind.ACK for s in e.sample_ids}
    firsts = got[0]["first"] + got[1]["first"]
    assert len(firsts) == 4 and all(acked_at[s] < checkpoint for s in firsts)
    assert sorted(got[0]["trained"] + got[1]["trained"]) == [f"s{i:02d}" for i in range(SAMPLES)]
    assert run.verify() == []
    assert sorted(run.trained) == [f"s{i:02d}" for i in range(SAMPLES)]
