"""A producer process: the target's features of its share of the prompts into the store,
each sample's ref committed to the ledger.

In a real deployment this is the inference engine's side (a serving engine that hands
over hidden states, or ``transformers`` as here); it needs only the ledger URL, the store
URI and the run id.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from target import Sizes, build_target, features, load_prompts, sample_id

from dataflow import Ledger, Producer
from stores import open_store


def produce(job: dict[str, Any], index: int) -> None:
    torch.set_num_threads(1)
    target = build_target(Sizes(**job["sizes"]), job["seed"], job["model"])
    prompts = load_prompts(Path(job["prompts"]))
    ledger = Ledger.open(job["ledger_url"])
    store = open_store(job["store_uri"])
    producer = Producer(ledger, store, run_id=job["run_id"], producer_id=f"rollout-{index}")
    began = time.monotonic()
    mine = range(index, len(prompts), job["producers"])
    for i in mine:
        producer.emit(sample_id(i), features(target, prompts[i]))
    producer.close()
    print(f"producer {index}: {len(mine)} samples in {time.monotonic() - began:.1f} s", flush=True)
    store.close()
    ledger.close()


def main(job_path: str, index: int) -> None:
    """The producer process (``run.py`` starts it)."""
    produce(json.loads(Path(job_path).read_text()), index)
    os._exit(0)
