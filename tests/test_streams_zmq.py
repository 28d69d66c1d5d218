"""The ZeroMQ stream on real loopback sockets, in one process: credit, EOF, bad frames, CURVE."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow import (
    BackpressureError,
    BadFrameError,
    FeatureSpec,
    InvalidArgumentError,
    ProducerLostError,
    SampleRef,
    StreamError,
    StreamIdleError,
    TensorInRefError,
)
from dataflow.streams import (
    CurveClientConfig,
    CurveServerConfig,
    ReceiverConfig,
    SenderConfig,
    ZmqRefReceiver,
    ZmqRefSender,
    _sender,
)
from dataflow.streams._receiver import water_fill
from dataflow.streams._wire import CreditFrame, decode

FAST = {"heartbeat_interval": 0.05, "heartbeat_timeout": 1.0}


def ref(i: int | str) -> SampleRef:
    return SampleRef(f"s-{i}", "mem://test", 1, metadata={"i": str(i)})


@pytest.fixture
def ends() -> Iterator[tuple[Callable[..., ZmqRefReceiver], Callable[..., ZmqRefSender]]]:
    made: list[ZmqRefReceiver | ZmqRefSender] = []

    def receiver(**kwargs: object) -> ZmqRefReceiver:
        made.append(ZmqRefReceiver(ReceiverConfig(**{**FAST, **kwargs})))  # type: ignore[arg-type]
        return made[-1]  # type: ignore[return-value]

    def sender(*receivers: ZmqRefReceiver, **kwargs: object) -> ZmqRefSender:
        endpoints = tuple(r.endpoint for r in receivers)
        config = {**FAST, "close_timeout": 2.0, "send_timeout": 5.0, **kwargs}
        made.append(ZmqRefSender(SenderConfig(endpoints=endpoints, **config)))  # type: ignore[arg-type]
        return made[-1]  # type: ignore[return-value]

    yield receiver, sender
    for end in reversed(made):
        end.close()


def drain(receiver: ZmqRefReceiver, timeout: float = 10) -> list[str]:
    ids = []
    while refs := receiver.receive(64, timeout=timeout):
        ids += [r.sample_id for r in refs]
        receiver.credit(len(refs))
    return ids


def test_send_receive_and_end_of_stream(ends) -> None:
    receiver, sender = ends
    r = receiver()
    assert r.endpoint.startswith("tcp://127.0.0.1:") and not r.endpoint.endswith(":0")
    s = sender(r, producer_id="p0")
    for i in range(64):  # the default window
        s.send(ref(i))
    s.close()
    assert drain(r) == [f"s-{i}" for i in range(64)]
    assert r.exhausted
    stats = r.stats()
    assert (stats.received, stats.credited, stats.in_flight) == (64, 64, 0)
    assert stats.producers_closed == 1 and stats.bad_frames == 0
    assert s.stats().sent == 64


def test_two_producers_two_ranks_each_ref_once(ends) -> None:
    receiver, sender = ends
    ranks = [receiver(window=8, expected_producers=2) for _ in range(2)]
    got: list[list[str]] = [[], []]

    def produce(name: str) -> None:
        s = sender(*ranks, producer_id=name)
        for i in range(1000):
            s.send(ref(f"{name}-{i}"))
        s.close()

    def consume(rank: int) -> None:
        got[rank] = drain(ranks[rank])

    threads = [threading.Thread(target=produce, args=(p,)) for p in ("a", "b")]
    threads += [threading.Thread(target=consume, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    everything = got[0] + got[1]
    assert len(everything) == len(set(everything)) == 2000
    assert got[0] and got[1]
    assert all(r.stats().max_in_flight <= 8 for r in ranks)


def test_early_eof_does_not_end_the_stream(ends) -> None:
    receiver, sender = ends
    r = receiver(expected_producers=2)
    sender(r, producer_id="early").close()
    late = sender(r, producer_id="late")
    with pytest.raises(StreamIdleError):
        r.receive(1, timeout=0.3)
    assert not r.exhausted
    late.send(ref(1))
    late.close()
    assert drain(r) == ["s-1"]
    assert r.stats().producers_closed == 2


def test_backpressure_holds_the_window_while_a_consumer_stalls(ends) -> None:
    receiver, sender = ends
    r = receiver(window=4)
    s = sender(r)
    for i in range(4):
        s.send(ref(i))
    with pytest.raises(BackpressureError, match="credit"):
        s.send(ref(4), timeout=0.3)
    assert r.stats().in_flight <= 4
    refs = r.receive(10, timeout=5)
    assert len(refs) == 4
    with pytest.raises(BackpressureError):  # received but not finished: still in flight
        s.send(ref(4), timeout=0.3)
    r.credit(4)
    s.send(ref(4), timeout=5)
    assert r.stats().max_in_flight == 4
    assert s.stats().backpressure_errors == 2


def test_in_flight_never_exceeds_window_under_a_slow_consumer(ends) -> None:
    receiver, sender = ends
    r = receiver(window=5)
    s = sender(r)
    seen_in_flight: list[int] = []
    stop = threading.Event()

    def produce() -> None:
        for i in range(200):
            s.send(ref(i), timeout=10)
        s.close()

    def watch() -> None:
        while not stop.is_set():
            seen_in_flight.append(r.stats().in_flight)
            time.sleep(0.001)

    threads = [threading.Thread(target=produce), threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    count = 0
    while refs := r.receive(3, timeout=10):
        time.sleep(0.002)  # a slow training step
        count += len(refs)
        r.credit(len(refs))
    stop.set()
    for thread in threads:
        thread.join(30)
    assert count == 200
    assert max(seen_in_flight) <= 5 and r.stats().max_in_flight <= 5
    assert s.stats().waited > 0


def test_other_threads_get_in_while_send_and_receive_wait(ends) -> None:
    receiver, sender = ends
    r = receiver(window=1)
    s = sender(r)
    s.send(ref(0))
    errors: list[Exception] = []

    def blocked_send() -> None:
        try:
            s.send(ref(1), timeout=30)
        except StreamError as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_send)
    thread.start()
    while s.stats().waited == 0:  # stats() gets the lock while send waits
        time.sleep(0.01)
    s.close()  # ends the waiting send: nothing may follow the EOF
    thread.join(30)
    assert len(errors) == 1 and "closed" in str(errors[0])
    other = receiver(idle_timeout=30)
    waiting = threading.Thread(target=lambda: errors.extend(_catch(other.receive, 1)))
    waiting.start()
    time.sleep(0.1)
    assert other.stats().received == 0 and not other.exhausted
    other.close()  # ends the waiting receive
    waiting.join(30)
    assert isinstance(errors[1], StreamError) and "closed" in str(errors[1])


def _catch(fn: Callable[..., object], *args: object) -> list[Exception]:
    try:
        fn(*args)
    except Exception as exc:
        return [exc]
    return []


def test_no_consumer_means_backpressure(ends) -> None:
    receiver, _ = ends
    r = receiver()
    endpoint = r.endpoint
    r.close()
    s = ZmqRefSender(SenderConfig(endpoints=(endpoint,), close_timeout=0.2, **FAST))
    try:
        with pytest.raises(BackpressureError, match="never heard"):
            s.send(ref(0), timeout=0.3)
    finally:
        s.close()  # waits close_timeout for an acknowledgement that cannot come


def test_wait_for_consumers_returns_once_every_receiver_granted_credit(ends) -> None:
    receiver, sender = ends
    ranks = [receiver(window=4) for _ in range(2)]
    s = sender(*ranks, producer_id="p")
    s.wait_for_consumers(timeout=10)
    # Each rank granted its window: the next eight refs spread over both, four each.
    for i in range(8):
        s.send(ref(i), timeout=0)
    got = [[], []]
    for rank, r in enumerate(ranks):
        while len(got[rank]) < 4:
            got[rank] += r.receive(8, timeout=5)
    assert sorted(x.sample_id for x in got[0] + got[1]) == sorted(f"s-{i}" for i in range(8))
    assert [len(g) for g in got] == [4, 4]


def test_wait_for_consumers_names_the_endpoint_not_heard(ends) -> None:
    receiver, sender = ends
    up, gone = receiver(), receiver()
    missing = gone.endpoint
    gone.close()
    s = sender(up, gone, producer_id="p", close_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(BackpressureError, match=rf"no consumer at \['{missing}'\] within 0.5s"):
        s.wait_for_consumers(timeout=0.5)
    assert time.monotonic() - started >= 0.5
    assert up.stats().received == 0  # waiting sends nothing


def test_wait_for_consumers_needs_a_producer_id_and_an_open_sender(ends) -> None:
    receiver, sender = ends
    r = receiver()
    s = sender(r)
    with pytest.raises(InvalidArgumentError, match="speaks for no producer"):
        s.wait_for_consumers(timeout=1)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        s.wait_for_consumers(timeout=-1)
    s.bind_producer("p")
    s.close()
    with pytest.raises(StreamError, match="closed"):
        s.wait_for_consumers(timeout=1)


def test_idle_timeout(ends) -> None:
    receiver, sender = ends
    r = receiver(idle_timeout=0.2)
    sender(r)
    with pytest.raises(StreamIdleError):
        r.receive(1)
    with pytest.raises(StreamIdleError):
        r.receive(1, timeout=0)


class RawPeer:
    """A peer on a raw pyzmq DEALER socket: it speaks our wire format, or anything else."""

    def __init__(self, ctx: zmq.Context, endpoint: str, routing_id: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndtimeo = 10_000  # a peer the receiver never admits must not hang a test
        self.sock.routing_id = routing_id
        self.sock.connect(endpoint)

    def send(self, *parts: bytes) -> None:
        self.sock.send_multipart(list(parts))

    def send_blindly(self, *parts: bytes) -> None:
        """Queue ``parts`` if the socket takes them now: a peer whose handshake the
        receiver refuses (CURVE) may never get a pipe to queue them on."""
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart(list(parts), flags=zmq.NOBLOCK)

    def credit(self, producer: str) -> CreditFrame:
        """Name ``producer`` in a heartbeat and wait for the receiver's credit."""
        self.send(frame(type="hb", producer=producer))
        deadline = time.monotonic() + 10
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            got = decode(self.sock.recv_multipart())
            if isinstance(got, CreditFrame) and got.granted > 0:
                return got
        raise AssertionError(f"no credit came for {producer!r}")

    def ref(self, credit: CreditFrame, item: object) -> None:
        """Send a ref (a SampleRef, or a dict for a forged one) against ``credit``."""
        body = item.to_dict() if isinstance(item, SampleRef) else item
        self.send(frame(type="ref", receiver=credit.receiver, line=credit.line, ref=body))

    def heard(self, wait: float = 0.3) -> list[object]:
        """The frames the receiver sent this peer within ``wait`` seconds."""
        frames = []
        while self.sock.poll(int(wait * 1000)):
            frames.append(decode(self.sock.recv_multipart()))
        return frames

    def close(self) -> None:
        self.sock.close(linger=10_000)  # deliver what was sent (a loaded machine is slow), then go


@pytest.fixture
def raw() -> Iterator[Callable[..., RawPeer]]:
    ctx = zmq.Context()
    made: list[RawPeer] = []  # a socket collected as garbage would drop what it queued

    def peer(endpoint: str, routing_id: bytes = b"raw-peer") -> RawPeer:
        made.append(RawPeer(ctx, endpoint, routing_id))
        return made[-1]

    yield peer
    ctx.destroy(linger=0)


def frame(**fields: object) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


def eventually(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the receiver never got there"
        time.sleep(0.01)


def settled(r: ZmqRefReceiver, peer: RawPeer) -> None:
    """Wait until ``r`` handled all ``peer`` sent so far: a connection's frames keep their order."""
    bad = r.stats().bad_frames
    peer.send(b"barrier: not JSON")
    eventually(lambda: r.stats().bad_frames > bad)


def test_silent_producer_is_lost_not_a_hang(ends, raw) -> None:
    receiver, _ = ends
    r = receiver(heartbeat_interval=0.05, heartbeat_timeout=0.5)
    peer = raw(r.endpoint)
    peer.ref(peer.credit("ghost"), ref(0))  # delivers a ref, then dies silently
    assert [x.sample_id for x in r.receive(1, timeout=5)] == ["s-0"]
    with pytest.raises(ProducerLostError, match="ghost"):
        r.receive(1, timeout=5)
    assert r.stats().producers_lost == 1
    with pytest.raises(StreamIdleError):  # reported once, then only idle
        r.receive(1, timeout=0.2)


def test_heartbeats_for_unknown_producers_never_raise(ends, raw) -> None:
    # Issue #11: each heartbeat naming a made-up producer, from a connection of
    # its own, made receive() raise ProducerLostError once, so that 300 of them
    # kept a real ref from being received.
    receiver, sender = ends
    r = receiver(heartbeat_timeout=0.5)
    for i in range(300):
        peer = raw(r.endpoint, f"fake-{i}".encode())
        peer.send(frame(type="hb", producer=f"ghost-{i}"))
        peer.close()
    s = sender(r, producer_id="real")
    s.send(ref("real"))
    got: list[str] = []
    deadline = time.monotonic() + 30
    while (not got or r.stats().dropped_unknown_producer < 300) and time.monotonic() < deadline:
        with contextlib.suppress(StreamIdleError):
            got += [x.sample_id for x in r.receive(5, timeout=0.1)]
    assert got == ["s-real"]
    stats = r.stats()
    assert stats.dropped_unknown_producer == 300 and stats.producers_lost == 0
    with pytest.raises(StreamIdleError):  # more than a heartbeat timeout later: still quiet
        r.receive(1, timeout=0.7)


def test_a_producer_speaks_only_on_its_own_connection(ends, raw) -> None:
    # Issue #11: an EOF for a producer, sent from another connection, ended that
    # producer's stream.
    receiver, sender = ends
    r = receiver(heartbeat_timeout=30.0)
    s = sender(r, producer_id="p0")
    s.send(ref(0))
    forger = raw(r.endpoint, b"forger")
    forger.send(frame(type="eof", producer="p0"))
    forger.send(frame(type="hb", producer="p0"))  # claiming p0 first does not help
    forger.send(frame(type="eof", producer="p0"))
    settled(r, forger)
    assert [x.sample_id for x in r.receive(5, timeout=5)] == ["s-0"]
    r.credit(1)
    assert not r.exhausted and r.stats().producers_closed == 0
    assert forger.heard() == []  # no credit, no EOF acknowledgement
    s.send(ref(1))
    s.close()
    assert drain(r) == ["s-1"]
    stats = r.stats()
    assert stats.producers_closed == 1 and stats.dropped_foreign_connection == 3


def test_refs_without_credit_are_dropped(ends, raw) -> None:
    # Issue #11: refs sent without credit were accepted, one of shape (2^62, 2^62) too.
    receiver, _ = ends
    r = receiver(window=4, heartbeat_timeout=30.0)
    huge = {**ref("huge").to_dict(), "specs": {"x": {"shape": [2**62, 2**62], "dtype": "float32"}}}
    blind = raw(r.endpoint, b"blind")  # never asked for credit
    for i in range(3):
        blind.send(frame(type="ref", receiver="x" * 32, line=1, ref=ref(i).to_dict()))
    blind.send(frame(type="ref", receiver=r.session, line=1, ref=ref(3).to_dict()))
    blind.send(frame(type="ref", receiver=r.session, line=1, ref=huge))
    settled(r, blind)
    with pytest.raises(StreamIdleError):
        r.receive(5, timeout=0.2)
    assert (r.stats().dropped_no_credit, r.stats().bad_frame_kinds["malformed"]) == (4, 2)
    talker = raw(r.endpoint, b"talker")
    credit = talker.credit("talker")
    assert credit.granted == 4  # the whole window
    talker.ref(credit, huge)  # on credit, and still refused
    for i in range(credit.granted + 2):
        talker.ref(credit, ref(f"t{i}"))
    settled(r, talker)
    assert [x.sample_id for x in r.receive(10, timeout=5)] == ["s-t0", "s-t1", "s-t2", "s-t3"]
    stats = r.stats()
    assert stats.dropped_no_credit == stats.dropped_refs == 6
    assert stats.received == 4 and stats.max_in_flight == 4
    assert stats.bad_frame_kinds["malformed"] == 4  # two huge refs and two barriers


def test_duplicate_keys_never_reach_the_caller(ends, raw) -> None:
    # Issue #11: a frame with a key given twice was accepted (json keeps the last).
    receiver, _ = ends
    r = receiver(heartbeat_timeout=30.0)
    peer = raw(r.endpoint)
    credit = peer.credit("p0")
    body = frame(type="ref", receiver=credit.receiver, line=credit.line, ref=ref("a").to_dict())
    twice = body.replace(b'"sample_id": "s-a"', b'"sample_id": "s-a", "sample_id": "s-b"')
    peer.send(twice)
    peer.send(frame(type="hb", producer="p0").replace(b'"v": 1', b'"v": 1, "v": 1'))
    settled(r, peer)
    with pytest.raises(StreamIdleError):
        r.receive(5, timeout=0.2)
    assert r.stats().bad_frame_kinds["malformed"] == 3 and r.stats().received == 0


def test_bad_frames_are_counted_dropped_and_logged_once(ends, raw, caplog) -> None:
    # Issue #11: garbage, truncated and oversized frames are dropped and counted,
    # the log gets one line per kind from each peer, and real refs still come.
    receiver, sender = ends
    r = receiver(max_frame_bytes=4096, heartbeat_timeout=30.0)
    good = frame(type="ref", receiver="x" * 32, line=1, ref=ref(0).to_dict())
    bad = [
        [b"{definitely not json"],
        [b"\xff\xfe\x00 garbage"],
        [frame(type="hb", producer="p", extra=True)],
        [frame(type="credit", receiver="x" * 32, line=1, granted=5)],  # for producers
        *([good[:cut]] for cut in range(1, len(good))),  # every truncation
        [frame(v=9, type="hb", producer="p")],
        [good + b" " * 5000],
        [good + b" " * 6000],
        [pickle.dumps(torch.arange(4))],
        [good, torch.arange(4).numpy().tobytes()],
        [frame(type="ref", receiver="x" * 32, line=1, ref={**ref(0).to_dict(), "specs": 5})],
    ]
    with caplog.at_level(logging.WARNING, logger="dataflow.streams"):
        peer = raw(r.endpoint)
        for parts in bad:
            peer.send(*parts)
        raw(r.endpoint, b"huge").send(b"{" + b" " * 3 * 4096)  # beyond what is read at all
        s = sender(r, producer_id="p0")
        s.send(ref("fine"))
        refs = r.receive(5, timeout=5)
        eventually(lambda: r.stats().bad_frames >= len(bad))
    assert [x.sample_id for x in refs] == ["s-fine"]
    malformed = 4 + len(good) - 1 + 1
    assert r.stats().bad_frame_kinds == {
        "malformed": malformed,
        "version": 1,
        "oversized": 2,
        "tensor": 2,
    }
    warnings = [rec.getMessage() for rec in caplog.records if "bad frame" in rec.getMessage()]
    assert len(warnings) == 4, warnings  # one per kind from the one peer
    assert all("only counted" in w for w in warnings)


def test_warnings_about_peers_are_rate_limited(ends, raw, caplog) -> None:
    receiver, _ = ends
    r = receiver(heartbeat_timeout=30.0)
    with caplog.at_level(logging.WARNING, logger="dataflow.streams"):
        for i in range(50):
            raw(r.endpoint, f"peer-{i}".encode()).send(b"garbage")
        eventually(lambda: r.stats().bad_frames == 50)
    assert sum("bad frame" in rec.getMessage() for rec in caplog.records) == 20


@pytest.mark.parametrize("seed", range(3))
def test_mangled_frames_never_crash_or_mislead_a_receiver(ends, raw, caplog, seed: int) -> None:
    # The docs' promise: no frame from the network crashes or misleads a receiver.
    caplog.set_level(logging.WARNING, logger="dataflow.streams")
    receiver, sender = ends
    r = receiver(window=8, expected_producers=2, heartbeat_timeout=30.0)
    peer = raw(r.endpoint)
    credit = peer.credit("mangler")
    valid = [
        frame(type="ref", receiver=credit.receiver, line=credit.line, ref=ref(0).to_dict()),
        frame(type="hb", producer="mangler"),
        frame(type="eof", producer="someone-else"),
        frame(type="credit", receiver=credit.receiver, line=1, granted=3),
        frame(type="eof_ack", receiver=credit.receiver),
    ]
    rng = random.Random(seed)
    for _ in range(500):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            choice = rng.random()
            if choice < 0.4:
                data[at] = rng.randrange(256)
            elif choice < 0.7:
                data[at:at] = rng.choice([b"9" * 30, b"-", b'"', b"{", b"]", b"\\u0000", b",,"])
            else:
                del data[at : at + rng.randint(1, 8)]
        peer.send(bytes(data))
    settled(r, peer)
    got: list[SampleRef] = []
    with contextlib.suppress(StreamIdleError):
        while refs := r.receive(64, timeout=0.2):
            got += refs
            r.credit(len(refs))
    stats = r.stats()
    assert len(got) <= credit.granted and stats.max_in_flight <= 8
    for item in got:  # whatever got through is a ref the wire allows
        assert item == SampleRef.from_json(item.to_json())
        assert all(spec.nbytes <= 2**48 for spec in item.specs.values())
    assert r.stats().producers_closed == 0  # the only EOF was for a producer nobody named
    peer.send(frame(type="eof", producer="mangler"))  # returns the credit it sat on
    s = sender(r, producer_id="real")
    s.send(ref("real"))
    s.close()
    assert drain(r) == ["s-real"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]  # the ticker's


def test_check_refuses_what_send_refuses(ends) -> None:
    receiver, sender = ends
    r = receiver()
    s = sender(r, max_frame_bytes=1024)
    tensor = ref("t")
    tensor.metadata["t"] = torch.ones(1)  # type: ignore[index]
    refused = {
        "oversized": SampleRef("big", "mem://test", 1, metadata={"x": "y" * 1000}),
        "malformed": SampleRef(
            "huge", "mem://test", 1, specs={"x": FeatureSpec((2**62, 2**62), torch.float32)}
        ),
        "tensor": tensor,
    }
    for kind, bad in refused.items():
        with pytest.raises(BadFrameError) as info:
            s.check(bad)
        assert info.value.kind == kind  # type: ignore[attr-defined]
        with pytest.raises((BadFrameError, TensorInRefError)):
            s.send(bad, timeout=1)
    s.check(ref(0))  # fits: no error, and nothing sent
    assert s.stats().sent == 0
    s.send(ref(0))
    assert [x.sample_id for x in r.receive(5, timeout=5)] == ["s-0"]


def test_check_many_refuses_as_check_and_its_refs_go_out_as_encoded(ends, monkeypatch) -> None:
    receiver, sender = ends
    r = receiver()
    s = sender(r, max_frame_bytes=1024)
    tensor = ref("t")
    tensor.metadata["t"] = torch.ones(1)  # type: ignore[index]
    big = SampleRef("big", "mem://test", 1, metadata={"x": "y" * 1000})
    for kind, bad in {"oversized": big, "tensor": tensor}.items():
        with pytest.raises(BadFrameError) as info:
            s.check_many([ref(0), bad, ref(1)])
        assert info.value.kind == kind  # type: ignore[attr-defined]
    batch = [ref(i) for i in range(4)]
    s.check_many(batch)
    assert s.stats().sent == 0
    encoded: list[int] = []
    ref_bodies = _sender.ref_bodies
    monkeypatch.setattr(_sender, "ref_bodies", lambda *a: (encoded.append(1), ref_bodies(*a))[1])
    s.send_many(list(batch))  # the very refs checked: nothing encoded again
    s.send_many([ref(4), ref(5)])  # others: encoded
    assert encoded == [1]
    got: list[SampleRef] = []
    while len(got) < 6:
        got += r.receive(8, timeout=5)
    assert got == [*batch, ref(4), ref(5)]


def test_consumer_restart_on_the_same_endpoint(ends) -> None:
    receiver, sender = ends
    first = receiver(window=4)
    endpoint = first.endpoint
    s = sender(first, producer_id="p0")
    for i in range(4):
        s.send(ref(i))
    first.close()  # dies with 4 refs in flight: the ledger requeues them
    second = receiver(window=4, endpoint=endpoint)
    got: list[str] = []
    consumer = threading.Thread(target=lambda: got.extend(drain(second)))
    consumer.start()
    for i in range(4, 40):
        s.send(ref(i), timeout=10)
    s.close()
    consumer.join(30)
    assert [x for x in got if x not in {"s-0", "s-1", "s-2", "s-3"}] == [
        f"s-{i}" for i in range(4, 40)
    ]
    assert second.stats().max_in_flight <= 4


def test_connections_are_introduced_without_waiting_for_a_heartbeat(ends) -> None:
    receiver, sender = ends
    slow = {"heartbeat_interval": 30.0, "heartbeat_timeout": 100.0}

    def receive_one(r: ZmqRefReceiver, into: list) -> threading.Thread:
        def run() -> None:
            with contextlib.suppress(StreamIdleError):
                into.extend(r.receive(1, timeout=10))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    first = receiver(**slow)
    got: list[SampleRef] = []
    waiting = receive_one(first, got)  # a consumer waiting in receive grants at once
    s = sender(first, close_timeout=0.2, **slow)  # nobody pumps second for its EOF ack
    s.send(ref(0), timeout=10)  # long before the first heartbeat is due
    waiting.join(10)
    endpoint = first.endpoint
    first.close()
    second = receiver(endpoint=endpoint, **slow)
    waiting = receive_one(second, got)
    # Refs sent while the old connection is going down are lost (the ledger
    # has them), so keep sending until one arrives.
    deadline, i = time.monotonic() + 10, 1
    while waiting.is_alive() and time.monotonic() < deadline:
        s.send(ref(i), timeout=10)
        i += 1
        time.sleep(0.02)
    waiting.join(10)
    assert len(got) == 2
    assert s._links[0].receiver == second.session  # the new receiver granted credit


@pytest.mark.parametrize(
    ("heartbeat_timeout", "pause"),
    [
        (0.5, 0.7),  # the restart outlives the crashed session's heartbeat timeout
        (30.0, 0.0),  # the takeover waits for no timeout: the old connection is gone
    ],
)
def test_producer_restart_replaces_its_old_session(
    ends, heartbeat_timeout: float, pause: float
) -> None:
    receiver, sender = ends
    r = receiver(heartbeat_timeout=heartbeat_timeout)
    crashed = sender(r, producer_id="p0")
    crashed.send(ref(0))
    assert [x.sample_id for x in r.receive(1, timeout=5)] == ["s-0"]
    r.credit(1)
    crashed._shutdown(linger=0)  # no EOF: as if killed
    restarted = sender(r, producer_id="p0")
    restarted.send(ref(1), timeout=5)
    time.sleep(pause)
    restarted.close()
    assert drain(r) == ["s-1"]  # and no ProducerLostError
    assert r.stats().producers_lost == 0 and r.stats().producers_closed == 1


def test_late_consumer_gets_the_eof_while_the_producer_lingers(ends) -> None:
    receiver, _ = ends
    r = receiver()
    endpoint = r.endpoint
    r.close()
    s = ZmqRefSender(SenderConfig(endpoints=(endpoint,), close_timeout=10.0, **FAST))
    closer = threading.Thread(target=s.close)
    closer.start()
    time.sleep(0.2)
    late = receiver(endpoint=endpoint)
    assert late.receive(1, timeout=5) == []
    closer.join(10)
    assert not closer.is_alive()


def test_mark_producer_closed(ends) -> None:
    receiver, _ = ends
    r = receiver(expected_producers=2)
    r.mark_producer_closed("a")
    assert not r.exhausted
    r.mark_producer_closed("b")
    assert r.exhausted and r.receive(1, timeout=0) == []


def test_misuse_is_refused(ends) -> None:
    receiver, sender = ends
    r = receiver()
    s = sender(r)
    with pytest.raises(ValueError, match="credit"):
        r.credit(1)
    bad = ref(0)
    bad.metadata["t"] = torch.ones(1)  # type: ignore[index]
    with pytest.raises(TensorInRefError):
        s.send(bad)
    with pytest.raises(ValueError):
        SenderConfig(endpoints="tcp://127.0.0.1:5555")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ReceiverConfig(window=0)
    with pytest.raises(ValueError):
        ReceiverConfig(heartbeat_interval=1.0, heartbeat_timeout=1.5)
    with pytest.raises(StreamError, match="cannot bind"):
        receiver(endpoint=r.endpoint)
    s.close()
    with pytest.raises(StreamError):
        s.send(ref(1))
    r.close()
    with pytest.raises(StreamError):
        r.receive(1)


def test_binding_beyond_loopback_without_curve_warns(ends, caplog) -> None:
    receiver, _ = ends
    with caplog.at_level(logging.WARNING, logger="dataflow.streams"):
        r = receiver(endpoint="tcp://0.0.0.0:0")
    assert "without CURVE" in caplog.text
    assert r.endpoint.startswith("tcp://0.0.0.0:")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (tmp_path / "other").mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "consumer")
    producer_public, producer_secret = zmq.auth.create_certificates(tmp_path, "producer")
    (authorized / "producer.key").write_bytes(Path(producer_public).read_bytes())
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "other", "stranger")
    return {
        "server_public": Path(server_public),
        "server_secret": Path(server_secret),
        "authorized": authorized,
        "producer_secret": Path(producer_secret),
        "stranger_secret": Path(stranger_secret),
    }


def test_curve_admits_the_key_holder_and_refuses_others(ends, raw, keys) -> None:
    receiver, sender = ends
    server = CurveServerConfig(
        secret_key_file=keys["server_secret"], authorized_keys_dir=keys["authorized"]
    )
    r = receiver(curve=server, heartbeat_timeout=30.0)

    def client(secret: str) -> CurveClientConfig:
        return CurveClientConfig(
            secret_key_file=keys[secret], server_public_key_file=keys["server_public"]
        )

    stranger = sender(r, curve=client("stranger_secret"), close_timeout=0.2)
    plain = sender(r, close_timeout=0.2)
    intruder = raw(r.endpoint)  # no CURVE at all, pushing a frame blindly
    intruder.send_blindly(frame(type="ref", receiver="x" * 32, line=1, ref=ref("raw").to_dict()))
    for refused in (stranger, plain):
        with pytest.raises(BackpressureError):  # no credit ever reaches them
            refused.send(ref("intruder"), timeout=0.5)
    with pytest.raises(StreamIdleError):  # and none of their frames arrive
        r.receive(1, timeout=0.3)
    trusted = sender(r, curve=client("producer_secret"))
    trusted.send(ref("trusted"))
    assert [x.sample_id for x in r.receive(5, timeout=5)] == ["s-trusted"]
    assert r.stats().received == 1 and r.stats().bad_frames == 0


def test_curve_key_files_are_checked(keys, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="secret"):
        CurveServerConfig(secret_key_file=keys["server_public"], authorized_keys_dir=tmp_path)
    with pytest.raises(ValueError, match="certificate"):
        CurveClientConfig(
            secret_key_file=tmp_path / "missing", server_public_key_file=keys["server_public"]
        )


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=8), st.integers(0, 500))
def test_free_credit_goes_to_the_least_credited_first(levels: list[int], amount: int) -> None:
    shares = water_fill(levels, amount)
    assert sum(shares) == amount and min(shares) >= 0
    final = [level + share for level, share in zip(levels, shares, strict=True)]
    raised = [f for f, share in zip(final, shares, strict=True) if share]
    assert not raised or max(raised) <= min(final) + 1
