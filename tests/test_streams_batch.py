"""send_many: refs in order, as few frames as the window allows, each ref credited on its own."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow import (
    ArgumentTypeError,
    BackpressureError,
    BadFrameError,
    Consumer,
    FeatureSpec,
    Ledger,
    Producer,
    SampleRef,
    TensorInRefError,
)
from dataflow.interfaces import RefSender
from dataflow.streams import MemoryStream, SenderConfig, ZmqRefSender
from dataflow.streams._wire import (
    BATCH_VERSION,
    CreditFrame,
    HeartbeatFrame,
    RefFrame,
    RefsFrame,
    decode,
    encode,
    encode_ref_body,
    encode_refs,
)
from stores import LocalFeatureStore
from tests import test_streams_zmq
from tests.test_streams_zmq import FAST, drain, eventually, ref

ends, raw = test_streams_zmq.ends, test_streams_zmq.raw  # its fixtures, here too

RECEIVER = "f" * 32


class FakeReceiver:
    """A consumer's ROUTER socket speaking our wire format by hand: it grants what it is
    told to and records every frame a sender sends it."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None
        self.frames: list[object] = []
        self.sizes: list[int] = []

    def grant(self, granted: int) -> None:
        """Cumulative credit ``granted`` on line 1, to the sender heard (waits for it)."""
        while self.peer is None:
            self.poll(10.0)
        data = encode(CreditFrame(RECEIVER, 1, granted))
        self.sock.send_multipart([self.peer, data])

    def poll(self, wait: float) -> bool:
        """Take in one message within ``wait`` seconds; whether one came."""
        if not self.sock.poll(int(wait * 1000)):
            return False
        rid, *parts = self.sock.recv_multipart()
        self.peer = rid
        frame = decode(parts)
        if not isinstance(frame, HeartbeatFrame):
            self.frames.append(frame)
            self.sizes.append(len(parts[0]))
        return True

    def refs(self, count: int, timeout: float = 10.0) -> list[str]:
        """Wait for ``count`` refs in all (RefFrame and RefsFrame), return their ids."""
        deadline = time.monotonic() + timeout
        while len(self.ids()) < count:
            assert time.monotonic() < deadline, f"got {self.ids()}, expected {count} refs"
            self.poll(0.05)
        return self.ids()

    def ids(self) -> list[str]:
        ids: list[str] = []
        for frame in self.frames:
            if isinstance(frame, RefFrame):
                ids.append(frame.ref.sample_id)
            elif isinstance(frame, RefsFrame):
                ids += [r.sample_id for r in frame.refs]
        return ids

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def fake() -> Iterator[FakeReceiver]:
    receiver = FakeReceiver()
    yield receiver
    receiver.close()


def fake_sender(fake: FakeReceiver, **kwargs: object) -> ZmqRefSender:
    # Credit comes once (the fake receiver sends no heartbeats): it must not lapse.
    config = {**FAST, "heartbeat_timeout": 60.0, "close_timeout": 0.1, "send_timeout": 10.0}
    config.update(kwargs)
    sender = ZmqRefSender(SenderConfig(endpoints=(fake.endpoint,), producer_id="p", **config))  # type: ignore[arg-type]
    sender.bind_producer("p")  # says hello now, so the fake receiver knows whom to credit
    return sender


def refs_of(count: int, prefix: str = "s") -> list[SampleRef]:
    return [ref(f"{prefix}{i}") for i in range(count)]


# -- the ZeroMQ sender --------------------------------------------------------------------
def test_a_batch_within_the_credit_goes_as_one_frame(fake) -> None:
    sender = fake_sender(fake)
    try:
        fake.grant(100)
        eventually(lambda: sender._links[0].granted == 100)  # the credit arrived
        sender.send_many(refs_of(64))
        assert fake.refs(64) == [f"s-s{i}" for i in range(64)]
        assert len(fake.frames) == 1 and isinstance(fake.frames[0], RefsFrame)
        assert sender.stats().sent == 64
    finally:
        sender.close()


def test_a_batch_larger_than_the_credit_waits_for_more(fake) -> None:
    sender = fake_sender(fake)
    try:
        fake.grant(10)
        eventually(lambda: sender._links[0].granted == 10)
        thread = threading.Thread(target=sender.send_many, args=(refs_of(64),))
        thread.start()
        assert fake.refs(10) == [f"s-s{i}" for i in range(10)]  # all the credit, one frame
        assert len(fake.frames) == 1
        fake.grant(64)
        assert fake.refs(64) == [f"s-s{i}" for i in range(64)]
        thread.join(10)
        assert [len(f.refs) for f in fake.frames] == [10, 54]  # type: ignore[attr-defined]
    finally:
        sender.close()


def test_a_batch_over_the_frame_size_is_split(fake) -> None:
    sender = fake_sender(fake, max_frame_bytes=4096)
    try:
        fake.grant(1000)
        eventually(lambda: sender._links[0].granted == 1000)
        refs = [ref(f"{i:04d}-" + "x" * 100) for i in range(200)]
        sender.send_many(refs)
        assert fake.refs(200) == [r.sample_id for r in refs]
        assert len(fake.frames) > 1 and max(fake.sizes) <= 4096
    finally:
        sender.close()


def test_a_ref_over_max_frame_bytes_is_refused_by_name_and_nothing_is_sent(fake) -> None:
    sender = fake_sender(fake, max_frame_bytes=1024)
    try:
        fake.grant(100)
        eventually(lambda: sender._links[0].granted == 100)
        big = SampleRef("the-big-one", "mem://test", 1, metadata={"blob": "x" * 2000})
        with pytest.raises(BadFrameError, match=r"'the-big-one'.*max_frame_bytes=1024") as info:
            sender.send_many([*refs_of(3), big, *refs_of(3, "t")])
        assert info.value.kind == "oversized"  # type: ignore[attr-defined]
        hidden = SampleRef("hides-a-tensor", "mem://test", 1)
        hidden.metadata["t"] = torch.ones(1)  # type: ignore[index]
        with pytest.raises(TensorInRefError):
            sender.send_many([ref("before"), hidden])
        sender.send_many([ref("marker")])  # frames keep their order: nothing came before it
        assert fake.refs(1) == ["s-marker"]
        assert sender.stats().sent == 1
    finally:
        sender.close()


def test_send_many_takes_a_sequence_of_refs(ends) -> None:
    receiver, sender = ends
    s = sender(receiver())
    with pytest.raises(ArgumentTypeError, match="sequence"):
        s.send_many(ref(0))  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="sequence"):
        s.send_many(r for r in refs_of(2))  # type: ignore[arg-type]
    s.send_many([])  # nothing to send, nothing sent


def test_send_many_through_a_real_receiver_keeps_order_and_the_window(ends) -> None:
    receiver, sender = ends
    r = receiver(window=16)
    s = sender(r, producer_id="p0")
    refs = refs_of(300)
    thread = threading.Thread(target=lambda: (s.send_many(refs), s.close()))
    thread.start()
    got = drain(r)
    thread.join(30)
    assert got == [x.sample_id for x in refs]
    stats = r.stats()
    assert stats.max_in_flight <= 16
    assert (stats.received, stats.credited, stats.bad_frames) == (300, 300, 0)


def test_backpressure_in_a_batch_says_how_many_went(ends) -> None:
    receiver, sender = ends
    r = receiver(window=4)
    s = sender(r, producer_id="p0")
    s.send(ref("first"), timeout=30)  # the credit has arrived
    with pytest.raises(BackpressureError, match="of the 10 refs were sent") as info:
        s.send_many(refs_of(10), timeout=0.5)
    sent = info.value.sent  # type: ignore[attr-defined]
    assert 0 <= sent <= 3
    got: list[str] = []
    while len(got) < 1 + sent:
        got += [x.sample_id for x in r.receive(10, timeout=10)]
    assert got == ["s-first"] + [f"s-s{i}" for i in range(sent)]


def test_the_consumer_leases_each_ref_once_and_credits_every_copy(ends) -> None:
    receiver, sender = ends
    with tempfile.TemporaryDirectory() as tmp:
        led = Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        store = LocalFeatureStore()
        r = receiver(window=8)
        cons = Consumer(led, store, run_id="r", consumer_id="rank0", stream=r)
        cons.resume()
        s = sender(r)
        prod = Producer(led, store, run_id="r", producer_id="p0", stream=s)
        committed = [prod.emit(f"s-{i}", {"x": torch.ones(2)}) for i in range(3)]
        s.send_many([committed[0], committed[0], committed[1]])  # repeated, as after a retry
        leased: list[str] = []
        while len(leased) < 3:
            refs = cons.lease(8, timeout=10)
            leased += [x.sample_id for x in refs]
            cons.ack(refs, step=len(leased))
        prod.close()
        while refs := cons.lease(8, timeout=10):
            leased += [x.sample_id for x in refs]
            cons.ack(refs, step=len(leased))
        assert sorted(leased) == ["s-0", "s-1", "s-2"]
        stats = r.stats()
        assert stats.received == 6 and stats.credited == 6 and stats.in_flight == 0
        led.close()


# -- bad refs frames -------------------------------------------------------------------------
def good_refs_frame(count: int = 3) -> dict:
    refs = [ref(i).to_dict() for i in range(count)]
    return {"v": BATCH_VERSION, "type": "refs", "receiver": RECEIVER, "line": 1, "refs": refs}


def kind_of(data: bytes) -> str:
    with pytest.raises(BadFrameError) as info:
        decode([data])
    return info.value.kind  # type: ignore[attr-defined]


def test_a_refs_frame_round_trips() -> None:
    frame = RefsFrame(RECEIVER, 7, tuple(refs_of(5)))
    assert decode([encode(frame)]) == frame
    data = json.dumps(good_refs_frame()).encode()
    assert decode([data]) == RefsFrame(RECEIVER, 1, tuple(ref(i) for i in range(3)))
    bodies = [encode_ref_body(x) for x in refs_of(2)]
    assert json.loads(encode_refs(RECEIVER, 2, bodies))["v"] == 2
    assert isinstance(decode([encode_refs(RECEIVER, 2, bodies[:1])]), RefFrame)


@pytest.mark.parametrize(
    ("change", "kind", "match"),
    [
        ({"refs": []}, "malformed", "1 or more"),
        ({"refs": {"a": 1}}, "malformed", "list"),
        ({"refs": None}, "malformed", "list"),
        ({"ref": []}, "malformed", "fields"),
        ({"line": -1}, "malformed", "line"),
        ({"v": 1}, "version", "refs frame is version 2"),
        ({"v": 3}, "version", "frame version 3; this receiver speaks 1 and 2"),
        ({"v": "2"}, "malformed", "version"),
    ],
)
def test_bad_refs_frames_are_classified(change: dict, kind: str, match: str) -> None:
    data = json.dumps({**good_refs_frame(), **change}).encode()
    with pytest.raises(BadFrameError, match=match) as info:
        decode([data])
    assert info.value.kind == kind  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "bad",
    [
        {"sample_id": "../etc"},
        {"generation": -1},
        {"generation": 2**63},
        {"store": ""},
        {"specs": {"x": {"shape": [2**62, 2**62], "dtype": "float32"}}},
        {"specs": {"x": {"shape": [1], "dtype": "tensor"}}},
        {"metadata": []},
        {"extra": 1},
    ],
)
def test_one_bad_ref_makes_the_whole_frame_malformed(bad: dict) -> None:
    frame = good_refs_frame()
    frame["refs"][1] = {**frame["refs"][1], **bad}
    assert kind_of(json.dumps(frame).encode()) == "malformed"


def test_a_version_2_frame_is_another_versions_to_a_v1_type() -> None:
    data = json.dumps({"v": 2, "type": "ref", "receiver": RECEIVER, "line": 1}).encode()
    assert kind_of(data) == "version"


def test_a_receiver_drops_a_malformed_refs_frame_whole(ends, raw) -> None:
    receiver, _ = ends
    r = receiver()
    peer = raw(r.endpoint)
    credit = peer.credit("p")
    frame = {**good_refs_frame(), "receiver": credit.receiver, "line": credit.line}
    frame["refs"][2]["sample_id"] = "/abs"
    peer.send(json.dumps(frame).encode())
    frame["refs"][2]["sample_id"] = "fine"
    peer.send(json.dumps({**frame, "v": 3}).encode())
    eventually(lambda: r.stats().bad_frames == 2)
    assert r.stats().bad_frame_kinds["malformed"] == 1
    assert r.stats().bad_frame_kinds["version"] == 1
    peer.send(json.dumps(frame).encode())
    got: list[str] = []
    while len(got) < 3:
        got += [x.sample_id for x in r.receive(8, timeout=10)]
    assert got == ["s-0", "s-1", "fine"] and r.stats().received == 3


def test_refs_beyond_the_credit_are_dropped_one_by_one(ends, raw) -> None:
    receiver, _ = ends
    r = receiver(window=8)
    peer = raw(r.endpoint)
    credit = peer.credit("p")
    assert credit.granted == 8
    frame = {**good_refs_frame(12), "receiver": credit.receiver, "line": credit.line}
    peer.send(json.dumps(frame).encode())
    got: list[str] = []
    while len(got) < 8:
        got += [x.sample_id for x in r.receive(16, timeout=10)]
    assert got == [f"s-{i}" for i in range(8)]
    eventually(lambda: r.stats().dropped_no_credit == 4)
    assert r.stats().received == 8


# -- MemoryStream and the default ---------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(
    window=st.integers(1, 40),
    batches=st.lists(st.integers(0, 60), max_size=6),
    ranks=st.integers(1, 3),
)
def test_memory_send_many_delivers_in_order_once_within_the_window(
    window: int, batches: list[int], ranks: int
) -> None:
    stream = MemoryStream(window=window, ranks=ranks, send_timeout=10)
    receivers = [stream.receiver(k) for k in range(ranks)]
    sender = stream.sender("p")
    got: list[list[str]] = [[] for _ in range(ranks)]
    done = threading.Event()

    def consume() -> None:
        while not done.is_set() or any(rx.stats().in_flight for rx in receivers):
            for k, rx in enumerate(receivers):
                if rx.stats().in_flight:
                    refs = rx.receive(64, timeout=1)
                    got[k] += [x.sample_id for x in refs]
                    rx.credit(len(refs))
            time.sleep(0.001)

    thread = threading.Thread(target=consume)
    thread.start()
    sent: list[str] = []
    for b, size in enumerate(batches):
        refs = refs_of(size, f"{b}-")
        sender.send_many(refs)
        sent += [x.sample_id for x in refs]
    done.set()
    thread.join(30)
    assert sorted(s for ids in got for s in ids) == sorted(sent)
    for ids in got:  # each rank sees its refs in the order they were sent
        assert ids == [s for s in sent if s in set(ids)]
    assert all(rx.stats().max_in_flight <= window for rx in receivers)


def test_memory_send_many_backpressure_says_how_many_went() -> None:
    stream = MemoryStream(window=4)
    stream.receiver(0)
    sender = stream.sender("p")
    with pytest.raises(BackpressureError, match="4 of the 10 refs were sent") as info:
        sender.send_many(refs_of(10), timeout=0)
    assert info.value.sent == 4  # type: ignore[attr-defined]


def test_memory_send_many_refuses_a_ref_the_wire_refuses_before_sending_any() -> None:
    stream = MemoryStream(window=8, max_frame_bytes=512)
    rx = stream.receiver(0)
    big = SampleRef("too-big", "mem://m", 0, metadata={"b": "x" * 600})
    with pytest.raises(BadFrameError, match="'too-big'"):
        stream.sender("p").send_many([ref(0), big])
    assert rx.stats().received == 0
    specs = {"x": FeatureSpec((2,), torch.float32)}
    many = [SampleRef(f"s-{i:03d}", "mem://m", 0, specs=specs) for i in range(8)]
    stream.sender("p").send_many(many)  # over 512 bytes together: split, all delivered
    assert [x.sample_id for x in rx.receive(8, timeout=1)] == [x.sample_id for x in many]


def test_the_default_send_many_sends_each_ref() -> None:
    class Recording(RefSender):
        def __init__(self) -> None:
            self.sent: list[tuple[str, float | None]] = []

        def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
            self.sent.append((ref.sample_id, timeout))

        def close(self) -> None:
            pass

    sender = Recording()
    sender.send_many(refs_of(3), timeout=2.0)
    assert sender.sent == [("s-s0", 2.0), ("s-s1", 2.0), ("s-s2", 2.0)]
