"""RefSender and RefReceiver: the two ends of a ref stream."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from dataflow.model._refs import (
    SampleRef,
)


class RefSender(ABC):
    """Producer side of a ref stream: pushes committed refs towards consumer ranks.

    ``Producer(..., stream=sender)`` calls ``send`` once per newly committed
    ref (after the commit is durable in the ledger) and ``close`` when the
    producer closes. The ledger stays the source of truth: a ref lost on the
    wire comes back to a consumer through reconcile.
    """

    def check(self, ref: SampleRef) -> None:  # noqa: B027 - optional, the default checks nothing
        """Raise BadFrameError if ``send`` would refuse ``ref`` (e.g. its frame is too large).

        Called by the Producer for every ref before the ledger commit, so a
        ref the stream cannot carry is refused while nothing is committed yet
        (an ``emit`` that raises committed nothing). The default does no check.
        """

    def bind_producer(self, producer_id: str) -> None:  # noqa: B027 - optional
        """Speak for ``producer_id``: called by ``Producer(..., stream=sender)`` with its id.

        A sender that names its producer takes the Producer's id where none was
        given, and raises InvalidArgumentError (naming both) where another was:
        one producer id, not two that can disagree. The default does nothing.
        """

    @abstractmethod
    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        """Deliver ``ref`` to exactly one consumer rank.

        Blocks while every consumer's credit window is full; raises
        BackpressureError when ``timeout`` (seconds; None means the sender's
        default) passes first.
        """

    def send_many(self, refs: Sequence[SampleRef], *, timeout: float | None = None) -> None:
        """Send ``refs`` in order, as few frames as the window allows; as ``send`` for each."""
        for ref in refs:
            self.send(ref, timeout=timeout)

    @abstractmethod
    def close(self) -> None:
        """Tell every consumer this producer is done (end of stream); idempotent."""


class RefReceiver(ABC):
    """Consumer side of a ref stream, with a bounded credit window.

    ``Consumer(..., stream=receiver)`` leases requeued work from the ledger
    first and then takes refs from ``receive``; it calls ``credit`` for each
    ref it finished (acked, nacked, or dropped as already delivered), which
    re-opens the window.
    """

    @abstractmethod
    def receive(self, max_refs: int, *, timeout: float | None = None) -> list[SampleRef]:
        """Return 1..max_refs refs, or [] once every producer has closed and all is drained.

        Raises StreamIdleError when nothing arrives within ``timeout`` (None:
        the receiver's idle timeout) and ProducerLostError when a producer
        stops heart-beating without closing.
        """

    @abstractmethod
    def credit(self, count: int) -> None:
        """``count`` received refs are finished; they leave the in-flight window."""

    @property
    @abstractmethod
    def exhausted(self) -> bool:
        """True once every producer closed and every received ref was handed out."""

    def mark_producer_closed(self, producer_id: str) -> None:  # noqa: B027 - optional
        """Count ``producer_id`` as closed though its end of stream never arrived here.

        Called by the Consumer when it joins an epoch (a resume, a rejoin), for
        every producer whose ``close`` event is then in the ledger, so a consumer
        restarted after a producer closed still sees the stream end. Not while it
        runs: a close read from the ledger could overtake refs still on the wire,
        so a running stream ends with each producer's end of stream.
        """

    def mark_producer_closed_if_silent(self, producer_id: str) -> bool:
        """Count ``producer_id`` as closed unless a live connection speaks for it here.

        Called by a running Consumer for each producer whose ``close`` event is
        in the ledger and whose end of stream has not arrived. A producer
        records its close only after its stream ended, so with no live
        connection here nothing more of it is on the wire (its end of stream
        went to an earlier receiver on this endpoint, or was lost with its
        connection). Returns whether the producer now counts as closed. The
        default marks nothing and returns False: the stream then ends with the
        producer's end of stream, or at the next epoch.
        """
        return False

    @abstractmethod
    def close(self) -> None:
        """Release sockets; idempotent."""
