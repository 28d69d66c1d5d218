"""The consumer-side window both receivers share: what is in flight, what ended, the stats."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dataflow.model._checks import check_count, check_seconds
from dataflow.model._errors import InvalidArgumentError, ProducerLostError, StreamIdleError
from dataflow.model._ref_codec import RefBatch
from dataflow.model._refs import SampleRef
from dataflow.streams._wire import BAD_FRAME_KINDS


@dataclass(frozen=True)
class ReceiverStats:
    """Counters of one receiver since it started."""

    received: int
    """Refs accepted into the window."""
    delivered: int
    """Refs handed out by ``receive``."""
    credited: int
    """Refs finished through ``credit``."""
    in_flight: int
    """Refs accepted and not yet credited (buffered or handed out); never above the window."""
    max_in_flight: int
    """The highest ``in_flight`` seen."""
    dropped_refs: int
    """Well-formed refs dropped on arrival (if committed, the ledger still holds them);
    each lacked credit, so this equals ``dropped_no_credit``."""
    bad_frames: int
    """Frames dropped as malformed, oversized, of an unknown version, or carrying a tensor."""
    bad_frame_kinds: Mapping[str, int] = field(default_factory=dict)
    """``bad_frames`` by kind: ``malformed``, ``oversized``, ``tensor``, ``version``."""
    producers_closed: int = 0
    producers_lost: int = 0
    dropped_no_credit: int = 0
    """Refs beyond the credit granted to their connection: sent against another receiver
    session or an old line, or with no credit left (a peer that ignores the protocol)."""
    dropped_unknown_producer: int = 0
    """Connections that named a producer in heartbeats but went silent before delivering
    a ref on credit: forgotten without a ProducerLostError."""
    dropped_foreign_connection: int = 0
    """Heartbeats and EOFs for a producer that speaks on another live connection."""


def check_timeout(name: str, value: object, *, allow_none: bool = False) -> None:
    """Refuse a ``value`` of ``name`` that is not a number of seconds >= 0 (inf waits forever)."""
    check_seconds(
        name,
        value,
        finite=False,
        allow_none=allow_none,
        expected="a non-negative number of seconds",
    )


class Window:
    """Refs accepted and not yet credited, bounded by ``size``; which producers closed.

    Not thread-safe: each receiver guards it with its own lock.
    """

    def __init__(self, size: int, expected_producers: int) -> None:
        self.size = size
        self.expected_producers = expected_producers
        # Refs accepted and not yet handed out, in order: a frame's tuple or list, or its
        # RefBatch (built when handed out), and how many refs they hold.
        self._queue: deque[Sequence[SampleRef] | RefBatch] = deque()
        self.queued = 0
        self.in_flight = 0
        self.closed: set[str] = set()
        self.lost: list[str] = []
        self._counts: Counter[str] = Counter()
        self._bad: Counter[str] = Counter({kind: 0 for kind in BAD_FRAME_KINDS})
        self._max_in_flight = 0

    @property
    def exhausted(self) -> bool:
        return len(self.closed) >= self.expected_producers and not self.queued

    def has_room(self, reserved: int = 0) -> bool:
        return self.in_flight + reserved < self.size

    def accept(self, ref: SampleRef) -> None:
        self._queue.append((ref,))
        self.queued += 1
        self.in_flight += 1
        self._counts["received"] += 1
        if self.in_flight > self._max_in_flight:
            self._max_in_flight = self.in_flight

    def accept_many(self, refs: Sequence[SampleRef] | RefBatch) -> None:
        """``accept`` of each of ``refs``, in order (a RefBatch's are built when handed out)."""
        self._queue.append(refs)
        self.queued += len(refs)
        self.in_flight += len(refs)
        self._counts["received"] += len(refs)
        self._max_in_flight = max(self._max_in_flight, self.in_flight)

    def drop(self, count: int = 1) -> None:
        """``count`` refs dropped for coming without credit."""
        self._counts["dropped_refs"] += count
        self._counts["dropped_no_credit"] += count

    def count(self, name: str) -> None:
        """One more of the ReceiverStats counter ``name`` (a ``dropped_*`` one)."""
        self._counts[name] += 1

    def count_bad(self, kind: str) -> None:
        self._bad[kind] += 1

    def mark_closed(self, producer_id: str) -> None:
        if producer_id not in self.closed:
            self.closed.add(producer_id)
            self._counts["producers_closed"] += 1

    def mark_lost(self, producer_id: str) -> None:
        self.lost.append(producer_id)
        self._counts["producers_lost"] += 1

    def credit(self, count: int) -> None:
        check_count("credit count", count, minimum=0)
        handed_out = self.in_flight - self.queued
        if count > handed_out:
            raise InvalidArgumentError(
                f"credit({count}) but only {handed_out} received refs are unfinished; "
                "credit only refs that receive() handed out, once each"
            )
        self.in_flight -= count
        self._counts["credited"] += count

    def next_batch(
        self, max_refs: int, timeout: float, wait: Callable[[float], object]
    ) -> list[SampleRef]:
        """The receive loop: buffered refs, [] at end of stream, or wait up to ``timeout``.

        ``wait(seconds)`` lets refs arrive (polls sockets or waits on a condition).
        """
        check_count("max_refs", max_refs, minimum=1)
        check_timeout("timeout", timeout)
        deadline = time.monotonic() + timeout
        while True:
            if self.lost:
                producer = self.lost.pop(0)
                raise ProducerLostError(
                    f"producer {producer!r} stopped heart-beating without closing its stream; "
                    "its refs stay committed in the ledger and come back through reconcile",
                    producer_id=producer,
                )
            if self.queued:
                return self._take(min(max_refs, self.queued))
            if self.exhausted:
                return []
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StreamIdleError(
                    f"no ref arrived within {timeout:g}s "
                    f"({len(self.closed)} of {self.expected_producers} producers closed)"
                )
            wait(remaining)

    def _take(self, count: int) -> list[SampleRef]:
        """The first ``count`` queued refs (there are as many), out of the queue."""
        self._counts["delivered"] += count
        self.queued -= count
        queue = self._queue
        batch: list[SampleRef] = []
        while count > 0:
            chunk = queue[0]
            if len(chunk) <= count:
                queue.popleft()
            else:
                chunk, queue[0] = chunk[:count], chunk[count:]
            count -= len(chunk)
            batch.extend(chunk.build() if type(chunk) is RefBatch else chunk)
        return batch

    def stats(self) -> ReceiverStats:
        c = self._counts
        return ReceiverStats(
            received=c["received"],
            delivered=c["delivered"],
            credited=c["credited"],
            in_flight=self.in_flight,
            max_in_flight=self._max_in_flight,
            dropped_refs=c["dropped_refs"],
            bad_frames=sum(self._bad.values()),
            bad_frame_kinds=dict(self._bad),
            producers_closed=c["producers_closed"],
            producers_lost=c["producers_lost"],
            dropped_no_credit=c["dropped_no_credit"],
            dropped_unknown_producer=c["dropped_unknown_producer"],
            dropped_foreign_connection=c["dropped_foreign_connection"],
        )
