"""Full batches from a real ZeroMQ stream whose producers are slower than the ranks.

A loader in arrival order waits (up to ``LoaderConfig.batch_wait_s``) for the rest of a
batch that has some refs: every batch but the last of the data is ``batch_size`` long,
and a Trainer's optimizer steps train ``grad_accum * batch_size`` samples but the last.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_start, free_port, init_gloo, join, rank_consumer, run_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import Consumer, FeatureStore, InvalidArgumentError, Ledger, Producer, replay
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
WAIT_S = 60.0  # a stuck thread fails the test instead of hanging it
EMIT_PAUSE_S = 0.004  # a producer commits one sample every few ms: slower than the ranks
start = forkserver_start("torch.distributed", "zmq", "dataflow.streams", __name__)


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


class Streamed:
    """Real ZeroMQ receivers (one a rank) and producer threads that commit one sample at a
    time through them; everything started is stopped at teardown."""

    def __init__(self, led: Ledger, store: FeatureStore) -> None:
        self.led, self.store = led, store
        self.receivers: list[ZmqRefReceiver] = []
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def consumers(self, ranks: int, producers: int, window: int = 64) -> list[Consumer]:
        """``ranks`` consumers, rank 0 resumed first, each on a receiver of its own."""
        made = []
        for rank in range(ranks):
            receiver = ZmqRefReceiver(ReceiverConfig(expected_producers=producers, window=window))
            self.receivers.append(receiver)
            consumer = Consumer(
                self.led,
                self.store,
                run_id=RUN,
                consumer_id=f"rank{rank}",
                rank=rank,
                world_size=ranks,
                stream=receiver,
            )
            consumer.resume()
            made.append(consumer)
        return made

    def produce(
        self,
        name: str,
        count: int,
        pause: float = EMIT_PAUSE_S,
        endpoints: tuple[str, ...] | None = None,
    ) -> None:
        """Start a producer thread committing ``count`` samples, one every ``pause`` s, and
        streaming them to ``endpoints`` (default: the receivers made here)."""
        if endpoints is None:
            endpoints = tuple(r.endpoint for r in self.receivers)
        config = SenderConfig(endpoints=endpoints, producer_id=name, send_timeout=WAIT_S)

        def emit_slowly() -> None:
            try:
                sender = ZmqRefSender(config)
                # Refs go to the ranks heard so far: without this wait, a rank whose
                # receiver answered late on a loaded machine could get none of the 90.
                sender.wait_for_consumers()
                producer = Producer(
                    self.led, self.store, run_id=RUN, producer_id=name, stream=sender
                )
                for i in range(count):
                    producer.emit(f"{name}-{i:03d}", {"x": torch.full((3,), float(i))})
                    time.sleep(pause)
                producer.close()
            except BaseException as exc:
                self.errors.append(exc)
                raise

        thread = threading.Thread(target=emit_slowly, name=f"producer-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def close(self) -> None:
        for thread in self.threads:
            thread.join(WAIT_S)
        for receiver in self.receivers:
            receiver.close()
        assert self.errors == []


@pytest.fixture
def streamed(led: Ledger, store: LocalFeatureStore) -> Iterator[Streamed]:
    made = Streamed(led, store)
    yield made
    made.close()


def _in_threads(*work: Callable[[], object]) -> None:
    """Run each of ``work`` in a thread of its own; raise the first error."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a rank hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_slow_producers_still_fill_every_batch_but_the_last(
    streamed: Streamed, led: Ledger, prefetch: int
) -> None:
    # Two ranks, two producers each committing 45 samples a few ms apart (the issue's
    # set-up, 8 a batch): every batch a rank trains holds 8 samples, but its last.
    ranks = streamed.consumers(2, producers=2)
    for name in ("p0", "p1"):
        streamed.produce(name, 45)
    sizes: dict[int, list[int]] = {0: [], 1: []}

    def train(consumer: Consumer) -> None:
        config = LoaderConfig(batch_size=8, prefetch=prefetch)
        with FeatureLoader(consumer, config=config) as loader:
            for step, batch in enumerate(loader, start=1):
                sizes[consumer.rank].append(len(batch))
                loader.ack(batch.refs, step=step)
            loader.flush()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no short batch was handed out with a warning
        _in_threads(*(lambda c=c: train(c) for c in ranks))
    for rank, rank_sizes in sizes.items():
        assert rank_sizes, f"rank {rank} trained nothing"
        assert rank_sizes[:-1] == [8] * (len(rank_sizes) - 1), (rank, rank_sizes)
        assert 1 <= rank_sizes[-1] <= 8
    assert sum(map(sum, sizes.values())) == 90
    run = replay(led, RUN)
    assert len(run.trained) == 90 and run.verify() == []


def test_a_batch_waits_no_longer_than_batch_wait_s(streamed: Streamed) -> None:
    # A producer that sends 3 refs, then nothing for a long while (it stays open): the
    # loader hands out the short batch once batch_wait_s passed, with one warning.
    [consumer] = streamed.consumers(1, producers=1)
    receiver = streamed.receivers[0]
    sender = ZmqRefSender(SenderConfig(endpoints=(receiver.endpoint,), producer_id="slow"))
    try:
        producer = Producer(
            streamed.led, streamed.store, run_id=RUN, producer_id="slow", stream=sender
        )
        for i in range(3):
            producer.emit(f"s{i}", {"x": torch.zeros(2)})
        loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=8, batch_wait_s=0.5))
        started = time.monotonic()
        with pytest.warns(UserWarning, match=r"a short batch, 3 of batch_size=8 refs"):
            batch = loader.next_batch()
        waited = time.monotonic() - started
        assert batch is not None and batch.sample_ids == ["s0", "s1", "s2"]
        assert 0.5 <= waited < 30  # it waited for more, and not for ever
        assert loader.short_batches == 1
        loader.ack(batch.refs, step=1)
        producer.close()  # the end of the data: the rest comes at once, without a wait
        assert loader.next_batch() is None
        loader.close()
    finally:
        sender.close()


def test_batch_wait_s_zero_hands_out_what_is_ready(streamed: Streamed) -> None:
    [consumer] = streamed.consumers(1, producers=1)
    receiver = streamed.receivers[0]
    with ZmqRefSender(SenderConfig(endpoints=(receiver.endpoint,), producer_id="p")) as sender:
        producer = Producer(
            streamed.led, streamed.store, run_id=RUN, producer_id="p", stream=sender
        )
        producer.emit("s0", {"x": torch.zeros(2)})
        loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=8, batch_wait_s=0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batch = loader.next_batch()
        assert batch is not None and batch.sample_ids == ["s0"]
        loader.ack(batch.refs, step=1)
        producer.close()
        loader.close()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    batch_size=st.integers(1, 6),
    prefetch=st.integers(0, 2),
    arrivals=st.lists(st.integers(1, 7), min_size=1, max_size=6),
)
def test_whatever_the_arrivals_batches_are_full_but_the_last_and_in_order(
    led: Ledger, batch_size: int, prefetch: int, arrivals: list[int]
) -> None:
    # Samples arrive in bursts of any size, a pause apart: the batches are the arrival
    # order cut into batch_size pieces, whatever the bursts.
    run_id = f"run-{time.monotonic_ns()}"
    store = LocalFeatureStore()
    stream = MemoryStream(window=64, expected_producers=1)
    consumer = Consumer(led, store, run_id=run_id, consumer_id="rank0", stream=stream.receiver())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "run .* has no events")  # a new run each example
        consumer.resume()
    producer = Producer(led, store, run_id=run_id, producer_id="p", stream=stream.sender("p"))
    ids = [f"s{i:03d}" for i in range(sum(arrivals))]

    def arrive() -> None:
        at = 0
        for burst in arrivals:
            producer.emit_many([(sid, {"x": torch.zeros(2)}) for sid in ids[at : at + burst]])
            at += burst
            time.sleep(0.01)
        producer.close()

    thread = threading.Thread(target=arrive, daemon=True)
    thread.start()
    batches = []
    with FeatureLoader(
        consumer, config=LoaderConfig(batch_size=batch_size, prefetch=prefetch)
    ) as loader:
        for step, batch in enumerate(loader, start=1):
            batches.append(batch.sample_ids)
            loader.ack(batch.refs, step=step)
        loader.flush()
    thread.join(WAIT_S)
    assert batches == [ids[at : at + batch_size] for at in range(0, len(ids), batch_size)]
    assert replay(led, run_id).verify() == []


@pytest.mark.parametrize("wait", [-1, float("nan"), float("inf"), True, "5"])
def test_batch_wait_s_is_validated(wait: object) -> None:
    with pytest.raises(InvalidArgumentError, match="batch_wait_s must be a finite number"):
        LoaderConfig(batch_wait_s=wait)  # type: ignore[arg-type]


@pytest.mark.parametrize(("window", "prefetch"), [(64, 0), (12, 2)])
def test_a_trainer_steps_on_the_configured_number_of_samples_but_the_last(
    streamed: Streamed, led: Ledger, tmp_path, window: int, prefetch: int
) -> None:
    # grad_accum=2, batch_size=4, a producer slower than the step: every optimizer step
    # trains 8 samples, the last one what is left (45 = 5 * 8 + 5). A window of
    # (grad_accum + 1) * batch_size refs is enough, batches leased ahead or not.
    [consumer] = streamed.consumers(1, producers=1, window=window)
    streamed.produce("p0", 45, pause=0.03)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    in_step: list[int] = [0]
    per_step: list[int] = []

    def step_fn(batch: Batch) -> None:
        model(batch.features["x"]).sum().backward()
        in_step[0] += len(batch)

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(in_step[0])
        in_step[0] = 0

    trainer = Trainer(
        consumer,
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
        state_fn=lambda: {"model": model.state_dict()},
        config=TrainerConfig(grad_accum=2),
        loader_config=LoaderConfig(batch_size=4, prefetch=prefetch),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no short batch was handed out with a warning
        trainer.run()
    assert per_step == [8] * 5 + [5]
    run = replay(led, RUN)
    assert len(run.trained) == 45 and run.verify() == []


def _train_rank(rank: int, args: dict[str, Any]) -> None:
    """A gloo DDP rank: a Trainer on its own ZeroMQ receiver; it writes its micro-batch sizes."""
    import os

    from torch.nn.parallel import DistributedDataParallel

    init_gloo(rank, args["port"])
    receiver = ZmqRefReceiver(
        ReceiverConfig(endpoint=args["endpoints"][rank], expected_producers=2)
    )
    model = torch.nn.Linear(3, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sizes: list[int] = []

    def step_fn(batch: Batch) -> None:
        x = batch.features["x"] if len(batch) else torch.zeros(0, 3)
        ddp(x).pow(2).sum().backward()
        sizes.append(len(batch))

    def optimizer_fn(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    trainer = Trainer(
        rank_consumer(args, rank, run_id=RUN, stream=receiver),
        step_fn=step_fn,
        optimizer_fn=optimizer_fn,
        checkpoints=CheckpointManager(CheckpointConfig(root=args["ckpt"])),
        state_fn=lambda: {"model": model.state_dict()},
        config=TrainerConfig(grad_accum=2),
        loader_config=LoaderConfig(batch_size=8),
        modules=[ddp],
    )
    trainer.run()
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(sizes))
    dist.barrier()
    dist.destroy_process_group()
    receiver.close()
    os._exit(0)  # see tests/test_training_resume_ranks.py: no DDP teardown at exit


@pytest.mark.slow
def test_two_ddp_ranks_on_slow_streams_train_full_steps(tmp_path: Path) -> None:
    # The set-up: two producers streaming over ZeroMQ to two gloo DDP ranks,
    # batch_size=8, grad_accum=2 (32 samples a step). Before, steps took 1-32 samples.
    # Each rank's micro-batches hold 8 samples but its last; then it trains empty ones
    # while its peer finishes: every step takes 32 samples until a rank's data ends.
    ports: set[int] = set()
    while len(ports) < 2:
        ports.add(free_port())
    endpoints = [f"tcp://127.0.0.1:{port}" for port in sorted(ports)]
    args = run_args(tmp_path, endpoints=endpoints)
    ranks = [start(_train_rank, rank, args) for rank in range(2)]
    with Ledger.open(args["ledger"]) as led:
        producers = Streamed(led, SharedDirFeatureStore(args["features"]))
        for name in ("p0", "p1"):
            producers.produce(name, 100, endpoints=tuple(endpoints))
        producers.close()
        assert [join(rank) for rank in ranks] == [0, 0]
        run = replay(led, RUN)
        assert len(run.trained) == 200 and run.verify() == []
    sizes = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rank_sizes in enumerate(sizes):
        trained = [size for size in rank_sizes if size]
        assert trained[:-1] == [8] * (len(trained) - 1), (rank, rank_sizes)
        empty = [0] * (len(rank_sizes) - len(trained))  # once its share ran out
        assert rank_sizes == trained + empty, (rank, rank_sizes)
    assert len(sizes[0]) == len(sizes[1])  # the same steps on both ranks
    steps = [sizes[0][i : i + 2] + sizes[1][i : i + 2] for i in range(0, len(sizes[0]), 2)]
    ending = next((n for n, step in enumerate(steps) if min(step) < 8), len(steps))
    assert [sum(step) for step in steps[:ending]] == [32] * ending, steps
    assert sum(map(sum, steps)) == 200
