"""A producer's close and the refs it streamed before it, over real ZeroMQ sockets.

The ledger's close and the stream's EOF travel apart: the EOF follows the last ref on
the wire, the close goes through the database. A streaming consumer must not take
the ledger's close for the end of the stream while refs are still in flight, or a
trainer settles its last batches before they arrive.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import torch
import zmq

from dataflow import Consumer, Kind, Producer, RefSender, SampleRef, replay
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from dataflow.streams._wire import CreditFrame, HeartbeatFrame, decode, encode

WAIT = 30.0  # only ever waited out when something is broken


class HeldLink:
    """A TCP relay between a sender and a receiver that can hold what the sender sends.

    While held, bytes from the sender wait in the relay (the receiver's credit
    still flows back): refs and EOF are in flight, exactly as on a slow network.
    """

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._flowing = threading.Event()
        self._flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._flowing.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                upstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            downstream = socket.create_connection(self._target)
            self._sockets += [upstream, downstream]
            threading.Thread(
                target=self._pump, args=(upstream, downstream, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(downstream, upstream, False), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, holdable: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                if holdable:
                    self._flowing.wait()
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if holdable:
                    self._flowing.wait()
                dst.sendall(data)


@contextlib.contextmanager
def streamed_run(ledger, store, run_id) -> Iterator[tuple[Producer, Consumer, HeldLink]]:
    receiver = ZmqRefReceiver(ReceiverConfig(window=8, expected_producers=1))
    link = HeldLink(receiver.endpoint)
    sender = ZmqRefSender(
        SenderConfig(
            endpoints=(link.endpoint,), producer_id="p", send_timeout=WAIT, close_timeout=0.2
        )
    )
    consumer = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", stream=receiver)
    producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=sender)
    try:
        consumer.resume()
        yield producer, consumer, link
    finally:
        sender.close()
        link.close()
        consumer.close()


def features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((2,), float(i))}


def test_refs_in_flight_when_the_producer_closes_still_come_before_the_end(ledger, store, run_id):
    with streamed_run(ledger, store, run_id) as (producer, consumer, link):
        first = producer.emit("s0", features(0))
        assert consumer.lease(4, timeout=WAIT) == [first]
        consumer.ack([first], step=1)

        link.hold()
        late = producer.emit_many([(f"s{i}", features(i)) for i in range(1, 4)])
        producer.close()  # its EOF is held too, so the close is in the ledger alone
        consumer.refresh()
        assert "p" in consumer.state.closed

        assert not consumer.stream.exhausted  # the refs in flight are still to come
        assert not consumer.drained
        link.release()
        got: list[SampleRef] = []
        while not consumer.finished:
            refs = consumer.lease(4, timeout=WAIT)
            if refs:
                got += refs
                consumer.ack(refs, step=1 + len(got))
        assert sorted(r.sample_id for r in got) == ["s1", "s2", "s3"]
        assert got == sorted(late, key=lambda r: r.sample_id)
        assert consumer.stream.exhausted  # ended by the EOF, after the refs
        assert consumer.stream.stats().producers_closed == 1
        assert replay(ledger, run_id).verify() == []


def test_a_consumer_that_resumes_after_the_close_ends_the_stream_from_the_ledger(
    ledger, store, run_id
):
    # The producer streamed to an earlier receiver (a rank's process that is gone) and
    # closed: the new receiver never hears from it. The ledger's close, read when the
    # consumer joins its epoch, ends the stream.
    earlier = ZmqRefReceiver(ReceiverConfig(window=8, expected_producers=1))
    sender = ZmqRefSender(
        SenderConfig(endpoints=(earlier.endpoint,), producer_id="p", send_timeout=WAIT)
    )
    producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=sender)
    refs = producer.emit_many([(f"s{i}", features(i)) for i in range(3)])
    producer.close()
    earlier.close()
    receiver = ZmqRefReceiver(ReceiverConfig(window=8, expected_producers=1))
    consumer = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", stream=receiver)
    try:
        consumer.resume()
        assert receiver.exhausted
        got = consumer.lease(8, timeout=WAIT)
        assert got == refs
        consumer.ack(got, step=1)
        assert consumer.finished
    finally:
        consumer.close()


def test_a_producer_without_a_stream_is_not_one_of_the_streams_producers(ledger, store, run_id):
    # A Trainer's regeneration commits without a stream and closes before the ranks
    # (re)join: the stream still waits for its one streaming producer.
    offline = Producer(ledger, store, run_id=run_id, producer_id="trainer-regenerate")
    (first,) = offline.emit_many([("r0", features(0))])
    offline.close()
    with streamed_run(ledger, store, run_id) as (producer, consumer, _link):
        assert consumer.state.unstreamed == {"trainer-regenerate"}
        assert not consumer.stream.exhausted
        streamed = producer.emit_many([(f"s{i}", features(i)) for i in range(3)])
        got: list[SampleRef] = []
        while len(got) < 4:
            refs = consumer.lease(4, timeout=WAIT)
            got += refs
            consumer.ack(refs, step=len(got))
        assert sorted(r.sample_id for r in got) == ["r0", "s0", "s1", "s2"]
        assert not consumer.finished  # the streaming producer has not closed
        producer.close()
        assert consumer.lease(4, timeout=WAIT) == []
        assert consumer.finished and consumer.stream.exhausted
        assert {first.sample_id, *(r.sample_id for r in streamed)} == {r.sample_id for r in got}
        assert replay(ledger, run_id).verify() == []


class RecordingSender(RefSender):
    """Notes, when it is closed, whether the ledger already held the producer's close."""

    def __init__(self, ledger, run_id) -> None:
        self.ledger, self.run_id = ledger, run_id
        self.closes_in_ledger_at_eof: list[int] = []

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        closes = [e for e in self.ledger.events(self.run_id) if e.kind == Kind.CLOSE]
        self.closes_in_ledger_at_eof.append(len(closes))


def test_a_producer_ends_its_stream_before_it_records_its_close(ledger, store, run_id):
    sender = RecordingSender(ledger, run_id)
    producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=sender)
    producer.emit("s0", features(0))
    producer.close()
    assert sender.closes_in_ledger_at_eof == [0]
    assert replay(ledger, run_id).closed == {"p"}


class SilentSender(RefSender):
    """A producer's stream whose refs and end of stream went elsewhere (to an earlier
    receiver on the consumer's endpoint, which acknowledged them and is gone)."""

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_closed_producer_whose_end_of_stream_missed_a_running_consumer_ends_once_silent(
    ledger, store, run_id
):
    # The restarted consumer joins before the producer's close is in the ledger; the
    # producer's sender still heartbeats to it, then stops (its end of stream was
    # acknowledged by the consumer's previous process). Nothing more can come from it.
    receiver = ZmqRefReceiver(
        ReceiverConfig(window=8, expected_producers=1, heartbeat_interval=0.05,
                       heartbeat_timeout=1.0)
    )  # fmt: skip
    consumer = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", stream=receiver)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.linger = 0
    peer.connect(receiver.endpoint)
    beating, bound = threading.Event(), threading.Event()
    beating.set()

    def heartbeat() -> None:  # the socket's only user until it stops
        while beating.is_set():
            peer.send(encode(HeartbeatFrame(producer="p")))
            if peer.poll(50) and isinstance(decode(peer.recv_multipart()), CreditFrame):
                bound.set()  # the receiver took the connection as the producer's

    beater = threading.Thread(target=heartbeat, daemon=True)
    try:
        consumer.resume()
        beater.start()
        assert bound.wait(WAIT)
        producer = Producer(ledger, store, run_id=run_id, producer_id="p", stream=SilentSender())
        refs = producer.emit_many([(f"s{i}", features(i)) for i in range(3)])
        producer.close()
        # While a live connection speaks for it, its refs could still be on the wire.
        assert consumer.lease(4, timeout=1.5) == []
        assert not receiver.exhausted and not consumer.finished
        beating.clear()
        beater.join()
        got: list[SampleRef] = []
        deadline = time.monotonic() + WAIT
        while not consumer.finished:
            assert time.monotonic() < deadline, "the stream never ended"
            leased = consumer.lease(4, timeout=1.0)
            got += leased
            if leased:
                consumer.ack(leased, step=len(got))
        assert got == refs
        assert receiver.exhausted
        assert replay(ledger, run_id).verify() == []
    finally:
        beating.clear()
        peer.close()
        ctx.term()
        consumer.close()
