"""``dataflow replay`` dates a crash by its ranks' last write, and shows the outage.

A real rank process leases and acks until it is SIGKILLed at a measured time; a producer
goes on committing for a few seconds (as producers do through a trainer outage), then a
new rank resumes and leases. The crash is the last write of the killed epoch's ranks,
not the producer's commit just before the resume; the outage runs to the first lease.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import forkserver_context

from dataflow import Consumer, Ledger, Producer
from dataflow.cli import main
from stores import SharedDirFeatureStore

RUN = "run"
FORKED = forkserver_context(__name__)
WAIT = 120.0  # seconds before a stuck child fails the test instead of hanging it


def _rank(url: str, features: str, ready: Any) -> None:
    """Lease one sample, ack the one held before it, forever: a lease is always held."""
    consumer = Consumer(
        Ledger.open(url), SharedDirFeatureStore(features), run_id=RUN, consumer_id="rank0"
    )
    consumer.resume()
    held = consumer.lease(1)
    for step in range(1, 10**6):
        nxt = consumer.lease(1, timeout=1.0)
        consumer.ack(held, step=step)
        held = nxt
        if step == 3:
            ready.set()
        time.sleep(0.02)


def _features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), i)}


def test_replay_dates_the_crash_by_the_ranks_last_write_and_shows_the_outage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, features = f"sqlite:///{tmp_path}/ledger.db", str(tmp_path / "features")
    ledger = Ledger.open(url)
    producer = Producer(ledger, SharedDirFeatureStore(features), run_id=RUN, producer_id="p")
    producer.emit_many((f"s{i}", _features(i)) for i in range(400))
    ready = FORKED.Event()
    rank = FORKED.Process(target=_rank, args=(url, features, ready), daemon=True)
    rank.start()
    try:
        assert ready.wait(WAIT), "the rank never acked"
        time.sleep(0.3)
        killed = time.time()
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(WAIT)
    finally:
        if rank.is_alive():
            rank.kill()
            rank.join(WAIT)
    # The producer commits on through the outage, for 3 s.
    for i in range(400, 430):
        producer.emit(f"s{i}", _features(i))
        time.sleep(0.1)
    restarted = Consumer(
        ledger, SharedDirFeatureStore(features), run_id=RUN, consumer_id="rank0-restarted"
    )
    restarted.resume(None)
    assert restarted.lease(1)

    assert main(["replay", "--ledger", url, "--run", RUN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (crash,) = [m for m in report["markers"] if m["kind"] == "crash"]
    crashed = datetime.fromisoformat(crash["time"]).timestamp()  # to the millisecond
    assert killed - 1.0 <= crashed <= killed + 0.001, (crash, killed)
    assert crash["ts"] == pytest.approx(crashed, abs=0.001)
    (outage,) = report["outages"]
    lease = next(e for e in ledger.events(RUN) if e.kind == "lease" and e.epoch == 2)
    assert (outage["crash_ts"], outage["first_lease_seq"]) == (crash["ts"], lease.seq)
    assert outage["seconds"] == round(lease.ts - crash["ts"], 3)
    assert outage["seconds"] >= 3.0

    png = tmp_path / "run.png"  # the outage shaded on the timeline
    assert main(["replay", "--ledger", url, "--run", RUN, "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert f"(seq {crash['seq']}) epoch 1 ended with" in out
    assert f"outage: {outage['seconds']:.3f} s from the crash of epoch 1" in out
