"""ZmqRefSender: a producer's end of a ZeroMQ ref stream; one DEALER per consumer rank.

A ref goes to exactly one consumer: the one with the most unused credit. The
sender never sends a ref without credit, so it blocks (and finally raises
BackpressureError) while every consumer's window is full.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from dataflow.interfaces._stream import RefSender
from dataflow.model._errors import (
    ArgumentTypeError,
    BackpressureError,
    BadFrameError,
    InvalidArgumentError,
    StreamError,
)
from dataflow.model._refs import SampleRef
from dataflow.streams._security import CurveClientConfig, secure_client
from dataflow.streams._ticker import Ticker
from dataflow.streams._window import check_count, check_timeout
from dataflow.streams._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    CreditFrame,
    EofAckFrame,
    EofFrame,
    Frame,
    HeartbeatFrame,
    check_ref,
    checked_bodies,
    decode,
    encode,
    encode_ref,
    encode_refs,
    frame_fit,
    ref_bodies,
)

log = logging.getLogger("dataflow.streams")

_CONNECTED = zmq.EVENT_HANDSHAKE_SUCCEEDED
_NOBLOCK = int(zmq.NOBLOCK)  # pyzmq converts an enum member on every call


def _default_producer_id() -> str:
    return f"producer-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, kw_only=True)
class SenderConfig:
    """Where a producer's sender connects and how long it waits for credit."""

    endpoints: tuple[str, ...]
    """Every consumer rank's receiver endpoint (``ZmqRefReceiver.endpoint``)."""
    producer_id: str | None = None
    """The producer this sender speaks for, stable across restarts: a restart replaces the old
    session. None (the default): the ``Producer`` given this sender as its ``stream`` names it
    (its ``producer_id``), and a sender used on its own takes a random one at its first send.
    Set, it must be the Producer's: a mismatch raises InvalidArgumentError."""
    send_timeout: float = 30.0
    """``send`` raises BackpressureError when no consumer granted credit for this long."""
    close_timeout: float = 5.0
    """``close`` waits this long for every consumer to acknowledge the EOF."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats to each consumer."""
    heartbeat_timeout: float = 10.0
    """A consumer silent for this long gets no refs until it is heard again."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """A ref whose frame would be larger raises BadFrameError (keep equal to the receivers')."""
    send_hwm: int = 1024
    """ZeroMQ send high-water mark per consumer: a second bound behind the credit."""
    curve: CurveClientConfig | None = None
    """CURVE keys; required when the receivers use CURVE."""

    def __post_init__(self) -> None:
        endpoints = self.endpoints
        if isinstance(endpoints, str):
            raise InvalidArgumentError(
                f"endpoints must be a list of endpoints, got the str {endpoints!r}"
            )
        endpoints = tuple(endpoints)
        if not endpoints or not all(isinstance(e, str) and "://" in e for e in endpoints):
            raise InvalidArgumentError(
                f"endpoints must be 'tcp://host:port' strings, got {endpoints!r}"
            )
        if len(set(endpoints)) != len(endpoints):
            raise InvalidArgumentError(f"endpoints repeat: {endpoints!r}")
        object.__setattr__(self, "endpoints", endpoints)
        if self.producer_id is not None and (
            not isinstance(self.producer_id, str) or not 0 < len(self.producer_id) <= 256
        ):
            raise InvalidArgumentError(
                f"producer_id must be a str of 1-256 characters: {self.producer_id!r}"
            )
        for name in ("send_timeout", "close_timeout", "heartbeat_interval", "heartbeat_timeout"):
            check_timeout(name, getattr(self, name))
        if self.heartbeat_interval <= 0:
            raise InvalidArgumentError("heartbeat_interval must be positive")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise InvalidArgumentError("heartbeat_timeout must exceed two heartbeat intervals")
        check_count("max_frame_bytes", self.max_frame_bytes, minimum=256)
        check_count("send_hwm", self.send_hwm, minimum=1)
        if self.curve is not None and not isinstance(self.curve, CurveClientConfig):
            raise InvalidArgumentError(
                f"curve must be a CurveClientConfig, got {type(self.curve).__name__}"
            )


@dataclass(frozen=True)
class SenderStats:
    """Counters of one sender since it started."""

    sent: int
    """Refs handed to ZeroMQ, each to one consumer."""
    waited: int
    """Sends that found no credit at first and had to wait for it."""
    backpressure_errors: int
    """Sends that gave up with BackpressureError."""
    bad_frames: int
    """Frames from consumers dropped as bad."""


@dataclass
class _Link:
    """The connection to one consumer rank and the credit its receiver granted us."""

    endpoint: str
    sock: zmq.Socket
    receiver: str | None = None
    line: int = -1
    granted: int = 0
    sent: int = 0
    monitor: zmq.Socket | None = None
    last_heard: float = -math.inf
    usable: bool = False
    hello_due: bool = False
    eof_acked: bool = False

    def heard(self, now: float, timeout: float) -> bool:
        """Connected, and its receiver spoke within ``timeout`` seconds."""
        return self.usable and now - self.last_heard <= timeout

    def available(self, now: float, timeout: float) -> int:
        return self.granted - self.sent if self.heard(now, timeout) else 0


class ZmqRefSender(RefSender):
    """Sends refs to consumer ranks' ZmqRefReceivers, each ref to exactly one of them."""

    def __init__(self, config: SenderConfig) -> None:
        if not isinstance(config, SenderConfig):
            raise ArgumentTypeError(f"config must be a SenderConfig, got {type(config).__name__}")
        self.config = cfg = config
        #: None until a Producer names it (``bind_producer``) or the first send or close:
        #: until then this sender says nothing, so no receiver counts a producer by another id.
        self.producer_id: str | None = cfg.producer_id
        #: This sender's session id: its ZeroMQ routing id on every connection.
        self.session = uuid.uuid4().hex
        self._tick = cfg.heartbeat_interval / 2
        self._next_beat = 0.0
        self._rr = 0
        self._counts = {"sent": 0, "waited": 0, "backpressure_errors": 0, "bad_frames": 0}
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False
        #: The refs of the last ``check_many`` and their bodies, for a send of those refs.
        self._checked: tuple[list[SampleRef], list[bytes]] | None = None
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._links: list[_Link] = []
        self._by_sock: dict[zmq.Socket, _Link] = {}
        try:
            for endpoint in cfg.endpoints:
                self._links.append(self._connect(endpoint))
        except zmq.ZMQError as exc:
            self._shutdown(linger=0)
            raise StreamError(f"cannot connect a ref sender: {exc}") from exc
        self._ticker = Ticker(
            f"dataflow-sender[{self.producer_id or self.session[:12]}]",
            self._tick,
            self._lock,
            lambda: self._pump(0),
        )

    def _connect(self, endpoint: str) -> _Link:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.routing_id = self.session.encode()
        # Queue nothing for a consumer that is not connected: a send to it
        # fails at once and the ref goes to another consumer.
        sock.immediate = 1
        sock.sndhwm = self.config.send_hwm
        if self.config.curve is not None:
            secure_client(sock, self.config.curve)
        link = _Link(endpoint, sock)
        # The connection events tell us when to introduce ourselves (so that a
        # restarted consumer grants credit at once, not after our next
        # heartbeat) and when a consumer went away (so its credit is void).
        # ZMQ_PROBE_ROUTER would do the first, but libzmq 4.3 does not send
        # the probe on ZMQ_IMMEDIATE sockets.
        link.monitor = sock.get_monitor_socket(_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        for polled in (sock, link.monitor):
            self._poller.register(polled, zmq.POLLIN)
            self._by_sock[polled] = link
        return link

    # -- RefSender -------------------------------------------------------------
    def bind_producer(self, producer_id: str) -> None:
        """Speak for ``producer_id`` (the Producer's); a config naming another is refused."""
        with self._lock:
            if self.producer_id is None:
                self.producer_id = producer_id
            elif self.producer_id != producer_id:
                raise InvalidArgumentError(
                    f"the stream's SenderConfig.producer_id {self.producer_id!r} is not the "
                    f"Producer's producer_id {producer_id!r}: leave SenderConfig.producer_id "
                    "out (the sender takes the Producer's) or make the two equal"
                )
            self._pump(0)  # introduce ourselves now, under the Producer's id

    def _speaker(self) -> str:
        """The producer id this sender speaks for, a random one if nobody named it."""
        if self.producer_id is None:
            self.producer_id = _default_producer_id()
        return self.producer_id

    def check(self, ref: SampleRef) -> None:
        """Raise BadFrameError if ``send`` would refuse ``ref``; sends nothing.

        The refusals: a frame over ``max_frame_bytes``, a ref beyond the wire's
        limits or not JSON-able, a tensor hidden in it (kind ``tensor``).
        """
        check_ref(ref, self.config.max_frame_bytes)

    def check_many(self, refs: Sequence[SampleRef]) -> None:
        """``check`` of each of ``refs`` (the first refused raises), in one pass.

        A producer checks the refs it commits before committing them, then sends them:
        the bodies encoded here go out with the next ``send_many`` of these very refs
        (the same objects, in the same order), which encodes nothing again.
        """
        refs = list(refs)
        self._checked = None
        self._checked = (refs, checked_bodies(refs, self.config.max_frame_bytes))

    def _checked_bodies(self, refs: Sequence[SampleRef]) -> list[bytes] | None:
        """The bodies ``check_many`` encoded for exactly ``refs``, once; else None."""
        checked, self._checked = self._checked, None
        if checked is None or len(checked[0]) != len(refs):
            return None
        if not all(map(operator.is_, checked[0], refs)):
            return None
        return checked[1]

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        self._send_bodies(ref_bodies([ref], self.config.max_frame_bytes), timeout)

    def send_many(self, refs: Sequence[SampleRef], *, timeout: float | None = None) -> None:
        """Send ``refs`` in order, as few frames as the window allows; as ``send`` for each.

        Each frame goes to the consumer with the most unused credit and carries as
        many refs as that credit and ``max_frame_bytes`` allow (one ``refs`` frame,
        credited per ref). Every ref is checked before any is sent: a ref ``send``
        would refuse raises its error, naming it, and nothing is sent. Each ref
        waits up to ``timeout`` for credit; a BackpressureError after some refs
        went has ``sent``, the count of those (the first ones).
        """
        if isinstance(refs, SampleRef) or not isinstance(refs, Sequence):
            raise ArgumentTypeError(
                f"send_many takes a sequence of SampleRefs, got {type(refs).__name__}"
            )
        bodies = self._checked_bodies(refs)
        if bodies is None:
            bodies = ref_bodies(refs, self.config.max_frame_bytes)
        if bodies:  # none: nothing to say (not even to name a producer id, see _speaker)
            self._send_bodies(bodies, timeout)

    def _send_bodies(self, bodies: list[bytes], timeout: float | None) -> None:
        if timeout is None:
            timeout = self.config.send_timeout
        else:
            check_timeout("timeout", timeout)
        deadline = time.monotonic() + timeout
        waited = False
        done, total = 0, len(bodies)
        with self._lock:
            self._check_open()
            if self.producer_id is None:
                self._speaker()
            while done < total:
                now = time.monotonic()
                if now >= self._next_beat:
                    self._pump(0)
                link, credit = self._pick(now)
                if link is None:
                    self._pump(0)
                    link, credit = self._pick(now)
                if link is not None:
                    if total == 1:
                        count, frame = 1, encode_ref(link.receiver, link.line, bodies[0])  # type: ignore[arg-type]
                    else:
                        count = frame_fit(bodies, done, credit, self.config.max_frame_bytes)
                        chunk = bodies[done : done + count]
                        frame = encode_refs(link.receiver, link.line, chunk)  # type: ignore[arg-type]
                    try:
                        link.sock.send(frame, _NOBLOCK)
                    except zmq.Again:  # disconnected, or its pipe is full: try another
                        link.usable = False
                        continue
                    link.sent += count
                    self._counts["sent"] += count
                    done += count
                    deadline = now + timeout  # each ref waits up to timeout for credit
                    continue
                remaining = deadline - now
                if remaining <= 0:
                    self._counts["backpressure_errors"] += 1
                    error = BackpressureError(
                        f"producer {self.producer_id!r} got no credit within {timeout:g}s: "
                        f"every consumer window is full or no consumer is reachable "
                        f"({self._describe()})"
                        + (f"; {done} of the {total} refs were sent" if total > 1 else "")
                    )
                    error.sent = done  # type: ignore[attr-defined]
                    raise error
                if not waited:
                    waited = True
                    self._counts["waited"] += 1
                self._pump(min(remaining, self._tick))
                # Let other threads in between slices; a close() meanwhile
                # ends this send, for nothing may follow the EOF.
                self._lock.release()
                time.sleep(0)
                self._lock.acquire()
                self._check_open()

    def close(self) -> None:
        """Send EOF to every consumer and wait (``close_timeout``) for their acknowledgements."""
        with self._lock:
            if self._closing:
                return
            self._speaker()
            self._closing = True
            self._send_eofs()
        deadline = time.monotonic() + self.config.close_timeout
        while True:
            with self._lock:
                missing = [link.endpoint for link in self._links if not link.eof_acked]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    break
                self._pump(min(remaining, self._tick))
        if missing:
            log.warning(
                "producer %r closed its stream without an EOF acknowledgement from %s; "
                "those consumers learn of the close from the ledger",
                self.producer_id,
                missing,
            )
        self._shutdown(linger=0 if not missing else 1000)

    # -- extras ----------------------------------------------------------------
    def wait_for_consumers(self, timeout: float | None = None) -> None:
        """Block until the consumer at every endpoint has granted this sender credit.

        A ref goes to the consumer with the most unused credit among those heard, so
        refs sent before a slower rank's receiver answered all go to the others. Call
        this before the first send to spread the first refs over every rank. Raises
        BackpressureError, naming the endpoints not heard, after ``timeout`` seconds
        (default ``SenderConfig.send_timeout``). The sender must know its producer id
        (``SenderConfig.producer_id``, or a Producer given this sender), for a receiver
        grants credit to a producer it knows.
        """
        if timeout is None:
            timeout = self.config.send_timeout
        else:
            check_timeout("timeout", timeout)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._check_open()
                if self.producer_id is None:
                    raise InvalidArgumentError(
                        "this sender speaks for no producer yet, so no consumer grants it "
                        "credit: set SenderConfig.producer_id, or give the sender to a "
                        "Producer first"
                    )
                now = time.monotonic()
                timeout_s = self.config.heartbeat_timeout
                silent = [
                    link.endpoint
                    for link in self._links
                    if link.receiver is None or not link.heard(now, timeout_s)
                ]
                remaining = deadline - now
                if not silent:
                    return
                if remaining <= 0:
                    raise BackpressureError(
                        f"producer {self.producer_id!r} heard no consumer at {silent} within "
                        f"{timeout:g}s: start their receivers, or check the endpoints"
                    )
                self._pump(min(remaining, self._tick))
            time.sleep(0)  # let a send or close of another thread in between slices

    def stats(self) -> SenderStats:
        with self._lock:
            return SenderStats(**self._counts)

    def __enter__(self) -> ZmqRefSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ZmqRefSender({self.producer_id!r}, endpoints={list(self.config.endpoints)})"

    # -- the protocol ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closing:
            raise StreamError(f"{self!r} is closed")

    def _shutdown(self, *, linger: int) -> None:
        """Stop the ticker and release the sockets; without EOF this looks like a crash."""
        ticker = getattr(self, "_ticker", None)
        if ticker is not None:
            ticker.stop()
        with self._lock:
            self._closing = self._closed = True
            for link in self._links:
                if link.monitor is not None:
                    link.sock.disable_monitor()
                    link.monitor.close(linger=0)
                link.sock.close(linger=linger)
        self._ctx.term()

    def _pick(self, now: float) -> tuple[_Link | None, int]:
        """The link with the most unused credit, round-robin among equals, and that credit."""
        links = self._links
        if len(links) == 1:  # the usual: one consumer
            credit = links[0].available(now, self.config.heartbeat_timeout)
            return (links[0], credit) if credit > 0 else (None, 0)
        best, best_credit = None, 0
        n = len(links)
        for i in range(n):
            link = links[(self._rr + i) % n]
            credit = link.available(now, self.config.heartbeat_timeout)
            if credit > best_credit:
                best, best_credit = link, credit
        if best is not None:
            self._rr = (links.index(best) + 1) % n
        return best, best_credit

    def _pump(self, wait: float) -> None:
        """Handle consumers' frames (waiting up to ``wait`` s), then the timed duties."""
        if self._closed:
            return
        if self.producer_id is None:  # nobody named it yet: say nothing (see producer_id)
            return
        for sock, _ in self._poller.poll(math.ceil(wait * 1000) if wait > 0 else 0):
            link = self._by_sock[sock]
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock is link.monitor:
                    self._on_connection_event(link, parts)
                else:
                    self._handle(link, parts)
        for link in self._links:
            if link.hello_due:
                self._introduce(link)
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval
            for link in self._links:
                self._send_control(link, HeartbeatFrame(self.producer_id))
            if self._closing:
                self._send_eofs()

    def _handle(self, link: _Link, parts: list[bytes]) -> None:
        try:
            frame = decode(parts, max_bytes=self.config.max_frame_bytes)
        except BadFrameError as exc:
            self._counts["bad_frames"] += 1
            log.warning("dropped a bad frame from consumer %s: %s", link.endpoint, exc)
            return
        if isinstance(frame, CreditFrame):
            if frame.receiver != link.receiver or frame.line != link.line:
                new_receiver = frame.receiver != link.receiver
                link.receiver, link.line, link.sent = frame.receiver, frame.line, 0
                link.granted = frame.granted
                if new_receiver:  # a consumer (re)started: introduce ourselves
                    link.eof_acked = False
                    self._introduce(link)
            else:
                link.granted = max(link.granted, frame.granted)
            link.last_heard = time.monotonic()
            link.usable = True
        elif isinstance(frame, EofAckFrame):
            # The ack can be the first word from a receiver: it saw our EOF
            # before it granted any credit, and then grants none.
            if frame.receiver != link.receiver:
                link.receiver, link.line, link.granted, link.sent = frame.receiver, -1, 0, 0
            link.eof_acked = True
        else:
            self._counts["bad_frames"] += 1
            log.warning("dropped a %s frame from consumer %s", type(frame).__name__, link.endpoint)

    def _on_connection_event(self, link: _Link, parts: list[bytes]) -> None:
        event = parse_monitor_message(parts)["event"]
        if event == _CONNECTED:
            link.hello_due = True
        elif event == zmq.EVENT_DISCONNECTED:
            link.usable = link.hello_due = False

    def _introduce(self, link: _Link) -> None:
        """A heartbeat (and the EOF when closing) on a fresh connection; retried until sent."""
        try:
            link.sock.send(encode(HeartbeatFrame(self.producer_id)), zmq.NOBLOCK)
        except zmq.Again:
            link.hello_due = True
            return
        link.hello_due = False
        if self._closing and not link.eof_acked:
            self._send_control(link, EofFrame(self.producer_id))

    def _send_eofs(self) -> None:
        for link in self._links:
            if not link.eof_acked:
                self._send_control(link, EofFrame(self.producer_id))

    def _send_control(self, link: _Link, frame: Frame) -> None:
        # Not connected now: control frames are repeated every heartbeat and on reconnection.
        with contextlib.suppress(zmq.Again):
            link.sock.send(encode(frame), zmq.NOBLOCK)

    def _describe(self) -> str:
        now = time.monotonic()
        return ", ".join(
            f"{link.endpoint}: "
            + (
                "never heard"
                if link.receiver is None
                else f"credit {link.available(now, self.config.heartbeat_timeout)}"
            )
            for link in self._links
        )
