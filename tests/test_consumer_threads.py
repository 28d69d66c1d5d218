"""A lease that waits does not hold up the consumer's other threads.

A rank's loader leases in one thread while its training thread acks (and
checkpoints). While a lease waits for refs, on a stream or on the ledger, an ack
from another thread goes through at once. On a stream whose window the rank's
unacked refs fill, that ack is what returns the credits the producers need to
send what the lease waits for: were the ack held up behind the lease, each
would wait for the other until the lease's timeout. Real SQLite files and a real
PostgreSQL server (the ``ledger`` fixture), real ZeroMQ sockets (and the in-process
MemoryStream), real threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from dataflow import Consumer, Ledger, Producer, RefReceiver, RefSender, SampleRef, replay
from dataflow.streams import (
    MemoryStream,
    ReceiverConfig,
    SenderConfig,
    ZmqRefReceiver,
    ZmqRefSender,
)
from stores import LocalFeatureStore

#: Long enough that a lease which ran out of it fails the test, never the normal case.
LEASE_TIMEOUT_S = 20
#: Time for the waiting thread to get into its wait (only the test's power depends on it).
SETTLE_S = 0.5
FAST = {"heartbeat_interval": 0.05, "heartbeat_timeout": 5.0}


def _memory() -> tuple[RefReceiver, RefSender, Callable[[], None]]:
    stream = MemoryStream(window=2, expected_producers=1)
    return stream.receiver(), stream.sender(), lambda: None


def _zmq() -> tuple[RefReceiver, RefSender, Callable[[], None]]:
    receiver = ZmqRefReceiver(ReceiverConfig(window=2, expected_producers=1, **FAST))
    sender = ZmqRefSender(SenderConfig(endpoints=(receiver.endpoint,), close_timeout=5, **FAST))
    return receiver, sender, lambda: (sender.close(), receiver.close())


def _ids(refs: list[SampleRef]) -> list[str]:
    return [ref.sample_id for ref in refs]


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(call()), daemon=True)
    thread.start()
    return thread, got


def _emit(producer: Producer, *sample_ids: str) -> None:
    for sample_id in sample_ids:
        producer.emit(sample_id, {"x": torch.tensor(float(len(sample_id)))})


@pytest.mark.parametrize("make_stream", [_memory, _zmq], ids=["memory", "zmq"])
def test_an_ack_from_another_thread_frees_the_window_a_waiting_lease_needs(
    ledger: Ledger, store: LocalFeatureStore, make_stream: Callable[..., tuple]
) -> None:
    receiver, sender, close = make_stream()
    consumer = Consumer(ledger, store, run_id="run", consumer_id="trainer", stream=receiver)
    consumer.resume()
    producer = Producer(ledger, store, run_id="run", stream=sender)
    emitting, _ = _in_thread(lambda: (_emit(producer, "s0", "s1", "s2", "s3"), producer.close()))
    try:
        deadline = time.monotonic() + LEASE_TIMEOUT_S
        while receiver.stats().in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = consumer.lease(2, timeout=LEASE_TIMEOUT_S)
        assert _ids(first) == ["s0", "s1"]  # the window is full: s2 waits for their acks
        waiting, got = _in_thread(lambda: consumer.lease(1, timeout=LEASE_TIMEOUT_S))
        time.sleep(SETTLE_S)
        consumer.ack(first, step=1)
        waiting.join(2 * LEASE_TIMEOUT_S)
        assert [_ids(refs) for refs in got] == [["s2"]]
        last = consumer.lease(1, timeout=LEASE_TIMEOUT_S)
        assert _ids(last) == ["s3"]
        consumer.ack([*got[0], *last], step=2)
        emitting.join(2 * LEASE_TIMEOUT_S)
        assert consumer.finished
        assert replay(ledger, "run").verify() == []
    finally:
        consumer.close()
        close()


def test_an_ack_goes_through_while_another_thread_waits_on_the_ledger(
    ledger: Ledger, store: LocalFeatureStore
) -> None:
    producer = Producer(ledger, store, run_id="run")
    _emit(producer, "s0")
    consumer = Consumer(ledger, store, run_id="run", consumer_id="trainer")
    consumer.resume()
    first = consumer.lease(1)
    waiting, got = _in_thread(lambda: consumer.lease(1, timeout=LEASE_TIMEOUT_S))
    time.sleep(SETTLE_S)
    consumer.ack(first, step=1)  # not held up until the lease above times out
    _emit(producer, "s1")  # so this comes while that lease still waits
    producer.close()
    waiting.join(2 * LEASE_TIMEOUT_S)
    assert [_ids(refs) for refs in got] == [["s1"]]
    assert replay(ledger, "run").trained == {"s0": 1}
