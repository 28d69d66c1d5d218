"""The Consumer's leasing: what this rank may lease now, from the fold or the stream.

Leases come, in this order, from the leases a restarted rank reclaimed
(:meth:`Consumer.rejoin`), from requeued work in the fold, then from new
commits: the fold's pending ones, or the refs a stream delivers (with a stream,
its producers' refs come through it; the fold gives only requeued work until the
stream is exhausted). The wait for refs is :meth:`Consumer.lease`'s.
"""

from __future__ import annotations

import itertools
import time

from dataflow.live._consumer_writes import _POLL_S, _FencedWrites, _locked
from dataflow.model._errors import CommitOutcomeUnknownError, CorruptLedgerError, StreamIdleError
from dataflow.model._events import Kind
from dataflow.model._refs import SampleRef


class _Leasing(_FencedWrites):
    """Leasing, the stream's end, the leases a rejoin reclaims, and whether this rank is done."""

    #: Ids still leased to this consumer id when it joined its fencing epoch (a restarted
    #: rank's unfinished leases): the next lease() calls hand them out first. Set on joining.
    _reclaimed: tuple[str, ...] = ()
    #: Producers whose stream this consumer's receiver was told had ended.
    _marked_closed: set[str]

    # -- whether this rank is done ---------------------------------------------
    @property
    @_locked
    def drained(self) -> bool:
        """True when no more leases can come to this rank: producers done, its queue empty.

        Samples this consumer still holds (leased, not yet acked) do not count:
        a trainer that accumulates gradients can be drained while it holds the
        last micro-batches. Leases a restarted rank reclaimed (:meth:`rejoin`) and
        has not handed out again do: they are still to come.
        """
        if self._still_reclaimed() or not self._share_fixed():
            return False
        return next(self.state.pending_for(self.rank), None) is None

    @property
    @_locked
    def producers_done(self) -> bool:
        """No producer this rank waits for is still open: every producer that committed
        has closed (with a stream: the stream ended), and so has every one named in
        ``producers``. As of the events folded so far (:meth:`refresh` folds new ones)."""
        done = self.state.producers_done if self.stream is None else self.stream.exhausted
        return done and self.producers <= self.state.closed

    def _share_fixed(self) -> bool:
        """No more work can come to this rank's queue (a nack aside)."""
        if not self.producers_done:
            return False
        # Seeded order: the regenerated samples come back to their places.
        state = self.state
        return not (state.order_seed is not None and state.regenerate)

    @property
    @_locked
    def finished(self) -> bool:
        """True when this rank is drained and has acked or nacked everything it leased."""
        mine = any(owner == self.consumer_id for owner in self.state.leased.values())
        return self.drained and not mine

    @_locked
    def remaining(self, *, refresh: bool = True) -> int | None:
        """Samples this rank will still lease, once that number is fixed; else None.

        It is fixed when no more work can come to this rank: every producer closed
        (a stream: every producer's stream ended and was drained) and, in a seeded
        order, nothing is waiting for regeneration. A nack (features gone, a failed
        step) can still put a sample back after that. Folds new events first;
        ``refresh=False`` counts from the events folded so far, without reading the
        ledger (right after a :meth:`lease`, which folded them).
        """
        if refresh:
            self.refresh()
        else:
            self._fencing_epoch()
        if not self._share_fixed():
            return None
        return self.state.pending_count(self.rank)

    @_locked
    def refresh(self) -> None:
        """Fold new events; raise StaleEpochError if a newer consumer fenced this one off."""
        self._fencing_epoch()
        self._catch_up()
        self._check_not_fenced()

    # -- one lease -------------------------------------------------------------
    def _lease_once(
        self, max_refs: int, deadline: float | None, min_refs: int = 1
    ) -> list[SampleRef]:
        with self._lock:
            if self._deferred_loss is not None:  # found while gathering the last lease
                loss, self._deferred_loss = self._deferred_loss, None
                raise loss
            self._catch_up()
            self._check_not_fenced()  # even with nothing to lease, so a zombie learns at once
            held = self._still_reclaimed()
            if held:  # before the seeded-order gate: these were leased already
                refs = self._committed_refs(held[:max_refs])
                self._reclaimed = tuple(held[max_refs:])
                return refs
            if self._seeded_order_waits():
                return []
            candidates = self._ready_to_lease(max_refs)
            if candidates:
                return self._lease_ids(candidates, streamed=False)
            stream = self.stream
            if stream is None or self._stream_ended():
                return []
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._unmarked_closed():
                # A closed producer still speaks here: look again once it may have gone silent.
                wait = _POLL_S if wait is None else min(wait, _POLL_S)
        try:
            # Without the lock (a receiver is thread-safe): acks from other threads, whose
            # credits let the producers send, go on while this waits.
            received = stream.receive(max_refs, timeout=wait)
        except StreamIdleError:
            if deadline is None:
                raise
            return []  # lease(timeout=...) answers an idle stream with no refs
        if not received:
            return []
        received = self._gather(received, max_refs, deadline, min_refs)
        with self._lock:
            return self._lease_ids([r.sample_id for r in received], streamed=True)

    #: An error the stream raised while a lease gathered refs (a producer found lost): the
    #: refs gathered are leased, and the next lease raises it before anything is leased.
    _deferred_loss: BaseException | None = None

    def _gather(
        self, received: list[SampleRef], max_refs: int, deadline: float | None, min_refs: int
    ) -> list[SampleRef]:
        """``received`` and more from the stream until ``min_refs`` came, ``deadline``
        passed, or the stream ended or went idle (``lease(min_refs=...)``)."""
        received = list(received)
        stream = self.stream
        assert stream is not None
        while len(received) < min_refs:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                break
            with self._lock:
                if self._stream_ended():
                    break
                if self._unmarked_closed():
                    wait = _POLL_S if wait is None else min(wait, _POLL_S)
            try:
                more = stream.receive(max_refs - len(received), timeout=wait)
            except StreamIdleError:
                break
            except Exception as exc:  # a lost producer: lease what came, raise it next
                self._deferred_loss = exc
                break
            received += more
        return received

    def _lease_ids(self, sample_ids: list[str], *, streamed: bool) -> list[SampleRef]:
        take: list[str] = []
        try:
            with self._write("lease") as tx:
                take = self._deliverable(sample_ids)
                refs = self._committed_refs(take)  # before anything is leased
                tx.append(self._events(Kind.LEASE, take, tx.epoch))
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(take, lambda s: self.state.leased.get(s) == self.consumer_id):
                self._unreceive(sample_ids if streamed else [])
                self._reclaimed += tuple(take)  # if it landed, the next lease hands them out
                raise
        except BaseException:
            self._unreceive(sample_ids if streamed else [])
            raise
        self._leased_afresh(take)
        if streamed:
            self._delivered(sample_ids, take)
        return refs

    def _deliverable(self, sample_ids: list[str]) -> list[str]:
        """The ids of ``sample_ids`` to lease: a streamed ref may already be leased or
        trained (it also came back through reconcile); it is delivered once."""
        return [s for s in dict.fromkeys(sample_ids) if self.state.is_pending(s)]

    def _delivered(self, received: list[str], take: list[str]) -> None:
        """Once the lease of ``take``, out of the ``received`` refs, landed: the stream's
        slots of the leased ones come back with their acks, those of the others now."""
        self._from_stream.update(take)
        if len(received) > len(take):
            self.stream.credit(len(received) - len(take))  # type: ignore[union-attr]

    def _committed_refs(self, sample_ids: list[str]) -> list[SampleRef]:
        """The refs the ledger committed for ``sample_ids`` (one ledger read for those not in
        memory); CorruptLedgerError naming the first that is unreadable."""
        try:
            found = self.state.refs(sample_ids)
        except (ValueError, TypeError, KeyError, RecursionError):
            found = {}  # which one: read them one by one
        refs = []
        for sample_id in sample_ids:
            ref = found.get(sample_id)
            if ref is None:
                try:
                    ref = self.state.ref(sample_id)
                except (ValueError, TypeError, KeyError, RecursionError) as exc:
                    raise CorruptLedgerError(
                        f"the commit of {sample_id!r} in run {self.run_id!r} of "
                        f"{self.ledger.safe_url} cannot be read ({type(exc).__name__}: "
                        f"{str(exc)[:200]}): the ledger is damaged; nothing was leased. "
                        "`dataflow replay --ledger URL --run RUN` lists what is broken"
                    ) from exc
            if ref.sample_id != sample_id:
                raise CorruptLedgerError(
                    f"the commit of {sample_id!r} in run {self.run_id!r} of "
                    f"{self.ledger.safe_url} holds the ref of {ref.sample_id!r}: the ledger is "
                    "damaged; nothing was leased"
                )
            refs.append(ref)
        return refs

    def _unreceive(self, received: list[str]) -> None:
        """Give back the stream slots of refs received for a lease that did not land; they
        stay pending in the ledger, leased from it once the stream is exhausted."""
        if received:
            self.stream.credit(len(received))  # type: ignore[union-attr]

    def _leases_from_ledger(self) -> bool:
        """Whether this consumer leases from the fold alone (no stream, or an exhausted one)."""
        return self.stream is None or self.stream.exhausted

    def _seeded_order_waits(self) -> bool:
        # Seeded order: the dataset is complete, and sorted, once every producer closed
        # and every sample to regenerate is back in its place.
        state = self.state
        return state.order_seed is not None and (not self._producers_done() or state.regenerate)

    def _producers_done(self) -> bool:
        """Every producer that committed closed, and so did every one this run waits for."""
        return self.state.producers_done and self.producers <= self.state.closed

    def _ready_to_lease(self, max_refs: int) -> list[str]:
        """Up to ``max_refs`` of this rank's pending ids in the fold; only requeued ones
        while refs still come from a stream (those come through it)."""
        pending = self.state.pending_for(self.rank, requeued_only=not self._leases_from_ledger())
        return list(itertools.islice(pending, max_refs))

    # -- the stream's end -------------------------------------------------------
    def _mark_closed_producers(self) -> None:
        """On joining an epoch: end the stream of every producer the ledger has closed.

        Their EOFs went to an earlier receiver, or never came. Only here: while
        this consumer runs, a producer's stream ends with its EOF, which follows
        its last ref on the wire. A close read from the ledger meanwhile may
        overtake refs still in flight, and a stream that ended early would let
        a trainer settle its last batches before they arrive. A producer that
        streamed nothing (its close says so: a Trainer's regeneration) is no
        stream's producer, and is not counted toward ``expected_producers``.
        """
        if self.stream is not None:
            for producer_id in self._unmarked_closed():
                self.stream.mark_producer_closed(producer_id)
                self._marked_closed.add(producer_id)

    def _unmarked_closed(self) -> set[str]:
        """Streaming producers the ledger has closed and this consumer's stream not yet."""
        return self.state.closed - self.state.unstreamed - self._marked_closed

    def _stream_ended(self) -> bool:
        """Whether the stream is exhausted, once closed producers that went silent count.

        A producer whose close the ledger holds, whose end of stream did not
        arrive here and that no live connection speaks for here, has nothing
        more on the wire for this consumer (its close follows its stream's
        end): the receiver counts it closed. Its end of stream can miss a
        running consumer when the consumer's process restarted after the old
        one acknowledged it and joined before the close was recorded.
        """
        stream = self.stream
        assert stream is not None
        if not stream.exhausted:
            for producer_id in sorted(self._unmarked_closed()):
                if stream.mark_producer_closed_if_silent(producer_id):
                    self._marked_closed.add(producer_id)
        return stream.exhausted

    # -- leases reclaimed on joining ---------------------------------------------
    def _reclaim(self) -> tuple[str, ...]:
        """Queue what this consumer id still holds in the epoch, in lease order, to hand out."""
        mine = self.consumer_id
        self._reclaimed = tuple(sid for sid, holder in self.state.leased.items() if holder == mine)
        return self._reclaimed

    def _leased_afresh(self, take: list[str]) -> None:
        """``take`` was just leased by a write of this consumer and handed out: none of it is
        reclaimed any more. (A lease in doubt that had rolled back left its ids among the
        reclaimed; leased again since, they must not be handed out a second time.)"""
        if self._reclaimed and take:
            taken = set(take)
            self._reclaimed = tuple(s for s in self._reclaimed if s not in taken)

    def _still_reclaimed(self) -> list[str]:
        """The reclaimed ids not handed out yet that this consumer id still holds."""
        mine = self.consumer_id
        return [s for s in self._reclaimed if self.state.leased.get(s) == mine]
