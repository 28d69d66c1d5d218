"""A producer SIGKILLed in the middle of ``emit_many`` loses nothing and leaks nothing.

A real producer process (a shared-directory store, a SQLite ledger file, a ZeroMQ
stream) emits batches and SIGKILLs itself at a chosen point of its second batch:
just after ``put_many`` returned (the files durable, nothing committed), or just
after the commit, when the stream is first asked to send. Then ``dataflow gc``
(``collect_garbage(grace=0)``) leaves no file that the ledger does not keep alive;
the producer, restarted with its id, emits the same samples again and commits
exactly those the ledger lacks; and a consumer leases and reads every sample once.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from dataflow import Consumer, Ledger, Producer, collect_garbage, replay
from stores import SharedDirFeatureStore
from stores._shared_dir_layout import sample_file_name
from tests import _zygote

RUN = "run"
BATCH, BATCHES = 16, 3

# argv: ledger URL, store URI, kill point ("put_many" or "send").
CHILD = f"""
    import os, signal, sys, torch
    from dataflow import Ledger, Producer
    from dataflow.streams import SenderConfig, ZmqRefSender
    from stores import open_store

    BATCH, BATCHES = {BATCH}, {BATCHES}
    led, store = Ledger.open(sys.argv[1]), open_store(sys.argv[2])
    where = sys.argv[3]
    # Nobody listens: each send waits its short timeout, and the refs stay unsent.
    sender = ZmqRefSender(SenderConfig(endpoints=("tcp://127.0.0.1:9",), send_timeout=0.05))
    producer = Producer(led, store, run_id="run", producer_id="p", stream=sender)
    batches = 0

    def die() -> None:
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    put_many = store.put_many

    def put_many_then_die(items):
        global batches
        refs = put_many(items)
        batches += 1
        if where == "put_many" and batches == 2:
            die()
        return refs

    def send_or_die(send):
        def wrapped(*args, **kwargs):
            if where == "send" and batches == 2:
                die()
            return send(*args, **kwargs)
        return wrapped

    store.put_many = put_many_then_die
    sender.send = send_or_die(sender.send)
    sender.send_many = send_or_die(sender.send_many)
    for b in range(BATCHES):
        producer.emit_many(
            (f"s{{i}}", {{"x": torch.full((64,), float(i))}})
            for i in range(b * BATCH, (b + 1) * BATCH)
        )
    print("finished", flush=True)
"""


def _samples() -> list[tuple[str, dict]]:
    import torch

    return [(f"s{i}", {"x": torch.full((64,), float(i))}) for i in range(BATCH * BATCHES)]


def _unreferenced(store: SharedDirFeatureStore, led: Ledger) -> list[str]:
    """Files under the store's samples/ and tmp/ that no committed sample owns."""
    owned = {sample_file_name(sample_id) for sample_id in replay(led, RUN).committed}
    left = [str(path) for path in (store.root / "tmp").iterdir()]
    left += [str(p) for p in (store.root / "samples").glob("*/*") if p.name not in owned]
    return left


@pytest.mark.parametrize(
    ("where", "committed_batches"),
    [("put_many", 1), ("send", 2)],
    ids=["after-put_many-before-commit", "after-commit-before-send"],
)
def test_a_producer_killed_inside_emit_many_loses_and_leaks_nothing(
    tmp_path: Path, where: str, committed_batches: int
) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = SharedDirFeatureStore(tmp_path / "features")
    child = _zygote.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), led.url, store.uri, where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9 and child.stdout.strip() == "dying", child.stderr[-2000:]
    committed = replay(led, RUN).committed
    assert set(committed) == {f"s{i}" for i in range(committed_batches * BATCH)}
    if where == "put_many":  # the second batch's files are there, uncommitted
        assert len(list((store.root / "samples").glob("*/*"))) == 2 * BATCH

    collect_garbage(led, store, grace=0)
    assert _unreferenced(store, led) == []
    state = replay(led, RUN)
    for sample_id in committed:  # committed before the kill: durable and readable
        assert store.get(state.ref(sample_id))["x"][0] == int(sample_id[1:])

    producer = Producer(led, store, run_id=RUN, producer_id="p")  # restarted with its id
    again = producer.emit_many(_samples())
    assert [ref is None for ref in again] == [
        i < committed_batches * BATCH for i in range(BATCH * BATCHES)
    ]
    producer.close()
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    consumer.resume()
    seen = []
    while refs := consumer.lease(BATCH):
        for ref in refs:
            assert store.get(ref)["x"][0] == int(ref.sample_id[1:])
        seen += [ref.sample_id for ref in refs]
        consumer.ack(refs, step=len(seen))
    assert sorted(seen) == sorted(sample_id for sample_id, _ in _samples())
    collect_garbage(led, store, grace=0)
    assert _unreferenced(store, led) == []
    assert store.stats().objects == BATCH * BATCHES
    store.close()
    led.close()
