"""Consumer: a trainer rank's role, leasing, acking and recording checkpoints of what
producers committed.

Each write is one ledger transaction (see :mod:`dataflow.live._args`), fenced by
the consumer's fencing epoch, which :meth:`Consumer.resume` starts. The class
is put together from one module per concern:

- :mod:`dataflow.live._consumer_writes`: the live fold (a RunView), the lock, fenced writes;
- :mod:`dataflow.live._consumer_resume`: resume and rejoin (fencing epochs, reconcile);
- :mod:`dataflow.live._consumer_leases`: what a lease takes, from the fold or the stream;
- :mod:`dataflow.live._consumer_acks`: acks, nacks and lost reports;
- :mod:`dataflow.live._consumer_checkpoints`: recording and removing checkpoints;
- :mod:`dataflow.live._consumer_exclude`: excluding samples from the run, including them again;
- here: construction, the wait of a lease, ack_and_lease, data epochs, close.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from dataflow.interfaces._store import FeatureStore
from dataflow.interfaces._stream import RefReceiver
from dataflow.live._args import _check_roles_args, check_timeout
from dataflow.live._consumer_acks import _Acks
from dataflow.live._consumer_args import _check_int, _check_producers
from dataflow.live._consumer_checkpoints import _CheckpointRecords
from dataflow.live._consumer_exclude import _Exclusions
from dataflow.live._consumer_resume import _Resuming
from dataflow.live._consumer_writes import _POLL_S, _locked
from dataflow.live._metrics import MetricsServer, serve_run_metrics
from dataflow.live._seeded_stream import _SeededStream
from dataflow.live._view import RunView
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    InvalidArgumentError,
    LedgerStateError,
    OperationalError,
    StreamIdleError,
)
from dataflow.model._events import Kind, dump_payload
from dataflow.model._fold import RELEASE_POLICIES
from dataflow.model._refs import SampleRef
from dataflow.recorder._ledger import Ledger, NewEvent, check_id

if TYPE_CHECKING:
    import torch

#: A lease that has waited this long on a run no producer ever committed to or closed
#: warns (the run id may be mistyped), then goes on waiting.
NO_PRODUCER_WARNING_S = 30.0


class Consumer(_SeededStream, _Resuming, _Acks, _CheckpointRecords, _Exclusions):
    """A trainer rank's side of a run: resume, lease, ack, nack, record checkpoints.

    Call :meth:`resume` first: it starts a new fencing epoch (the generation of
    the run's consumers: any older trainer of the run is fenced off) and
    reconciles from a checkpoint. Then lease
    refs, train on them, and ack them at the optimizer boundary.

    ``release_policy``: ``"on_checkpoint"`` (default) frees a sample's features
    once it is trained into a durable checkpoint; ``"on_ack"`` right after
    its ack; ``"never"`` keeps them (offline datasets iterated many times).

    Multi-rank: requeued work is split across ranks deterministically. Rank 0
    appends the resume and checkpoint events; with torch.distributed
    initialized the ranks synchronize through collectives, otherwise the
    caller must make rank 0 resume before the others and record a checkpoint
    only after every rank's acks up to that step have returned. A rank whose process
    restarted alone calls :meth:`rejoin` instead of :meth:`resume`.

    ``order_seed``: lease in a reproducible order. Without a stream: the committed
    dataset, sorted by a keyed hash, once every producer closed. With a ``stream``: each
    named producer's own sequence of samples (its k-th commit), round robin over
    ``producers`` (required then: every producer of the run), the seed shuffling each
    round; a rank waits for the producer whose turn it is, and a lease takes
    ``max_refs`` or nothing until the producers closed (``live/_seeded_stream.py``).

    ``producers``: the ids of the producers this run waits for. The rank is not
    drained (and a seeded order does not start) before each of them has closed,
    even one that has not committed anything yet: a producer that starts late,
    or is slow to produce its first sample. Without it the run waits only for
    the producers that committed, which the ledger knows of.

    ``metrics_port``: serve this run's Prometheus metrics on that port (127.0.0.1
    unless ``metrics_host`` says otherwise; docs/operations.md, "Metrics");
    :meth:`close` stops the endpoint.

    Its methods may be called from several threads (a loader leasing ahead in one,
    the training loop acking in another): they run one at a time under the
    consumer's lock, which a lease waiting for refs holds while it waits. Read
    ``state`` from the thread that calls the methods.
    """

    def __init__(
        self,
        ledger: Ledger,
        store: FeatureStore,
        *,
        run_id: str,
        consumer_id: str,
        rank: int = 0,
        world_size: int = 1,
        stream: RefReceiver | None = None,
        release_policy: str = "on_checkpoint",
        max_attempts: int = 3,
        order_seed: int | None = None,
        producers: Iterable[str] | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
    ) -> None:
        _check_roles_args(ledger, store, run_id)
        self.consumer_id = check_id("consumer_id", consumer_id)
        #: The producer ids this run waits for (``producers``): empty, only those that committed.
        self.producers: frozenset[str] = _check_producers(producers)
        _check_int("world_size", world_size, minimum=1)
        _check_int("rank", rank)
        if rank >= world_size:
            raise InvalidArgumentError(f"rank must be < world_size ({world_size}), got {rank}")
        if release_policy not in RELEASE_POLICIES:
            raise InvalidArgumentError(
                f"release_policy must be one of {RELEASE_POLICIES}, got {release_policy!r}"
            )
        _check_int("max_attempts", max_attempts, minimum=1)
        if stream is not None and not isinstance(stream, RefReceiver):
            raise ArgumentTypeError(f"stream must be a RefReceiver, got {type(stream).__name__}")
        if order_seed is not None:
            _check_int("order_seed", order_seed)
        self.order_seed = order_seed
        self.ledger = ledger
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self.release_policy = release_policy
        self.max_attempts = max_attempts
        #: The live fold of the run (``state``), brought up to date on every write.
        self._view = RunView(ledger, run_id)
        self._lock = threading.RLock()
        self.epoch: int | None = None
        self._before_checkpoint = []
        self._from_stream = set()
        self._marked_closed = set()
        self._start_slots()  # order_seed with a stream: the producers' own sequences
        #: The run's Prometheus metrics endpoint (``metrics_port``, on ``metrics_host``,
        #: default 127.0.0.1); None when not serving. ``metrics.close()`` stops it.
        self.metrics: MetricsServer | None = serve_run_metrics(
            ledger, run_id, store, metrics_port, metrics_host
        )

    # -- leasing -------------------------------------------------------------
    def lease(
        self, max_refs: int, *, timeout: float | None = 0.0, min_refs: int = 1
    ) -> list[SampleRef]:
        """Take up to ``max_refs`` samples: requeued work first, then new commits.

        After :meth:`rejoin` (or a rank > 0 :meth:`resume`), the leases this consumer
        id still held come first, alone in their batches and without new lease events.

        Waits up to ``timeout`` seconds (None: until something comes or this
        rank is drained) for at least one; returns [] when nothing came.
        ``min_refs`` (1 to ``max_refs``): with a stream, once a ref came, go on
        waiting (within ``timeout``) until ``min_refs`` refs came, the stream ended
        or went idle, then lease them all in one transaction: a stream that trickles
        then costs one lease row per ``min_refs`` refs, not one per trickle. Requeued
        work and commits leased from the ledger are taken at once, as with 1.
        After ``NO_PRODUCER_WARNING_S`` (30 s) of waiting on a run to which no
        producer ever committed or closed, or for a producer named in ``producers``
        that never did, it warns once and goes on waiting (the wait counts across
        calls that find nothing, as a loader's short leases do).

        It waits without the consumer's lock, so that other threads' calls go on
        meanwhile: an ack from another thread returns the stream's credits that let
        the producers send what this lease waits for.
        """
        with self._lock:
            self._fencing_epoch()
        _check_int("max_refs", max_refs, minimum=1)
        _check_int("min_refs", min_refs, minimum=1)
        if min_refs > max_refs:
            raise InvalidArgumentError(
                f"min_refs={min_refs} is more than max_refs={max_refs}: pass a min_refs "
                "between 1 and max_refs"
            )
        check_timeout(timeout, none_means="wait until something comes or this rank is drained")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            refs = self._lease_once(max_refs, deadline, min_refs)
            if refs or self.drained:
                self._idle_since, self._idle_warned = None, False
                return refs
            now = time.monotonic()
            self._warn_if_waiting_on_nobody(now)
            if deadline is not None and now >= deadline:
                return []
            time.sleep(_POLL_S)

    #: Since when leases have found nothing (across calls: a loader leases in short waits),
    #: and whether that wait was warned about.
    _idle_since: float | None = None
    _idle_warned = False

    def _warn_if_waiting_on_nobody(self, now: float) -> None:
        if self._idle_since is None:
            self._idle_since = now
        waited = now - self._idle_since
        if self._idle_warned or waited < NO_PRODUCER_WARNING_S:
            return
        why = self._waiting_on_nobody()
        if why is not None:
            self._idle_warned = True
            warnings.warn(
                f"lease() has waited {waited:.0f} s on run {self.run_id!r} of "
                f"{self.ledger.safe_url}, {why}; still waiting.",
                stacklevel=3,
            )

    @_locked
    def _waiting_on_nobody(self) -> str | None:
        """Why a long wait may be for producers that never come (a wrong run or producer
        id), or None when the producers the wait is for have shown up in the ledger."""
        state = self.state
        if not (state.producers or state.closed):
            return f"to which no producer ever committed or closed. {self._known_runs_hint()}"
        unseen = sorted(self.producers - state.producers - state.closed)
        if not unseen:
            return None
        known = ", ".join(repr(p) for p in sorted(state.producers | state.closed)[:20])
        return (
            f"for the producers {unseen} named in producers=, which never committed to or "
            f"closed this run; if a name is wrong, check it against the run's producers: {known}"
        )

    @_locked
    def ack_and_lease(
        self, acks: Iterable[tuple[Iterable[SampleRef | str], int]], max_refs: int
    ) -> list[SampleRef]:
        """:meth:`ack_many` of ``acks``, then :meth:`lease` of up to ``max_refs`` refs ready
        now (``timeout=0``), in one ledger transaction.

        A loader that leases ahead while the current batch trains writes the acks
        of the steps since its last lease with the next one: one write instead of
        two (the acks of all its steps in one ACK row, the lease in one LEASE row).
        The acks are checked as ``ack_many`` checks them, and written whether
        or not anything is leased; if the write fails, neither is in the ledger.
        While refs still come from a stream, those it holds now are taken before
        the transaction, as ``lease`` would take them. With leases reclaimed by
        :meth:`rejoin` to hand out, or after a write in doubt, it is ``ack_many`` and
        then ``lease``: two transactions, the same outcome. A call that failed with
        ``OperationalError`` is made again as it was (docs/reliability.md): acks that
        landed are not written twice, a lease that landed is handed out by it.
        """
        self._fencing_epoch()
        steps, ids = self._checked_acks(acks)
        _check_int("max_refs", max_refs, minimum=1)
        if not steps or self._in_doubt or self._still_reclaimed():
            self.ack_many(steps)  # settles acks in doubt: the retry of a failed ack_and_lease
            try:
                return self.lease(max_refs, timeout=0)
            except OperationalError:
                # The acks are in: the same call made again, as a failed call should be,
                # finds them landed instead of refusing them as "not leased".
                self._in_doubt = frozenset(ids)
                raise
        received = self._received_now(max_refs, steps, ids)
        release: list[str] = []
        take: list[str] = []
        refs: list[SampleRef] = []
        try:
            with self._write("ack+lease") as tx:
                # The acked samples are this consumer's leases, never pending: the acks
                # and the lease append together, and one read folds them.
                acked = self._ack_events(tx, steps, ids, release)
                if received:
                    take = self._deliverable(received)
                elif not self._seeded_order_waits():
                    take = self._ready_to_lease(max_refs)
                refs = self._committed_refs(take)
                tx.append(
                    [
                        *acked,
                        *self._events(Kind.LEASE, take, tx.epoch),
                    ]
                )
                self._sync(tx)
        except CommitOutcomeUnknownError:
            leased = set(take)
            if not self._landed(
                ids + take,
                lambda s: not self._lease_ended(s) if s in leased else self._trained_by_an_ack(s),
            ):
                self._unreceive(received)
                # Settled by the retry: ack_many's of the acks, the next lease's of the lease.
                self._in_doubt, self._reclaimed = frozenset(ids), (*self._reclaimed, *take)
                raise
        except BaseException:
            self._unreceive(received)
            raise
        self._acked(ids, release)
        self._leased_afresh(take)
        if received:
            self._delivered(received, take)
        return refs

    def _received_now(
        self, max_refs: int, steps: list[tuple[list[str], int]], ids: list[str]
    ) -> list[str]:
        """The ids of the refs the stream holds now, where a lease would take from it (no
        requeued work first, the stream not exhausted, no seeded order waiting); else [].

        Only once the fold allows the acks of ``steps``: refs taken off the stream for a
        write that fails go back to the ledger's pending ones, out of the stream's order.
        """
        if self._leases_from_ledger():
            return []
        self._catch_up()
        self._check_acks_allowed(steps, ids)
        if self._seeded_order_waits() or self._ready_to_lease(max_refs) or self._stream_ended():
            return []
        try:
            received = self.stream.receive(max_refs, timeout=0)  # type: ignore[union-attr]
        except StreamIdleError:
            return []
        return [ref.sample_id for ref in received]

    def batches(
        self, batch_size: int, *, timeout: float | None = None
    ) -> Iterator[list[SampleRef]]:
        """Yield leased batches until this rank is drained (or a lease times out)."""
        while True:
            refs = self.lease(batch_size, timeout=timeout)
            if refs:
                yield refs
            elif self.drained or timeout is not None:
                return

    def load(
        self, ref: SampleRef, *, names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """The features of a leased ref, from this consumer's store."""
        return self.store.get(ref, names=names)

    # -- run control (rank 0) and closing ------------------------------------
    @_locked
    def start_data_epoch(self, *, seed: int | None = None) -> int:
        """Make every live committed sample pending again, in a seeded order (rank 0).

        For offline datasets trained for several passes (use release_policy
        "never"). Every leased sample must be acked or nacked first.
        """
        if seed is not None:
            _check_int("seed", seed)
        if self.rank != 0:
            raise LedgerStateError("only rank 0 starts a data epoch; the other ranks follow it")
        with self._write("data epoch") as tx:
            if self.state.leased:
                raise LedgerStateError(
                    f"{len(self.state.leased)} samples are still leased in run {self.run_id!r}; "
                    "ack or nack them before starting a data epoch"
                )
            number = self.state.data_epoch + 1
            payload = {"data_epoch": number, "seed": number if seed is None else seed}
            tx.append(
                [
                    NewEvent(
                        Kind.DATA_EPOCH,
                        self.consumer_id,
                        epoch=tx.epoch,
                        payload=dump_payload(payload),
                    )
                ]
            )
            self._sync(tx)
        return number

    @_locked
    def close(self) -> None:
        """Close the stream and stop the metrics endpoint, if any; the ledger stays open."""
        try:
            if self.stream is not None:
                self.stream.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
