"""No file leaks on a crash in the shared directory: what a SIGKILLed process leaves, `gc` finds.

Real processes SIGKILLed at a random moment of their puts (a producer) or releases
(a rank), a real SQLite ledger, then ``collect_garbage(grace=0)``: every file left
under the store's root (temporary files included) is a sample the ledger keeps alive.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from dataflow import Ledger, Producer, collect_garbage, replay
from stores import SharedDirFeatureStore
from stores._shared_dir_layout import sample_file_name
from tests._crash import PRODUCER, RANK, RUN, SAMPLES, child, kill_at_random, live_generations


def _unreferenced(store: SharedDirFeatureStore, live: set[tuple[str, int]]) -> list[str]:
    """Files under the store's samples/ and tmp/ that no sample alive in the ledger owns."""
    owned = {sample_file_name(sample_id) for sample_id, _ in live}
    left = [str(path) for path in (store.root / "tmp").iterdir()]
    for path in (store.root / "samples").glob("*/*"):
        if path.name not in owned:
            left.append(str(path))
    return left


def test_producers_killed_while_putting_leave_nothing_gc_cannot_find(tmp_path: Path) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = SharedDirFeatureStore(tmp_path / "features")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for name in ("a", "b"):  # each dies in a write of its temporary file, or between
        # 16 MiB samples: a producer spends much of its time writing temporary files.
        producer = child(PRODUCER, led.url, store.uri, str(1 << 22), name)
        kill_at_random(producer, rng, 0.5)

    report = collect_garbage(led, store, grace=0)

    live = live_generations(led)
    assert _unreferenced(store, live) == [], f"seed {seed}: gc removed {report.removed}"
    state = replay(led, RUN)
    for sample_id, _ in live:  # what the ledger keeps still reads
        assert store.get(state.ref(sample_id))["x"][0] == int(sample_id[1:])
    led.close()


def test_a_rank_killed_while_releasing_leaves_nothing_gc_cannot_find(tmp_path: Path) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = SharedDirFeatureStore(tmp_path / "features")
    producer = Producer(led, store, run_id=RUN, producer_id="p0")
    producer.emit_many((f"s{i}", {"x": torch.full((512,), float(i))}) for i in range(SAMPLES))
    producer.close()
    seed = random.randrange(1 << 30)
    rank = child(RANK, led.url, store.uri, str(tmp_path))
    kill_at_random(rank, random.Random(seed), 0.5)
    assert replay(led, RUN).released, f"seed {seed}: the rank released nothing"

    collect_garbage(led, store, grace=0)

    assert _unreferenced(store, live_generations(led)) == [], f"seed {seed}"
    led.close()
