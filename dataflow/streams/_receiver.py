"""ZmqRefReceiver: a consumer rank's end of a ZeroMQ ref stream; it binds a ROUTER socket.

The receiver grants credit to each producer session it knows and accepts a ref
only against credit, so that refs received and not yet credited, plus credit
granted and not yet used, never exceed the window. Whatever else arrives is
dropped and counted (docs/streams.md, "What a receiver does with hostile frames").
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import zmq

from dataflow.interfaces._stream import RefReceiver
from dataflow.model._errors import (
    ArgumentTypeError,
    BadFrameError,
    InvalidArgumentError,
    StreamError,
)
from dataflow.model._refs import SampleRef
from dataflow.streams._security import (
    DEFAULT_ENDPOINT,
    CurveServerConfig,
    bind_address,
    secure_server,
    warn_if_exposed,
)
from dataflow.streams._ticker import Ticker
from dataflow.streams._window import ReceiverStats, Window, check_count, check_timeout
from dataflow.streams._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MALFORMED,
    CreditFrame,
    EofAckFrame,
    EofFrame,
    Frame,
    HeartbeatFrame,
    RefFrame,
    RefsFrame,
    decode,
    encode,
)

log = logging.getLogger("dataflow.streams")

# Frames beyond the window a producer's pipe may hold (heartbeats, EOF) before
# ZeroMQ stops reading from that producer: the second bound after credit.
_CONTROL_SLACK = 256
_DRAIN = 4096
# A frame up to this many times max_frame_bytes is read and counted as
# oversized; ZeroMQ disconnects a peer that sends a larger one before reading
# it (ZMQ_MAXMSGSIZE), so that no frame can make a receiver allocate much.
_READ_LIMIT = 2
# pyzmq converts enum members on every call
_NOBLOCK, _RCVMORE, _EVENTS, _POLLIN = map(int, (zmq.NOBLOCK, zmq.RCVMORE, zmq.EVENTS, zmq.POLLIN))


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """How a consumer rank's receiver listens and bounds its in-flight work."""

    endpoint: str = DEFAULT_ENDPOINT
    """Where to bind. Loopback on a free port by default; read the port from ``.endpoint``."""
    window: int = 64
    """Most refs in flight: received and not yet credited, plus credit granted and unused."""
    expected_producers: int = 1
    """Distinct producer ids that must close (EOF) before the stream ends."""
    idle_timeout: float = 60.0
    """``receive`` raises StreamIdleError when no ref came for this long (default timeout)."""
    heartbeat_interval: float = 0.5
    """Seconds between credit frames to each producer (they double as heartbeats)."""
    heartbeat_timeout: float = 10.0
    """A producer silent for this long without closing is lost (ProducerLostError)."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Larger frames are counted as bad (``oversized``) and dropped."""
    curve: CurveServerConfig | None = None
    """CURVE keys; None means plain text (keep it on loopback then)."""

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise InvalidArgumentError(
                f"endpoint must look like 'tcp://127.0.0.1:0', got {self.endpoint!r}"
            )
        check_count("window", self.window, minimum=1)
        check_count("expected_producers", self.expected_producers, minimum=1)
        check_count("max_frame_bytes", self.max_frame_bytes, minimum=256)
        for name in ("idle_timeout", "heartbeat_interval", "heartbeat_timeout"):
            check_timeout(name, getattr(self, name))
        if self.heartbeat_interval <= 0:
            raise InvalidArgumentError("heartbeat_interval must be positive")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise InvalidArgumentError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed two heartbeat "
                f"intervals ({self.heartbeat_interval}), or a live producer looks lost"
            )
        if self.curve is not None and not isinstance(self.curve, CurveServerConfig):
            raise InvalidArgumentError(
                f"curve must be a CurveServerConfig, got {type(self.curve).__name__}"
            )


_LIVE, _CLOSED, _LOST, _REPLACED = "live", "closed", "lost", "replaced"


@dataclass
class _Session:
    """One producer session (a sender's lifetime, one ZeroMQ routing id) as this receiver
    sees it.

    Credit is cumulative per line: ``granted`` only grows, so a lost or
    repeated credit frame does no harm. A new line starts when the session
    (re)appears; refs sent against an older line are dropped.

    ``producer_id`` is the producer the session named first; it speaks for
    that producer only while ``bound`` (see ``ZmqRefReceiver._speaks_for``),
    and only bound sessions get credit.
    """

    line: int
    last_heard: float
    producer_id: str | None = None
    bound: bool = False
    state: str = _LIVE
    granted: int = 0
    received: int = 0
    announced: int = -1
    delivered: bool = False
    """A ref arrived on credit: the producer is real, not just a name in a heartbeat."""
    reopens: bool = False
    """Bound to a producer that had closed: its first ref reopens that producer."""
    gone: bool = False
    """ZeroMQ no longer routes to this session: its connection closed."""
    probed: float = -math.inf
    """When ``_gone`` last asked ZeroMQ about this session."""

    @property
    def outstanding(self) -> int:
        return self.granted - self.received if self.state == _LIVE else 0

    def end(self, state: str) -> None:
        """Stop the session; its unused credit returns to the window."""
        self.granted = self.received
        self.state = state


class ZmqRefReceiver(RefReceiver):
    """Receives refs for one consumer rank from every producer's ZmqRefSender.

    Use one per rank, each on its own endpoint, and give every sender all the
    endpoints. A restarted consumer binds the same endpoint again; producers
    reconnect on their own and the new receiver grants them fresh credit.
    """

    def __init__(self, config: ReceiverConfig | None = None) -> None:
        self.config = cfg = ReceiverConfig() if config is None else config
        if not isinstance(cfg, ReceiverConfig):
            raise ArgumentTypeError(f"config must be a ReceiverConfig, got {type(cfg).__name__}")
        self.session = uuid.uuid4().hex
        self._window = Window(cfg.window, cfg.expected_producers)
        self._sessions: dict[bytes, _Session] = {}
        self._owners: dict[str, bytes] = {}  # producer id -> routing id of its bound session
        self._known: set[str] = set()  # producers that delivered a ref on credit
        self._lines = itertools.count(1)
        self._grant_chunk = max(1, cfg.window // 8)
        self._tick = cfg.heartbeat_interval / 2
        self._next_beat = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._ctx = zmq.Context()
        self._auth = None
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.linger = 0
            sock.router_handover = 1
            # A send to a connection that closed raises EHOSTUNREACH instead of
            # vanishing: how a restarted producer's old session is known to be gone.
            sock.router_mandatory = 1
            sock.rcvhwm = cfg.window + _CONTROL_SLACK
            sock.maxmsgsize = min(_READ_LIMIT * cfg.max_frame_bytes, (1 << 63) - 1)
            if cfg.curve is not None:
                self._auth = secure_server(self._ctx, sock, cfg.curve)
            warn_if_exposed(cfg.endpoint, cfg.curve)
            sock.bind(bind_address(cfg.endpoint))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._stop_context()
            raise StreamError(f"cannot bind a ref receiver to {cfg.endpoint}: {exc}") from exc
        self._sock = sock
        #: The bound address, with the actual port (``tcp://127.0.0.1:41437``).
        self.endpoint: str = sock.last_endpoint.decode()
        self._warnings = _PeerWarnings(f"ref receiver {self.endpoint}")
        self._ticker = Ticker(
            f"dataflow-receiver[{self.endpoint}]", self._tick, self._lock, lambda: self._pump(0)
        )

    # -- RefReceiver -----------------------------------------------------------
    def receive(self, max_refs: int, *, timeout: float | None = None) -> list[SampleRef]:
        check_timeout("timeout", timeout, allow_none=True)
        timeout = self.config.idle_timeout if timeout is None else timeout
        with self._lock:
            self._check_open()
            self._pump(0)
            return self._window.next_batch(max_refs, timeout, self._wait)

    def credit(self, count: int) -> None:
        with self._lock:
            self._check_open()
            self._window.credit(count)
            self._grant(force=False)

    @property
    def exhausted(self) -> bool:
        with self._lock:
            return self._window.exhausted

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._ticker.stop()
        self._sock.close(linger=0)
        self._stop_context()

    # -- extras ----------------------------------------------------------------
    def mark_producer_closed(self, producer_id: str) -> None:
        """Count ``producer_id`` as closed though its EOF never reached this receiver.

        For a consumer restarted after a producer closed: the Consumer marks every
        producer whose close the ledger holds when it joins an epoch, so the stream
        can still end.
        """
        with self._lock:
            self._window.mark_closed(producer_id)

    def mark_producer_closed_if_silent(self, producer_id: str) -> bool:
        """Count ``producer_id`` as closed unless one of this receiver's live sessions
        names it (see ``RefReceiver.mark_producer_closed_if_silent``)."""
        with self._lock:
            if producer_id in self._window.closed:
                return True
            if self._has_live_session(producer_id):
                return False
            self._window.mark_closed(producer_id)
            return True

    def stats(self) -> ReceiverStats:
        with self._lock:
            return self._window.stats()

    def __enter__(self) -> ZmqRefReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ZmqRefReceiver({self.endpoint!r}, window={self.config.window})"

    # -- the protocol ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StreamError(f"{self!r} is closed")

    def _stop_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _wait(self, remaining: float) -> None:
        self._pump(min(remaining, self._tick))
        # Let other threads in between slices (stats(), exhausted): receive
        # holds the lock for its whole wait otherwise.
        self._lock.release()
        time.sleep(0)
        self._lock.acquire()
        self._check_open()

    def _pump(self, wait: float) -> None:
        """Handle what arrived (waiting up to ``wait`` s for it), then the timed duties."""
        if self._closed:
            return
        if wait <= 0 or self._sock.poll(math.ceil(wait * 1000)):
            # recv_multipart without its sugar, and ending where ZMQ_EVENTS says no message
            # waits (so recv cannot raise zmq.Again, which costs more than a message).
            recv, get = self._sock.recv, self._sock.get
            for _ in range(_DRAIN):
                if not get(_EVENTS) & _POLLIN:
                    break
                parts = [recv(_NOBLOCK), recv(_NOBLOCK)]  # a ROUTER's: routing id, 1+ parts
                while get(_RCVMORE):
                    parts.append(recv(_NOBLOCK))
                self._handle(parts)
        now = time.monotonic()
        beat = now >= self._next_beat
        if beat:
            self._next_beat = now + self.config.heartbeat_interval
            self._check_liveness(now)
        self._grant(force=beat)

    def _handle(self, parts: list[bytes]) -> None:
        rid, body = parts[0], parts[1:]
        if body == [b""]:  # ZMQ_PROBE_ROUTER: a producer (re)connected
            self._session(rid)
            return
        try:
            frame: Frame = decode(body, max_bytes=self.config.max_frame_bytes, lazy=True)
        except BadFrameError as exc:
            kind = exc.kind  # type: ignore[attr-defined]
            self._window.count_bad(kind)
            self._warnings.warn(rid, kind, "dropped a bad frame from %s (%s): %s", kind, exc)
            return
        session = self._session(rid)
        if type(frame) is RefFrame:
            self._on_ref(rid, session, frame)
        elif isinstance(frame, RefsFrame):
            self._on_refs(rid, session, frame)
        elif isinstance(frame, HeartbeatFrame):
            self._speaks_for(rid, session, frame.producer)
        elif isinstance(frame, EofFrame):
            if self._speaks_for(rid, session, frame.producer):
                self._on_eof(rid, session)
        else:
            self._window.count_bad(MALFORMED)
            self._warnings.warn(
                rid,
                MALFORMED,
                "dropped a frame from %s: %s frames are for producers",
                type(frame).__name__,
            )

    def _session(self, rid: bytes) -> _Session:
        now = time.monotonic()
        session = self._sessions.get(rid)
        if session is None:
            session = self._sessions[rid] = _Session(line=next(self._lines), last_heard=now)
        elif session.state in (_LOST, _REPLACED):
            log.info("producer %s is back on %s", session.producer_id or _name(rid), self.endpoint)
            session.state = _LIVE
            session.line = next(self._lines)
            session.granted = session.received = 0
            session.announced = -1
        session.last_heard = now
        session.gone = False
        return session

    def _speaks_for(self, rid: bytes, session: _Session, producer_id: str) -> bool:
        """Whether session ``rid`` may speak for ``producer_id``; binds the two if it may.

        A producer belongs to one session at a time: the first to name it,
        until that session closed (EOF), was lost (silent for heartbeat_timeout)
        or is gone (its connection closed, which is how a killed producer's
        session ends at once). Until then, a heartbeat or EOF for it from
        another session, a forger's or a restart's that came too early, is
        dropped and counted; a restart takes over when the old session ends.
        """
        if session.producer_id is None:
            session.producer_id = producer_id
        elif session.producer_id != producer_id:
            self._window.count_bad(MALFORMED)
            self._warnings.warn(
                rid,
                "renamed",
                "dropped a frame from %s: it spoke for %r, now for %r",
                session.producer_id,
                producer_id,
            )
            return False
        if session.bound:
            return True
        owner = self._owners.get(producer_id, b"")  # b"" is no routing id
        held = self._sessions.get(owner)
        if held is not None and held.state == _LIVE and not self._gone(owner, held):
            self._window.count("dropped_foreign_connection")
            self._warnings.warn(
                rid,
                "foreign",
                "dropped a frame from %s for producer %r: it speaks on another connection",
                producer_id,
            )
            return False
        if held is not None:
            held.bound = False
            if held.state == _LIVE:
                log.info("producer %r restarted; reclaiming its old session's credit", producer_id)
                held.end(_REPLACED)
        session.bound = True
        session.reopens = producer_id in self._window.closed
        self._owners[producer_id] = rid
        return True

    def _has_live_session(self, producer_id: str | None) -> bool:
        sessions = self._sessions.values()
        return any(s.state == _LIVE and s.producer_id == producer_id for s in sessions)

    def _gone(self, rid: bytes, session: _Session) -> bool:
        """Whether ZeroMQ no longer routes to ``rid``; asks with its credit, once a tick."""
        now = time.monotonic()
        if not session.gone and now - session.probed >= self._tick:
            session.probed = now
            self._send(rid, CreditFrame(self.session, session.line, session.granted))
        return session.gone

    def _on_ref(self, rid: bytes, session: _Session, frame: RefFrame) -> None:
        if (
            session.received < session.granted  # only bound, live sessions get credit
            and frame.line == session.line
            and frame.receiver == self.session
            and session.state == _LIVE
        ):
            session.received += 1
            self._window.accept(frame.ref)
            if not session.delivered:
                self._first_ref(session)
            return
        self._on_refs(rid, session, frame)  # where it is dropped

    def _on_refs(self, rid: bytes, session: _Session, frame: RefFrame | RefsFrame) -> None:
        """Refs of one frame, in order: each takes one credit; those beyond it are dropped."""
        refs = frame.refs if isinstance(frame, RefsFrame) else (frame.ref,)
        receiver, line = frame.receiver, frame.line
        credit = 0
        if line == session.line and receiver == self.session and session.state == _LIVE:
            credit = session.granted - session.received  # only bound, live sessions get credit
        taken = refs if len(refs) <= credit else refs[: max(credit, 0)]
        if taken:
            session.received += len(taken)
            self._window.accept_many(taken)
            if not session.delivered:
                self._first_ref(session)
        if len(taken) == len(refs):
            return
        self._window.drop(len(refs) - len(taken))
        self._warnings.warn(
            rid,
            "no credit",
            "dropped a ref from %s: %r came without credit "
            "(if it was committed, the ledger still holds it)",
            refs[len(taken)].sample_id,
        )

    def _first_ref(self, session: _Session) -> None:
        """The session's first ref on credit: its producer is known to be real from now on."""
        producer_id: str = session.producer_id  # type: ignore[assignment]  # bound: named
        session.delivered = True
        if session.reopens:  # it was closed, now it emits again
            session.reopens = False
            self._window.closed.discard(producer_id)
        if producer_id in self._known:
            return
        self._known.add(producer_id)
        if len(self._known) == self.config.expected_producers + 1:
            log.warning(
                "%s has seen %d producer ids but expects %d: the stream may end early",
                self,
                len(self._known),
                self.config.expected_producers,
            )

    def _on_eof(self, rid: bytes, session: _Session) -> None:
        if session.state != _CLOSED:
            session.end(_CLOSED)
            self._window.mark_closed(session.producer_id)  # type: ignore[arg-type]
        self._send(rid, EofAckFrame(self.session))

    def _check_liveness(self, now: float) -> None:
        for rid, session in list(self._sessions.items()):
            if session.state != _LIVE or now - session.last_heard <= self.config.heartbeat_timeout:
                continue
            session.end(_LOST)
            producer_id = session.producer_id
            if not session.bound:
                del self._sessions[rid]  # it never spoke for a producer: nothing to report
                continue
            if producer_id not in self._known:
                # A name in heartbeats, never a ref: anyone can send those, so
                # its silence is no producer's loss.
                del self._sessions[rid]
                del self._owners[producer_id]  # type: ignore[arg-type]
                self._window.count("dropped_unknown_producer")
                self._warnings.warn(
                    rid,
                    "unknown",
                    "forgot %s and the producer %r it named: it went silent before it "
                    "delivered any ref",
                    producer_id,
                )
                continue
            if producer_id in self._window.closed or self._has_live_session(producer_id):
                continue
            log.warning(
                "producer %r on %s sent nothing for %.1fs and did not close: lost",
                producer_id,
                self.endpoint,
                now - session.last_heard,
            )
            self._window.mark_lost(producer_id)  # type: ignore[arg-type]

    def _outstanding(self) -> int:
        return sum(s.outstanding for s in self._sessions.values())

    def _grant(self, *, force: bool) -> None:
        """Hand free window slots to live sessions, the least-credited first."""
        live = [(rid, s) for rid, s in self._sessions.items() if s.state == _LIVE and s.bound]
        if not live:
            return
        free = self._window.size - self._window.in_flight - self._outstanding()
        starving = any(s.outstanding == 0 for _, s in live)
        if free > 0 and (force or starving or free >= self._grant_chunk):
            shares = water_fill([s.outstanding for _, s in live], free)
            for (_, s), share in zip(live, shares, strict=True):
                s.granted += share
        for rid, s in live:
            if force or s.granted != s.announced:
                self._send(rid, CreditFrame(self.session, s.line, s.granted))
                s.announced = s.granted

    def _send(self, rid: bytes, frame: Frame) -> None:
        try:
            self._sock.send_multipart([rid, encode(frame)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # its pipe is full; credit is cumulative and repeated every heartbeat
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            session = self._sessions.get(rid)
            if session is not None:
                session.gone = True


class _PeerWarnings:
    """Warnings about what peers send: once per peer and kind, at most ``burst`` a minute.

    Every dropped frame is counted in the stats; the log gets the first of
    each kind from each peer, so that a hostile or broken peer cannot flood it.
    """

    def __init__(
        self, where: str, *, burst: int = 20, period: float = 60.0, remember: int = 4096
    ) -> None:
        self._where = where
        self._burst, self._period, self._remember = burst, period, remember
        self._said: set[tuple[bytes, str]] = set()
        self._times: deque[float] = deque()
        self._suppressed = 0

    def warn(self, rid: bytes, kind: str, message: str, *args: object) -> None:
        """Log ``message % (peer, *args)`` unless it is a repeat or over the rate.

        ``kind`` names what went wrong (a bad frame's kind, ``no credit`` ...).
        """
        if (rid, kind) in self._said:
            return
        if len(self._said) >= self._remember:
            self._said.clear()
        self._said.add((rid, kind))
        now = time.monotonic()
        while self._times and now - self._times[0] > self._period:
            self._times.popleft()
        if len(self._times) >= self._burst:
            self._suppressed += 1
            return
        self._times.append(now)
        suffix = "; more of this kind from it are only counted"
        if self._suppressed:
            suffix += f" ({self._suppressed} warnings about peers suppressed before this one)"
            self._suppressed = 0
        log.warning("%s: " + message + suffix, self._where, _name(rid), *args)


def water_fill(levels: list[int], amount: int) -> list[int]:
    """How to split ``amount`` over ``levels`` so that the lowest rise first, evenly."""
    order = sorted(range(len(levels)), key=levels.__getitem__)
    low = [levels[i] for i in order]
    total = 0
    for count in range(1, len(low) + 1):
        total += low[count - 1]
        level = (total + amount) // count
        if count == len(low) or level <= low[count]:
            break
    extra = total + amount - level * count  # fewer than count: one more each for the first
    shares = [0] * len(levels)
    for j in range(count):
        shares[order[j]] = level - low[j] + (j < extra)
    return shares


def _name(rid: bytes) -> str:
    """A peer's routing id for the log: printable, at most 40 characters."""
    return repr(rid.decode("ascii"))[1:-1][:40] if rid.isascii() else rid.hex()[:40]
