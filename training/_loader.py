"""FeatureLoader: leased batches of features from a Consumer, collated for a training step."""

from __future__ import annotations

import collections
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dataflow import Consumer, InvalidArgumentError, ProducerLostError, SampleRef
from training._accelerator import current_accelerator
from training._config import LoaderConfig
from training._patience import LedgerPatience
from training._reading import CollateFn, _BatchReading, _Read, collate, pinned

_POLL_S = 0.5
#: The longest one lease of the rest of a short batch waits (it returns once the rest came).
_FILL_WAIT_S = 2.0
#: Stream producers found lost in one lease ahead before the loader stops retrying it.
_LOSSES_AT_ONCE = 64
log = logging.getLogger("training")


__all__ = ["Batch", "CollateFn", "FeatureLoader", "check_position", "collate", "pinned"]


@dataclass(frozen=True)
class Batch:
    """Leased refs and their collated features.

    ``features`` maps each feature name to the stacked tensors of the batch
    (``[len(batch), *shape]``) when every sample's tensor has the same shape and
    dtype, else to the list of tensors; with a ``collate_fn`` it is whatever that
    returns. Listed tensors may be the store's own memory: treat them as read-only.
    An empty batch (no refs) reaches a rank whose share ran out while its peers
    still train.
    """

    refs: tuple[SampleRef, ...] = ()
    features: Any = field(default_factory=dict)

    @property
    def sample_ids(self) -> list[str]:
        return [ref.sample_id for ref in self.refs]

    def __len__(self) -> int:
        return len(self.refs)


def check_position(position: int, batch_size: int, *, saved_batch_size: object = None) -> None:
    """A saved position must fall on a batch boundary of a batch size other than the
    saved one (``saved_batch_size``) that a run resumes with. With the saved batch
    size any position continues the saved run: a short last batch, or one that
    lost a sample, leaves a position that is no multiple of it."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise InvalidArgumentError(f"position must be an int >= 0, got {position!r}")
    if batch_size != saved_batch_size and position % batch_size:
        divisors = [d for d in range(1, min(position, 64) + 1) if position % d == 0]
        raise InvalidArgumentError(
            f"the saved data position, {position} samples, is not a multiple of "
            f"batch_size={batch_size}: batches would not line up with the saved run; resume "
            f"with a batch size that divides {position} (e.g. {divisors[-6:]})"
        )


class FeatureLoader(_BatchReading, LedgerPatience):
    """Iterates over leased, loaded, collated batches until the run is finished for this rank.

    Each batch leases ``batch_size`` refs and reads their features from the
    consumer's store. In arrival order (a stream, or producers still committing) a
    batch that has some refs waits for the rest up to ``batch_wait_s``, so that every
    batch is full but the last one of the data (see ``LoaderConfig.batch_wait_s``).
    A stream producer found lost (``ProducerLostError``: silent for its heartbeat
    timeout) is logged and leasing goes on: its committed refs stay in the ledger,
    and come through the stream once it is back, or from the ledger once the stream
    ends. The loader never acks: the trainer acks a batch's refs at
    the optimizer step that trained them. A ref whose features are gone or corrupt
    (StaleRefError, CorruptFeatureError) is reported lost (``Consumer.lost``: no
    failed attempt, it waits for regeneration), skipped with a warning, and handed
    to ``on_lost`` (the Trainer regenerates it there when it has a
    ``regenerate_fn``).

    With ``prefetch=N`` (N >= 1), once the batches read ahead are handed out, a
    background thread leases the next N (only refs ready now, in one ledger
    write), reads their features and counts what is left, while the current batch
    trains: the ledger write of a lease is off the training thread, and one write
    serves N batches. Acks given to :meth:`ack` go in that write too, all those
    given since the last lease ahead (``Consumer.ack_and_lease``); so with N
    batches per lease, N steps of acks and the next N batches' lease cost one
    ledger write. An ack not written yet is lost with the process, which is safe:
    its step came after the last checkpoint, which a restart goes back to.
    :meth:`flush` writes and waits for them; ``Consumer.checkpoint`` calls it first
    (the loader registers it with ``Consumer.before_checkpoint``). They are written
    before the loader waits for refs (a stream's credits come back with them). Refs
    leased ahead and not yet handed out stay leased when the loader stops; the next
    resume requeues them.
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        config: LoaderConfig | None = None,
        collate_fn: CollateFn | None = None,
        on_lost: Callable[[list[str]], object] | None = None,
    ) -> None:
        if not isinstance(consumer, Consumer):
            raise InvalidArgumentError(
                f"consumer must be a dataflow.Consumer, got {type(consumer).__name__}"
            )
        if on_lost is not None and not callable(on_lost):
            raise InvalidArgumentError(f"on_lost must be callable, got {type(on_lost).__name__}")
        config = LoaderConfig() if config is None else config
        if not isinstance(config, LoaderConfig):
            raise InvalidArgumentError(
                f"config must be a LoaderConfig, got {type(config).__name__}"
            )
        if collate_fn is not None and not callable(collate_fn):
            raise InvalidArgumentError(
                f"collate_fn must be callable, got {type(collate_fn).__name__}"
            )
        self.consumer = consumer
        self.config = config
        self.collate_fn: CollateFn = collate if collate_fn is None else collate_fn
        self.on_lost = on_lost
        #: Whether batches go to pinned memory: asked for, and an accelerator to pin for.
        self._pin = config.pin_memory and current_accelerator() is not None
        if config.pin_memory and not self._pin:
            warnings.warn(
                "LoaderConfig(pin_memory=True), but this machine has no accelerator: the "
                "batches stay in ordinary memory",
                stacklevel=2,
            )
        self._pool: ThreadPoolExecutor | None = None
        #: The lease ahead in flight, and the batches it read that are not handed out yet.
        self._ahead: Future[list[_Read]] | None = None
        self._ready: collections.deque[_Read] = collections.deque()
        #: Acks given to ack() and not yet passed to the thread, and those passed to it.
        self._unsent: list[tuple[list[SampleRef], int]] = []
        self._acks: list[Future[None]] = []
        #: The acks the lease ahead in flight writes with its lease, and their outcome.
        self._ahead_acks: tuple[list[tuple[list[SampleRef], int]], Future[None] | None] = ([], None)
        #: The refs of a short batch that the lease ahead in flight fills.
        self._ahead_short: list[SampleRef] = []
        #: The count of batches left that the lease ahead made for the batch just handed
        #: out (remaining_batches answers it once, right after next_batch).
        self._counted: _Read | None = None
        #: Samples handed out in batches so far (this rank's position in its queue).
        self.position = 0
        #: Refs leased for a batch that is not full yet (they wait for the rest), and
        #: since when.
        self._short: list[SampleRef] = []
        self._short_since: float | None = None
        #: Batches handed out short before the end of the data (``batch_wait_s`` passed).
        self.short_batches = 0
        if config.prefetch:  # acks held here are written before any checkpoint records
            consumer.before_checkpoint(self.flush)

    def __iter__(self) -> Iterator[Batch]:
        try:
            while (batch := self.next_batch()) is not None:
                yield batch
        finally:
            self.close()

    def __enter__(self) -> FeatureLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_batch(self) -> Batch | None:
        """The next batch, or None when the run is finished for this rank (or
        ``lease_timeout`` ran out). It may be called again after None: work that came
        back meanwhile (a nack, a regeneration) is picked up."""
        if self.consumer.epoch is None:
            raise InvalidArgumentError(
                f"consumer {self.consumer.consumer_id!r} has not resumed; call resume() first"
            )
        self._counted = None
        while True:
            self._take_ahead()
            self._raise_failed_acks()
            if self._ready:
                read = self._ready.popleft()
            else:
                refs = self._lease(timeout=self.config.lease_timeout)
                if not refs:
                    return None
                read = self._read(refs)
            self._settle_lost(read.lost)
            if self.config.prefetch and not self._ready:
                self._lease_ahead()
            if read.refs:
                self.position += len(read.refs)
                self._counted = read if read.counted else None
                return Batch(tuple(read.refs), read.features)

    def ack(self, refs: Sequence[SampleRef], *, step: int) -> None:
        """``consumer.ack(refs, step=step)``: with ``prefetch`` written in the background
        thread in the transaction of the next lease ahead, together with the acks given
        since the last one (a failure is raised by the next :meth:`next_batch` or
        :meth:`flush`); else now."""
        if not self.config.prefetch:
            self._ledger(self.consumer.ack, refs, step=step)
            return
        self._raise_failed_acks()
        self._unsent.append((list(refs), step))

    def flush(self) -> None:
        """Write every ack given to :meth:`ack` and wait until they are in the ledger; raise
        the first that failed. ``Consumer.checkpoint`` calls it before it records what was
        trained (with ``prefetch``, the loader registers it there)."""
        self._send_acks()
        acks, self._acks = self._acks, []
        failed = [exc for future in acks if (exc := future.exception()) is not None]
        for exc in failed[1:]:  # one is raised; the others would be lost unseen
            log.warning("an ack of consumer %r failed too: %s", self.consumer.consumer_id, exc)
        if failed:
            raise failed[0]

    def remaining_batches(self, *, fresh: bool = False) -> int | None:
        """Batches this loader will still hand out, once that number is fixed; else None.

        It is fixed when no more work can come to this rank: every producer closed
        (a stream: every producer's stream ended and was drained) and, in a seeded
        order, nothing is waiting for regeneration. Then it counts the batch leased
        ahead and this rank's pending samples in ``batch_size`` batches. A nack
        (features gone, a failed step) can still put a sample back after that.

        Right after :meth:`next_batch` handed out a batch leased ahead, it answers
        with the count the lease ahead made (that lease took the batch it counts
        off the pending ones: the number is the same), without waiting for the
        next lease ahead. ``fresh=True`` counts now instead (waiting for that lease).
        """
        counted, self._counted = self._counted, None
        if counted is not None and not fresh:
            return counted.remaining
        self._take_ahead(wait=True)
        return self._batches_after(len(self._ready))

    def _batches_after(
        self, ahead: int, *, refresh: bool = True, held: int | None = None
    ) -> int | None:
        """``ahead`` batches read, then the pending ones and the ``held`` refs of a short
        batch (default: the one waiting now) in batches; None while that is not fixed."""
        pending = self._ledger(self.consumer.remaining, refresh=refresh)
        if pending is None:
            return None
        held = len(self._short) if held is None else held
        return ahead + -(-(pending + held) // self.config.batch_size)

    def state_dict(self) -> dict[str, int]:
        """The position in samples (and the batch size), for a checkpoint's per-rank state."""
        return {"position": self.position, "batch_size": self.config.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position.

        With a seeded order the position is a place in this rank's queue, so
        another batch size than the saved one may be used only where it divides
        it (batches must line up with the saved run's). In arrival order it only
        counts what was handed out (a stream's batches may be short); the ledger
        alone says what is left.
        """
        if not isinstance(state, dict) or not isinstance(state.get("position"), int):
            raise InvalidArgumentError(f"not a FeatureLoader state: {state!r:.100}")
        check_position(
            state["position"],
            self.config.batch_size if self._seeded else 1,
            saved_batch_size=state.get("batch_size") if self._seeded else 1,
        )
        self.position = state["position"]

    @property
    def _seeded(self) -> bool:
        return self.consumer.order_seed is not None

    def _restart(self) -> None:
        """Before the consumer resumes again (``Trainer.resume``): write the acks given,
        wait for the lease ahead, and drop every batch read ahead. They belong to the
        old epoch, whose leases the resume gives back to the queue."""
        self.close()
        self._ahead = None
        self._ahead_acks = ([], None)
        self._ready.clear()
        self._short, self._ahead_short, self._short_since = [], [], None
        self._counted = None

    def close(self) -> None:
        """Stop the prefetch thread once the acks given to it are written (refs it leased
        ahead stay leased until a resume); a failed ack is logged (call :meth:`flush`
        first to have it raised)."""
        if self._ahead is not None and self._ahead.cancel():
            self._ahead = None
            acks, written = self._ahead_acks  # not written: they go with the others
            self._unsent[:0] = acks
            self._short = self._ahead_short  # not filled: the next lease fills them
            if written is not None:
                self._acks.remove(written)
        self._send_acks()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        acks, self._acks = self._acks, []
        for future in acks:
            if (exc := future.exception()) is not None:
                log.warning("an ack of consumer %r failed: %s", self.consumer.consumer_id, exc)

    # -- internals ----------------------------------------------------------------
    def _lease(self, *, timeout: float | None) -> list[SampleRef]:
        """The refs of the next batch: ``batch_size`` of them, fewer at the end of the data,
        or once ``batch_wait_s`` (or ``timeout``) passed; [] when none came in ``timeout``."""
        # Not consumer.lease(timeout=None): it also waits for this consumer's own leases to
        # be acked, and the refs of an accumulation are acked only after the last batch.
        size = self.config.batch_size
        refs, self._short = self._short, []
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = 0.0
        stream = self.consumer.stream
        if self._fills_batches and len(refs) < size and stream is not None and not stream.exhausted:
            # Wait for the whole rest in the first lease already (the acks first: a
            # stream's credits come back with them), within batch_wait_s of now.
            self._send_acks()
            ends = [b for b in (timeout, self.config.batch_wait_s) if b is not None]
            wait = min([_FILL_WAIT_S, *ends])
            if self._short_since is not None and self._full_by() is not None:
                wait = max(0.0, min(wait, self._full_by() - time.monotonic()))
        while True:
            # A short batch waits for its rest in one lease (min_refs), not one per trickle.
            rest = size - len(refs)
            refs += self._lease_refs(rest, wait, min_refs=rest if self._fills_batches else 1)
            if len(refs) >= size or (refs and not self._fills_batches) or self._drained():
                return self._handed_out(refs)
            if refs and self._short_since is None:
                self._short_since = time.monotonic()
            self._send_acks()  # before waiting: a stream's credits come back with the acks
            now = time.monotonic()
            full_by = self._full_by()
            ends = [at for at in (deadline, full_by) if at is not None]
            remaining = min(ends) - now if ends else None
            if remaining is not None and remaining <= 0:
                if refs:
                    waited = (
                        f"batch_wait_s={self.config.batch_wait_s}"
                        if full_by is not None and now >= full_by
                        else f"lease_timeout={timeout}"
                    )
                    return self._handed_out(refs, short=waited)
                warnings.warn(
                    f"no refs came within lease_timeout={timeout}s and run "
                    f"{self.consumer.run_id!r} is not finished for rank {self.consumer.rank}: "
                    "the loader stops early (resume later to train the rest)",
                    stacklevel=3,
                )
                return []
            wait = _POLL_S if remaining is None else min(_FILL_WAIT_S, remaining)

    @property
    def _fills_batches(self) -> bool:
        """Whether a short batch waits for more refs: in arrival order, unless
        ``batch_wait_s=0``. A seeded order leases once the dataset is complete."""
        return not self._seeded and self.config.batch_wait_s != 0

    def _full_by(self) -> float | None:
        """When the short batch waiting now is handed out as it is (None: no bound)."""
        wait = self.config.batch_wait_s
        if self._short_since is None or wait is None:
            return None
        return self._short_since + wait

    def _handed_out(self, refs: list[SampleRef], *, short: str | None = None) -> list[SampleRef]:
        """``refs``, the batch the loader hands out now; ``short`` names the bound that
        passed when it goes out short before the end of the data (warned the first time)."""
        self._short_since = None
        if short is not None:
            self.short_batches += 1
            message = (
                f"a short batch, {len(refs)} of batch_size={self.config.batch_size} refs, "
                f"in run {self.consumer.run_id!r}, rank {self.consumer.rank}: no more came "
                f"within {short} (LoaderConfig). Producers slower than that, or a stream "
                "window (ReceiverConfig.window) too small for the refs a rank holds unacked "
                "((grad_accum + 1) x batch_size)"
            )
            if self.short_batches == 1:
                warnings.warn(message + "; later short batches are logged", stacklevel=4)
            else:
                log.info("%s (short batch %d)", message, self.short_batches)
        return refs

    def _lease_refs(self, count: int, wait: float, *, min_refs: int = 1) -> list[SampleRef]:
        """``consumer.lease(count, timeout=wait, min_refs=...)``; [] when it finds a stream
        producer lost."""
        try:
            return self._ledger(
                self.consumer.lease, count, timeout=wait, min_refs=min(min_refs, count)
            )
        except ProducerLostError as exc:
            self._producer_lost(exc)
            return []

    def _producer_lost(self, exc: ProducerLostError) -> None:
        # Raised once per loss, before anything is leased: the refs of the lost producer
        # are committed, so the run goes on without it and trains them once it is back
        # (a blip longer than the heartbeat timeout) or, from the ledger, once it ends.
        consumer = self.consumer
        log.warning(
            "run %r, rank %d: stream producer %r is lost (%s); the loader goes on leasing: "
            "its committed refs stay in the ledger and are trained once it is back or the "
            "stream ends",
            consumer.run_id,
            consumer.rank,
            exc.producer_id,
            exc,
        )

    def _drained(self) -> bool:
        """Nothing more will come unless refs this consumer holds are nacked."""
        consumer = self.consumer
        if consumer.finished:
            return True
        return (
            consumer.producers_done
            and next(consumer.state.pending_for(consumer.rank), None) is None
        )

    def _executor(self) -> ThreadPoolExecutor:
        # One thread: leases and acks run in the order they were given.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="feature-prefetch")
        return self._pool

    def _lease_ahead(self) -> None:
        """Start the lease ahead in the thread, with the acks given since the last one and
        the refs of a short batch, which it fills."""
        acks, self._unsent = self._unsent, []
        written: Future[None] | None = None
        if acks:
            written = Future()
            self._acks.append(written)
        self._ahead_acks = (acks, written)
        self._ahead_short, self._short = self._short, []
        self._ahead = self._executor().submit(
            self._lease_and_read, acks, written, self._ahead_short
        )

    def _lease_and_read(
        self,
        acks: list[tuple[list[SampleRef], int]],
        written: Future[None] | None,
        short: list[SampleRef],
    ) -> tuple[list[_Read], list[SampleRef]]:
        # Only what is ready now: the training thread takes a batch it has to wait for
        # itself, through _lease. One lease for the `prefetch` batches, split in order
        # (the batches a lease per batch would have made), in the acks' transaction.
        # A short batch at the end waits, unread, for more refs (when batches are filled
        # and more can come); the reads and the refs of that short batch are returned.
        size = self.config.batch_size
        count = size * self.config.prefetch - len(short)
        try:
            refs = short + self._lease_ready(acks, written is not None, count)
        except BaseException as exc:
            if written is not None:
                written.set_exception(exc)
            raise
        if written is not None:
            written.set_result(None)
        full = len(refs)
        if full % size and self._fills_batches and not self.consumer.drained:
            full -= full % size
        reads = [self._read(refs[at : at + size]) for at in range(0, full, size)]
        if reads:  # the lease folded: no ledger read to count
            after = self._batches_after(0, refresh=False, held=len(refs) - full)
            for left, read in enumerate(reversed(reads)):
                read.remaining, read.counted = None if after is None else after + left, True
        return reads, refs[full:]

    def _lease_ready(
        self,
        acks: list[tuple[list[SampleRef], int]],
        with_acks: bool,
        count: int,
    ) -> list[SampleRef]:
        """Up to ``count`` refs ready now, in the transaction of ``acks`` when ``with_acks``;
        again, after a log line, when a stream producer is found lost (that is raised
        before anything is written). From a stream still open that does not hold all
        ``count`` now, when batches are filled, the acks go first (their credits let the
        producers send) and the lease waits a little (``min(batch_wait_s, 0.5 s)``) for
        all ``count``: from a stream that trickles, one lease row for the batches ahead,
        not one per trickle."""
        consumer = self.consumer
        gather = self._fills_batches and consumer.stream is not None and count > 1
        for attempt in range(_LOSSES_AT_ONCE + 1):
            try:
                if gather and not consumer.stream.exhausted and not self._all_ready(count):
                    if with_acks:
                        self._ledger(consumer.ack_many, acks)
                        with_acks = False  # written: a retry after a loss leases only
                    wait = self.config.batch_wait_s
                    wait = _POLL_S if wait is None else min(wait, _POLL_S)
                    return self._ledger(consumer.lease, count, timeout=wait, min_refs=count)
                if with_acks:
                    return self._ledger(consumer.ack_and_lease, acks, count)
                return self._ledger(consumer.lease, count, timeout=0)
            except ProducerLostError as exc:
                if attempt == _LOSSES_AT_ONCE:
                    raise
                self._producer_lost(exc)
        raise AssertionError("unreachable")

    def _all_ready(self, count: int) -> bool:
        """Whether the stream's receiver holds ``count`` refs now (its ``stats()``, where it
        has one): then the lease ahead needs no wait, and its acks share its transaction."""
        stats = getattr(self.consumer.stream, "stats", None)
        if stats is None:
            return False
        now = stats()
        return now.received - now.delivered >= count

    def _take_ahead(self, *, wait: bool = False) -> None:
        """Move what the lease ahead read into the ready batches: when none is left, or
        with ``wait`` (then it waits for the lease ahead to end)."""
        if self._ahead is not None and (wait or not self._ready):
            ahead, self._ahead = self._ahead, None
            written = self._ahead_acks[1]
            try:
                reads, short = ahead.result()
            except BaseException:
                self._short = self._ahead_short  # still leased: the next lease fills them
                if written is not None and written in self._acks and written.done():
                    self._acks.remove(written)  # its failure is raised here: not again
                raise
            self._ready.extend(reads)
            self._short = short
            if short and self._short_since is None:
                self._short_since = time.monotonic()

    def _send_acks(self) -> None:
        """Pass the acks not yet written to the thread, as one transaction."""
        if self._unsent:
            acks, self._unsent = self._unsent, []
            self._acks.append(self._executor().submit(self._ledger, self.consumer.ack_many, acks))

    def _raise_failed_acks(self) -> None:
        done = [f for f in self._acks if f.done()]
        if not done:
            return
        self._acks = [f for f in self._acks if f not in done]
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
