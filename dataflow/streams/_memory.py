"""MemoryStream: an in-process ref stream for unit tests (no sockets, no threads of its own)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

from dataflow.interfaces._stream import RefReceiver, RefSender
from dataflow.model._errors import (
    ArgumentTypeError,
    BackpressureError,
    InvalidArgumentError,
    StreamError,
)
from dataflow.model._refs import SampleRef
from dataflow.streams._window import ReceiverStats, Window, check_count, check_timeout
from dataflow.streams._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    RefsFrame,
    check_ref,
    decode,
    encode_refs,
    frame_fit,
    ref_bodies,
)


class MemoryStream:
    """An in-process stream between producers and consumer ranks, for unit tests.

    The same semantics as the ZeroMQ stream: each ref goes to exactly one
    rank (the one with the most free window), at most ``window`` refs per
    rank are in flight (received and not yet credited), ``send`` blocks and
    raises BackpressureError when every window stays full, ``receive`` returns
    [] once ``expected_producers`` distinct producers closed and raises
    StreamIdleError when idle. Refs pass through the real wire format, so the
    tensor-free rule and the frame size limit hold here too.

    A rank takes part from its first ``receiver(rank)`` call; calling it again
    for the same rank is a consumer restart: the old receiver's refs are gone
    (the ledger requeues them).
    """

    def __init__(
        self,
        *,
        ranks: int = 1,
        window: int = 64,
        expected_producers: int = 1,
        idle_timeout: float = 60.0,
        send_timeout: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        check_count("ranks", ranks, minimum=1)
        check_count("window", window, minimum=1)
        check_count("expected_producers", expected_producers, minimum=1)
        check_timeout("idle_timeout", idle_timeout)
        check_timeout("send_timeout", send_timeout)
        check_count("max_frame_bytes", max_frame_bytes, minimum=256)
        self.ranks = ranks
        self.window = window
        self.expected_producers = expected_producers
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        self.max_frame_bytes = max_frame_bytes
        self._cond = threading.Condition()
        self._windows: dict[int, Window] = {}
        self._closed: set[str] = set()
        self._rr = 0

    def sender(self, producer_id: str | None = None) -> MemoryRefSender:
        """A producer's end; a second sender with the same id is that producer restarted.

        ``producer_id`` None: the Producer given the sender as its stream names it
        (a random id for a sender used on its own).
        """
        named = producer_id is not None
        producer_id = f"producer-{uuid.uuid4().hex[:12]}" if producer_id is None else producer_id
        if not isinstance(producer_id, str) or not 0 < len(producer_id) <= 256:
            raise InvalidArgumentError(
                f"producer_id must be a str of 1-256 characters: {producer_id!r}"
            )
        self._open_producer(producer_id)
        return MemoryRefSender(self, producer_id, named=named)

    def _open_producer(self, producer_id: str) -> None:
        with self._cond:
            self._closed.discard(producer_id)
            for window in self._windows.values():
                window.closed.discard(producer_id)

    def receiver(self, rank: int = 0) -> MemoryRefReceiver:
        """Rank ``rank``'s end, with an empty window (a restart forgets the old one's refs)."""
        check_count("rank", rank, minimum=0)
        if rank >= self.ranks:
            raise InvalidArgumentError(f"rank must be < ranks ({self.ranks}), got {rank}")
        window = Window(self.window, self.expected_producers)
        with self._cond:
            for producer_id in self._closed:
                window.mark_closed(producer_id)
            self._windows[rank] = window
            self._cond.notify_all()
        return MemoryRefReceiver(self, rank, window)

    def lose_producer(self, producer_id: str) -> None:
        """Act as if ``producer_id`` died without closing: each rank's next receive raises
        ProducerLostError once."""
        with self._cond:
            for window in self._windows.values():
                window.mark_lost(producer_id)
            self._cond.notify_all()

    # -- used by the two ends ------------------------------------------------------
    def _send(self, refs: Sequence[SampleRef], timeout: float | None) -> None:
        check_timeout("timeout", timeout, allow_none=True)
        copies = self._through_the_wire(refs)
        timeout = self.send_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        done = 0
        with self._cond:
            while done < len(copies):
                window = self._pick()
                if window is not None:
                    count = min(window.size - window.in_flight, len(copies) - done)
                    window.accept_many(copies[done : done + count])
                    done += count
                    deadline = time.monotonic() + timeout  # each ref waits up to timeout
                    self._cond.notify_all()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    error = BackpressureError(
                        f"no rank had room within {timeout:g}s "
                        f"({len(self._windows)} of {self.ranks} ranks have a receiver, "
                        f"window {self.window})"
                        + (
                            f"; {done} of the {len(copies)} refs were sent"
                            if len(copies) > 1
                            else ""
                        )
                    )
                    error.sent = done  # type: ignore[attr-defined]
                    raise error
                self._cond.wait(remaining)

    def _through_the_wire(self, refs: Sequence[SampleRef]) -> list[SampleRef]:
        """Copies of ``refs`` encoded and decoded as the ZeroMQ stream's frames are: a ref
        the wire refuses raises, naming it, before any is sent."""
        limit = self.max_frame_bytes
        bodies = ref_bodies(refs, limit)  # as a ZmqRefSender encodes them
        copies: list[SampleRef] = []
        while len(copies) < len(bodies):
            count = frame_fit(bodies, len(copies), len(bodies) - len(copies), limit)
            chunk = bodies[len(copies) : len(copies) + count]
            frame = decode([encode_refs("memory", 0, chunk)], max_bytes=limit)
            copies.extend(frame.refs if isinstance(frame, RefsFrame) else (frame.ref,))  # type: ignore[union-attr]
        return copies

    def _pick(self) -> Window | None:
        ranks = sorted(self._windows)
        best, best_free = None, 0
        for i in range(len(ranks)):
            window = self._windows[ranks[(self._rr + i) % len(ranks)]]
            free = window.size - window.in_flight
            if free > best_free:
                best, best_free = window, free
        self._rr += 1
        return best

    def _close_producer(self, producer_id: str) -> None:
        with self._cond:
            self._closed.add(producer_id)
            for window in self._windows.values():
                window.mark_closed(producer_id)
            self._cond.notify_all()


class MemoryRefSender(RefSender):
    """A producer's end of a MemoryStream."""

    def __init__(self, stream: MemoryStream, producer_id: str, *, named: bool = True) -> None:
        self.stream = stream
        self.producer_id = producer_id
        self._named = named
        self._closed = False

    def bind_producer(self, producer_id: str) -> None:
        """As ``ZmqRefSender.bind_producer``: take the Producer's id, or refuse another."""
        if not self._named:
            self.producer_id, self._named = producer_id, True
            self.stream._open_producer(producer_id)
        elif producer_id != self.producer_id:
            raise InvalidArgumentError(
                f"the stream's sender speaks for producer {self.producer_id!r}, not the "
                f"Producer's producer_id {producer_id!r}: make the two equal (or call "
                "sender() without an id and the sender takes the Producer's)"
            )

    def check(self, ref: SampleRef) -> None:
        """Raise BadFrameError if ``send`` would refuse ``ref`` (as ``ZmqRefSender.check``)."""
        check_ref(ref, self.stream.max_frame_bytes)

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        if self._closed:
            raise StreamError(f"sender {self.producer_id!r} is closed")
        self.stream._send([ref], timeout)

    def send_many(self, refs: Sequence[SampleRef], *, timeout: float | None = None) -> None:
        """As ``ZmqRefSender.send_many``: in order, each rank taking as many as its window
        has room for; nothing is sent if the wire refuses any of ``refs``."""
        if self._closed:
            raise StreamError(f"sender {self.producer_id!r} is closed")
        if isinstance(refs, SampleRef) or not isinstance(refs, Sequence):
            raise ArgumentTypeError(
                f"send_many takes a sequence of SampleRefs, got {type(refs).__name__}"
            )
        self.stream._send(refs, timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream._close_producer(self.producer_id)


class MemoryRefReceiver(RefReceiver):
    """A consumer rank's end of a MemoryStream."""

    def __init__(self, stream: MemoryStream, rank: int, window: Window) -> None:
        self.stream = stream
        self.rank = rank
        self._window = window
        self._closed = False

    def receive(self, max_refs: int, *, timeout: float | None = None) -> list[SampleRef]:
        check_timeout("timeout", timeout, allow_none=True)
        timeout = self.stream.idle_timeout if timeout is None else timeout
        with self.stream._cond:
            self._check_open()
            return self._window.next_batch(max_refs, timeout, self.stream._cond.wait)

    def credit(self, count: int) -> None:
        with self.stream._cond:
            self._check_open()
            self._window.credit(count)
            self.stream._cond.notify_all()

    @property
    def exhausted(self) -> bool:
        with self.stream._cond:
            return self._window.exhausted

    def mark_producer_closed(self, producer_id: str) -> None:
        """Count ``producer_id`` as closed (as the ZeroMQ receiver's method of that name)."""
        with self.stream._cond:
            self._window.mark_closed(producer_id)
            self.stream._cond.notify_all()

    def stats(self) -> ReceiverStats:
        with self.stream._cond:
            return self._window.stats()

    def close(self) -> None:
        with self.stream._cond:
            if self._closed:
                return
            self._closed = True
            if self.stream._windows.get(self.rank) is self._window:
                del self.stream._windows[self.rank]
            self.stream._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise StreamError(f"receiver of rank {self.rank} is closed")
        if self.stream._windows.get(self.rank) is not self._window:
            raise StreamError(f"receiver of rank {self.rank} was replaced by a newer one")
