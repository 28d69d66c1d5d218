"""A stream producer lost for a while (a link cut longer than the heartbeat timeout) does not
stop a FeatureLoader or a Trainer: they log it and go on, and every committed sample is
trained once.

The producer process lives at module level so that the fork server can import it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import forkserver_start, join

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.streams import (
    MemoryStream,
    ReceiverConfig,
    SenderConfig,
    ZmqRefReceiver,
    ZmqRefSender,
)
from stores import LocalFeatureStore, SharedDirFeatureStore
from training import (
    Batch,
    CheckpointConfig,
    CheckpointManager,
    FeatureLoader,
    LoaderConfig,
    Trainer,
    TrainerConfig,
)

RUN = "run"
#: Heartbeats of both ends: a producer silent for a second is lost.
HEARTBEATS = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0}
CUT_S = 3.0  # the link is cut three heartbeat timeouts long
SAMPLES = 60
start = forkserver_start("zmq", "dataflow.streams", __name__)


def _features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((3,), float(i))}


def test_a_loader_goes_on_after_a_producer_is_lost(sqlite_url: str, caplog) -> None:
    # The loss reaches the lease ahead's ack_and_lease in the background thread: it is
    # logged with the run and the producer, and the lease is taken again.
    stream = MemoryStream(window=64, expected_producers=1)
    store = LocalFeatureStore()
    with Ledger.open(sqlite_url) as led:
        consumer = Consumer(led, store, run_id=RUN, consumer_id="rank0", stream=stream.receiver())
        consumer.resume()
        producer = Producer(led, store, run_id=RUN, producer_id="p0", stream=stream.sender("p0"))
        for i in range(16):
            producer.emit(f"s{i:02d}", _features(i))
        loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=8, prefetch=1))
        trained = []
        first = loader.next_batch()
        assert first is not None
        assert loader.remaining_batches(fresh=True) is None  # the lease ahead is done
        loader.ack(first.refs, step=1)
        stream.lose_producer("p0")  # silent for its heartbeat timeout, the link back
        for i in range(16, 24):
            producer.emit(f"s{i:02d}", _features(i))
        producer.close()
        trained += first.sample_ids
        with caplog.at_level(logging.WARNING, logger="training"):
            for step, batch in enumerate(loader, start=2):
                trained += batch.sample_ids
                loader.ack(batch.refs, step=step)
            loader.flush()
        assert sorted(trained) == [f"s{i:02d}" for i in range(24)]
        lost = [r.getMessage() for r in caplog.records if "is lost" in r.getMessage()]
        assert len(lost) == 1 and "'p0'" in lost[0] and f"run {RUN!r}" in lost[0]
        run = replay(led, RUN)
        assert len(run.trained) == 24 and run.verify() == []
        consumer.close()


def produce_slowly(ledger_url: str, features: str, endpoint: str, progress: Any) -> None:
    """A producer process: SAMPLES samples a few ms apart, over a real ZeroMQ stream."""
    config = SenderConfig(endpoints=(endpoint,), producer_id="p0", **HEARTBEATS)
    with Ledger.open(ledger_url) as led:
        producer = Producer(
            led,
            SharedDirFeatureStore(features),
            run_id=RUN,
            producer_id="p0",
            stream=ZmqRefSender(config),
        )
        for i in range(SAMPLES):
            producer.emit(f"s{i:03d}", _features(i))
            with progress.get_lock():
                progress.value = i + 1
            time.sleep(0.015)
        producer.close()


def _cut_the_link(pid: int, progress: Any, cut: list[float]) -> None:
    """Once a third of the samples are out, stop the producer process (its link goes
    silent: no ref, no heartbeat) for CUT_S seconds, then let it go on."""
    deadline = time.monotonic() + 60
    while progress.value < SAMPLES // 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGSTOP)
    cut.append(time.monotonic())
    try:
        time.sleep(CUT_S)
    finally:
        os.kill(pid, signal.SIGCONT)
        cut.append(time.monotonic())


def _streamed_trainer(
    led: Ledger,
    features: str,
    receiver: ZmqRefReceiver,
    tmp_path: Path,
    prefetch: int,
    trained: list[str],
) -> Trainer:
    """A one-rank Trainer on ``receiver``'s stream, noting each sample it trains."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step_fn(batch: Batch) -> None:
        model(batch.features["x"]).sum().backward()
        trained.extend(batch.sample_ids)

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    return Trainer(
        Consumer(
            led, SharedDirFeatureStore(features), run_id=RUN, consumer_id="rank0", stream=receiver
        ),
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
        state_fn=lambda: {"model": model.state_dict()},
        config=TrainerConfig(grad_accum=2),
        loader_config=LoaderConfig(batch_size=4, prefetch=prefetch),
    )


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_trainer_rides_out_a_link_cut_longer_than_the_heartbeat_timeout(
    tmp_path: Path, caplog, prefetch: int
) -> None:
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    features = str(tmp_path / "features")
    receiver = ZmqRefReceiver(ReceiverConfig(expected_producers=1, **HEARTBEATS))
    led = Ledger.open(ledger_url)
    progress = multiprocessing.get_context("forkserver").Value("q", 0)
    child = start(produce_slowly, ledger_url, features, receiver.endpoint, progress)
    try:
        cut: list[float] = []
        cutter = threading.Thread(target=_cut_the_link, args=(child.pid, progress, cut))
        cutter.start()
        trained: list[str] = []
        trainer = _streamed_trainer(led, features, receiver, tmp_path, prefetch, trained)
        with caplog.at_level(logging.WARNING, logger="training"):
            trainer.run()
        cutter.join(60)
        assert join(child) == 0
        assert len(cut) == 2 and cut[1] - cut[0] >= CUT_S  # the link was cut that long
        # The consumer saw the loss (more than one only if a loaded machine starved the
        # producer's heartbeat thread too), and the loader logged each one.
        losses = receiver.stats().producers_lost
        assert losses >= 1
        lost = [r.getMessage() for r in caplog.records if "is lost" in r.getMessage()]
        assert len(lost) == losses
        assert all("'p0'" in line and f"run {RUN!r}" in line for line in lost)
        assert len(trained) == len(set(trained)) == SAMPLES  # each committed sample once
        run = replay(led, RUN)
        assert set(run.trained) == set(run.committed) == set(trained)
        assert run.verify() == []
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.join(10)
        receiver.close()
        led.close()


_PRODUCER_ON_ITS_HOST = """
import sys, time
from pathlib import Path
import torch
from dataflow import Ledger, Producer
from dataflow.streams import SenderConfig, ZmqRefSender
from stores import SharedDirFeatureStore

ledger_url, features, endpoint, progress, samples = sys.argv[1:6]
config = SenderConfig(endpoints=(endpoint,), heartbeat_interval=0.1, heartbeat_timeout=1.0)
with Ledger.open(ledger_url) as led:
    producer = Producer(led, SharedDirFeatureStore(features), run_id="run", producer_id="p0",
                        stream=ZmqRefSender(config))
    for i in range(int(samples)):
        producer.emit(f"s{i:03d}", {"x": torch.full((3,), float(i))})
        Path(progress).write_text(str(i + 1))
        time.sleep(0.015)
    producer.close()
"""


@pytest.mark.slow
def test_a_trainer_rides_out_a_stream_link_cut_silently_between_two_hosts(
    tmp_path: Path, caplog
) -> None:
    # The producer on a host of its own (a network namespace), streaming to the rank's
    # receiver on the host's address; the link between them is cut silently (frames vanish,
    # no FIN or RST) for three heartbeat timeouts, then healed.
    import subprocess
    import sys

    from tests._netns import veth_namespace, why_unavailable
    from tests.conftest import unavailable

    reason = why_unavailable()
    if reason is not None:
        unavailable(reason)
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    features = str(tmp_path / "features")
    progress = tmp_path / "progress"
    with veth_namespace("df-lod", "10.43.0.0/16") as link, Ledger.open(ledger_url) as led:
        receiver = ZmqRefReceiver(
            ReceiverConfig(
                endpoint=f"tcp://{link.host_address}:0", expected_producers=1, **HEARTBEATS
            )
        )
        child = subprocess.Popen(
            link.exec(
                sys.executable,
                "-c",
                _PRODUCER_ON_ITS_HOST,
                ledger_url,
                features,
                receiver.endpoint,
                str(progress),
                str(SAMPLES),
            ),
        )
        cut: list[float] = []

        def cut_the_link() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if progress.exists() and int(progress.read_text() or 0) >= SAMPLES // 3:
                    break
                time.sleep(0.01)
            link.cut()
            cut.append(time.monotonic())
            time.sleep(CUT_S)
            link.heal()
            cut.append(time.monotonic())

        cutter = threading.Thread(target=cut_the_link)
        try:
            cutter.start()
            trained: list[str] = []
            trainer = _streamed_trainer(led, features, receiver, tmp_path, 2, trained)
            with caplog.at_level(logging.WARNING, logger="training"):
                trainer.run()
            cutter.join(60)
            assert child.wait(60) == 0
            assert len(cut) == 2 and cut[1] - cut[0] >= CUT_S
            assert receiver.stats().producers_lost >= 1  # the cut outlasted the heartbeats
            assert any("is lost" in r.getMessage() for r in caplog.records)
            assert len(trained) == len(set(trained)) == SAMPLES
            run = replay(led, RUN)
            assert set(run.trained) == set(run.committed) == set(trained)
            assert run.verify() == []
        finally:
            if cut and len(cut) == 1:
                link.heal()
            cutter.join(10)
            child.kill()
            child.wait(10)
            receiver.close()
