"""A producer's committed refs on their way into its stream.

Committed is committed: a ref the stream does not take (its window stayed
full for the sender's timeout) is kept and sent again before the next refs,
and while an emit waits at the backpressure gate; one still unsent when the
producer closes stays pending in the ledger, and consumers lease it from
there once the stream has ended (or at their next resume).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence

from dataflow.interfaces._stream import RefSender
from dataflow.live._backpressure import ProducerBlocking
from dataflow.model._errors import BackpressureError, DataflowError
from dataflow.model._refs import SampleRef

log = logging.getLogger("dataflow")
_NO_CREDIT = (
    "its stream's consumers grant no credit (every window is full, or no consumer is "
    "reachable): the trainers are not receiving, committed refs wait to be sent, and "
    "each emit waits the sender's timeout"
)


class RefOutbox:
    """Sends a producer's committed refs to its stream, keeping those it does not take.

    A wait for the stream's credit is an episode of ``credit`` (a
    :class:`ProducerBlocking` of cause ``"credit"``), logged and counted.
    """

    def __init__(self, stream: RefSender, run_id: str, producer_id: str) -> None:
        self.stream = stream
        self.run_id = run_id
        #: Committed refs the stream did not take yet (its window stayed full), oldest first.
        self.unsent: collections.deque[SampleRef] = collections.deque()
        self.credit = ProducerBlocking(run_id, producer_id, "credit", _NO_CREDIT)
        # The default send_many sends one by one: the loop below does the same, and
        # knows how many went when the window fills.
        self._batches = type(stream).send_many is not RefSender.send_many
        # A sender that checks many refs at once (ZmqRefSender) keeps what it encoded
        # for their send_many: each ref is then encoded once, not once more per send.
        self._check_many = getattr(stream, "check_many", None)

    def check(self, refs: Iterable[SampleRef]) -> None:
        """Before a commit: the stream would refuse none of ``refs`` (BadFrameError).

        So an emit that raises was not committed, and one that returns was.
        """
        if self._check_many is not None and self._batches:
            self._check_many(list(refs))
            return
        for ref in refs:
            self.stream.check(ref)

    def send(self, refs: Sequence[SampleRef]) -> None:
        """Push committed refs to the stream, after those it did not take before.

        A sender that batches (one overriding ``RefSender.send_many``) gets them all
        in one ``send_many``; what its window does not take is sent ref by ref,
        waiting for credit as long as the sender's timeout.

        Never raises for a ref the stream does not take: that would make the
        caller believe the commit failed, and retry into a None.
        """
        self.unsent.extend(refs)
        left = self._send_unsent(timeout=None)
        if left:  # the episode's warning says it once (ProducerBlocking)
            log.debug(
                "stream backpressure: %d committed refs of run %r not sent yet; they are "
                "sent again before the next ones (and stay pending in the ledger)",
                left,
                self.run_id,
            )

    def send_waiting(self) -> None:
        """While an emit waits at the gate: send what the stream's window takes now."""
        if self.unsent:
            self._send_unsent(timeout=0)

    def _send_unsent(self, *, timeout: float | None) -> int:
        """Send the refs not sent yet, oldest first, each within ``timeout`` (None: the
        sender's); how many are left when the stream's window stays full."""
        unsent = self.unsent
        if len(unsent) > 1 and self._batches:
            self._send_batch()
        while unsent:
            ref = unsent[0]
            try:
                self._send_one(ref, timeout)
            except BackpressureError:
                return len(unsent)
            except DataflowError as exc:  # check() let through a ref send() refuses
                log.warning(
                    "stream refused committed ref %r of run %r; it stays pending in the "
                    "ledger (%s: %s)",
                    ref.sample_id,
                    self.run_id,
                    type(exc).__name__,
                    exc,
                )
            unsent.popleft()
        self.credit.end("goes on: its stream takes refs again")
        return 0

    def _send_batch(self) -> None:
        """Send every unsent ref in as few frames as the window takes now, without waiting.

        What it does not take stays unsent, for the loop of single sends (which waits
        for credit and skips a ref the stream refuses). A sender's ``send_many`` that
        raises says how many refs it sent first in the error's ``sent``; without it
        none count as sent, and those sent go out again: a consumer drops a ref it
        already has (it leases a sample once).
        """
        batch = list(self.unsent)
        try:
            self.stream.send_many(batch, timeout=0)
        except DataflowError as exc:
            sent = getattr(exc, "sent", 0)
            for _ in range(sent if isinstance(sent, int) and 0 < sent <= len(batch) else 0):
                self.unsent.popleft()
            return
        self.unsent.clear()

    def _send_one(self, ref: SampleRef, timeout: float | None) -> None:
        """Send ``ref``; a wait for credit (a window with room needs none) is a blocked episode."""
        try:
            self.stream.send(ref, timeout=0)
        except BackpressureError:
            if timeout == 0:
                raise
            with self.credit.waiting():
                self.stream.send(ref, timeout=timeout)
