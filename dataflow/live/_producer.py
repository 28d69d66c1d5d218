"""Producer: the role that puts a sample's features into a store and commits its ref.

A commit is one ledger transaction (see :mod:`dataflow.live._args`); the features
go into the store before it, and are deleted again when it raises.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dataflow.interfaces._store import FeatureStore
from dataflow.interfaces._stream import RefSender
from dataflow.live._args import _check_roles_args, check_wait
from dataflow.live._backpressure import (
    ProducerGate,
    Watermarks,
    tensors_nbytes,
)
from dataflow.live._metrics import MetricsServer, serve_run_metrics
from dataflow.live._outbox import RefOutbox
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    LedgerStateError,
)
from dataflow.model._events import Kind, dump_payload
from dataflow.model._ref_codec import ref_json
from dataflow.model._ref_codec import ref_json as _ref_json  # noqa: F401 (the name tests pin)
from dataflow.model._refs import SampleRef, ref_from_ledger, validate_sample_id
from dataflow.recorder._ledger import Ledger, NewEvent, check_id

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dataflow")


class Producer:
    """Puts features into a store and commits their refs to the run's ledger.

    Give each concurrently running producer its own stable ``producer_id``:
    a run is finished when every producer that claimed an id has closed (and every
    one that its consumers name in ``Consumer(producers=...)``, claimed or not).

    A producer id is held by one process at a time: a new Producer claims its id
    (a CLAIM event, with a new producer ``epoch``, this host and pid, and the
    store's ``open_uri``), and from then on the ledger refuses the commits and
    the close of the id's previous holder with ProducerFencedError. Restart a
    producer with its old id; a presumed-dead predecessor that is still alive
    can then neither add samples nor end the run early. After ``close()`` a
    Producer emits nothing more (``regenerate`` still works); a new one (which claims
    the id again) reopens it.

    ``backpressure``: a :class:`Watermarks`; an emit that would take the run's
    un-trained features in the store above a high mark waits until they are
    below the low marks (``emit(..., block=False)`` raises BackpressureError
    instead). ``metrics_port``: serve the run's Prometheus metrics
    (:class:`RunMetrics`) on this port, on ``metrics_host`` (default
    ``127.0.0.1``, loopback only); ``close()`` stops serving them.
    """

    def __init__(
        self,
        ledger: Ledger,
        store: FeatureStore,
        *,
        run_id: str,
        producer_id: str = "producer",
        stream: RefSender | None = None,
        backpressure: Watermarks | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
    ) -> None:
        _check_roles_args(ledger, store, run_id)
        if stream is not None and not isinstance(stream, RefSender):
            raise ArgumentTypeError(f"stream must be a RefSender, got {type(stream).__name__}")
        self.ledger = ledger
        self.store = store
        self.run_id = run_id
        self.producer_id = check_id("producer_id", producer_id)
        if stream is not None:
            stream.bind_producer(self.producer_id)
        self.stream = stream
        self._closed = False
        self._gate = (
            None
            if backpressure is None
            else ProducerGate(ledger, run_id, self.producer_id, backpressure)
        )
        self._outbox = None if stream is None else RefOutbox(stream, run_id, self.producer_id)
        #: The metrics endpoint (``metrics_port``), None when not serving.
        self.metrics: MetricsServer | None = serve_run_metrics(
            ledger, run_id, store, metrics_port, metrics_host
        )
        # Last: a Producer that fails to start claims nothing (a claimed id is waited for).
        try:
            #: This process's hold on ``producer_id`` (see the class docstring).
            self.epoch = self._claim()
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise

    def _claim(self) -> int:
        """Take ``producer_id`` in the ledger: a new producer epoch, fencing the last one."""
        payload = dump_payload(
            {"host": socket.gethostname(), "pid": os.getpid(), "store": self.store.open_uri}
        )
        try:
            with self.ledger.write(self.run_id, "claim") as tx:
                return tx.claim_producer(self.producer_id, payload)
        except CommitOutcomeUnknownError as exc:
            # Claimed or not, a second claim holds the id: one that landed is fenced by it.
            log.warning("%s; claiming producer %r once more", exc, self.producer_id)
        with self.ledger.write(self.run_id, "claim") as tx:
            return tx.claim_producer(self.producer_id, payload)

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerStateError(
                f"producer {self.producer_id!r} of run {self.run_id!r} is closed: it commits "
                "nothing more (consumers may have taken the run as finished). To produce "
                "again, make a new Producer with this id: it claims the id and reopens it"
            )

    def emit(
        self,
        sample_id: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        metadata: Mapping[str, Any] | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> SampleRef | None:
        """Store ``tensors`` and commit the ref; None when ``sample_id`` was already committed.

        An id the ledger already holds is answered without touching the
        store, so re-emitting after a restart costs one read and leaks nothing.
        An emit that returns was committed; one that raises was not (a ref
        the stream would refuse, e.g. with too much metadata for a frame,
        raises BadFrameError before the commit), except with
        CommitOutcomeUnknownError (see ``commit``): emitting the id again
        then answers None if it was.

        With ``backpressure``, an emit at the high mark waits until the
        backlog is below the low marks, at most ``timeout`` seconds (None: as
        long as it takes); ``block=False`` does not wait. Either way an emit
        it cannot wait for raises BackpressureError before anything is stored.
        """
        return self.emit_many([(sample_id, tensors, metadata)], block=block, timeout=timeout)[0]

    def emit_many(
        self,
        samples: Iterable[tuple[Any, ...]],
        *,
        block: bool = True,
        timeout: float | None = None,
    ) -> list[SampleRef | None]:
        """Emit ``(sample_id, tensors)`` or ``(sample_id, tensors, metadata)`` items.

        The batch costs one store ``put_many`` (the shared directory store fsyncs
        each of its directories once for it), one ledger transaction and one
        ``send_many`` to the stream; the commit follows the put, which returns once
        the features are durable. None for ids already committed. An id given
        twice is committed as its last item (None for the earlier ones), as ``commit``
        does.
        ``block`` and ``timeout``: as for :meth:`emit`, the new ids counted together.
        """
        check_wait(block, timeout)
        self._check_open()
        if not isinstance(samples, Iterable) or isinstance(samples, str | bytes | Mapping):
            raise ArgumentTypeError(
                "emit_many takes an iterable of (sample_id, tensors[, metadata]) items, got "
                f"{type(samples).__name__} {samples!r:.100}"
            )
        items = []
        for item in samples:
            if not isinstance(item, tuple | list) or len(item) not in (2, 3):
                raise ArgumentTypeError(
                    f"emit_many takes (sample_id, tensors[, metadata]) items, got {item!r:.100}"
                )
            validate_sample_id(item[0])
            items.append(item if type(item) is tuple else tuple(item))
        known = self.ledger.commits(self.run_id, [item[0] for item in items])
        if self._gate is not None:
            # An id given twice is stored once (the last put wins): it counts once.
            fresh = {item[0]: item for item in items if item[0] not in known}
            if fresh:
                added = sum(tensors_nbytes(item[1]) for item in fresh.values())
                # While it waits, the refs the stream did not take go out as its window
                # opens: the backlog it waits on drains only once consumers receive them.
                idle = None if self._outbox is None else self._outbox.send_waiting
                self._gate.wait(len(fresh), added, block=block, timeout=timeout, idle=idle)
        positions = [position for position, item in enumerate(items) if item[0] not in known]
        # One put_many: a store that batches does (the shared directory fsyncs each of
        # its directories once for the batch, Mooncake makes a few round trips). It
        # returns once every file is durable, so the commit below never names features
        # a crash could lose; when it raises, it has kept none of what it put.
        refs = self.store.put_many([items[position] for position in positions])
        # As commit answers: an id given twice is committed as its last item, None for
        # the earlier ones.
        results: list[SampleRef | None] = [None] * len(items)
        for position, ref in zip(positions, self.commit(refs), strict=True):
            results[position] = ref
        return results

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef | None]:
        """Commit refs whose features are already in the store, in one transaction.

        Returns each ref, or None where its id was already committed; those
        fresh features are deleted again (or, where this put superseded the
        committed ones in the store, committed as the next revision; if that
        write fails it is logged, and a consumer later reports the sample lost
        and it is regenerated). If the commit fails, or the stream
        would refuse a ref (``RefSender.check``), the features of every ref
        the ledger does not hold are deleted and the error propagates: a call
        that raises committed nothing, one that returns committed everything
        it returned. (A ref the ledger holds was committed by an earlier call
        whose outcome was unknown, see below: its features stay.)

        One exception: when the database fails while committing, it may have
        committed all the same. The commit is then tried once more, and the
        ids found holding these very refs count as committed by this call. If
        that fails too, CommitOutcomeUnknownError propagates and the features
        stay: commit the same refs again once the ledger answers (it returns
        None for those already in), or let ``dataflow gc`` remove them if they
        never were.
        """
        if isinstance(refs, SampleRef) or not isinstance(refs, Iterable):
            raise ArgumentTypeError(
                f"commit takes a list of SampleRefs, got a {type(refs).__name__}: pass [ref]"
            )
        refs = list(refs)
        for ref in refs:
            if not isinstance(ref, SampleRef):
                raise ArgumentTypeError(f"commit takes SampleRefs, got {type(ref).__name__}")
        self._check_open()
        # A later put of the same id supersedes an earlier one: the newest wins.
        newest = {ref.sample_id: ref for ref in refs}
        try:
            self._check_sendable(newest.values())
            payloads = {sid: ref_json(ref) for sid, ref in newest.items()}
            known = self._append_commits(payloads)
        except CommitOutcomeUnknownError:
            raise  # the refs may be committed: their features must stay
        except BaseException:
            self._delete_uncommitted(refs)
            raise
        if not known and len(newest) == len(refs):  # the common case: every ref is new
            self._send(refs)
            return list(refs)
        fresh = [ref for sid, ref in newest.items() if sid not in known]
        if len(newest) < len(refs):
            for ref in refs:
                if newest[ref.sample_id] is not ref:
                    self.store.delete(ref)  # an older put of an id repeated in this batch
        results = [
            ref if newest[ref.sample_id] is ref and ref.sample_id not in known else None
            for ref in refs
        ]
        self._send(fresh)
        # After the fresh refs are committed and sent, so that this call never raises
        # having committed some: a duplicate that cannot be settled is only logged.
        for sid, (revision, payload) in known.items():
            try:
                self._settle_duplicate(newest[sid], revision, ref_from_ledger(payload))
            except Exception as exc:
                log.warning(
                    "sample %r of run %r was committed by another producer first and our put "
                    "may have replaced its features; recording ours failed (%s): if they "
                    "are gone, a consumer reports the sample lost and it is regenerated",
                    sid, self.run_id, exc,
                )  # fmt: skip
        return results

    def _delete_uncommitted(self, refs: list[SampleRef]) -> None:
        """After a failed commit: delete the features of the refs the ledger does not hold.

        A ref an earlier call may have committed (its outcome unknown, and this call the
        retry the docs ask for) keeps its features. When the ledger cannot say, every
        ref's features stay, for ``dataflow gc`` to remove those never committed.
        """
        try:
            held = self.ledger.commits(self.run_id, [ref.sample_id for ref in refs])
        except Exception as exc:
            log.warning(
                "a commit of %d refs to run %r failed, and the ledger cannot say which it "
                "holds (%s): their features stay; `dataflow gc` removes those never committed",
                len(refs), self.run_id, exc,
            )  # fmt: skip
            return
        for ref in refs:
            committed = held.get(ref.sample_id)
            if committed is None or committed[1] != ref_json(ref):
                self.store.delete(ref)

    def _append_commits(self, payloads: dict[str, str]) -> dict[str, tuple[int, str]]:
        """Commit revision 0 of each id the run lacks; what the others hold (see ``commit``).

        After a COMMIT whose outcome is unknown, once more: an id that then holds
        its very payload (the ref's store and generation) and that the first try
        found free was committed by the first try, and counts as new.
        """
        held_before: dict[str, tuple[int, str]] = {}
        try:
            with self.ledger.write(self.run_id, "commit", shared=True) as tx:
                tx.check_producer(self.producer_id, self.epoch)
                held_before = tx.append_first_commits(self.producer_id, payloads, epoch=self.epoch)
            return held_before
        except CommitOutcomeUnknownError as exc:  # raised after the body: held_before is set
            log.warning("%s; committing %d refs once more", exc, len(payloads))
            first = exc
        try:
            with self.ledger.write(self.run_id, "commit", shared=True) as tx:
                tx.check_producer(self.producer_id, self.epoch)
                known = tx.append_first_commits(self.producer_id, payloads, epoch=self.epoch)
        except Exception as exc:
            raise CommitOutcomeUnknownError(
                f"{first}; trying again failed too ({exc}): the features of the "
                f"{len(payloads)} refs are kept. Commit the same refs again once the ledger "
                "answers (None for those already committed); `dataflow gc` removes them if "
                "they never were"
            ) from exc
        return {
            sid: held
            for sid, held in known.items()
            if held[1] != payloads[sid] or sid in held_before
        }

    def _check_sendable(self, refs: Iterable[SampleRef]) -> None:
        """Before a commit: the stream would refuse none of ``refs`` (see RefOutbox.check)."""
        if self._outbox is not None:
            self._outbox.check(refs)

    def _send(self, refs: Sequence[SampleRef]) -> None:
        """Push committed refs to the stream, if any (see RefOutbox.send)."""
        if self._outbox is not None:
            self._outbox.send(refs)

    def _settle_duplicate(self, ours: SampleRef, revision: int, committed: SampleRef) -> None:
        """Another producer committed this id first; keep whichever features are live.

        In a store where a put supersedes older generations, our put may have
        made the committed features stale. Then ours are the only copy: they
        are committed as the next revision instead of being deleted, and a
        consumer that leases the sample gets the live ref.
        """
        if committed.store == ours.store and committed.generation == ours.generation:
            return  # the committed ref is ours (a retried commit)
        if not self._superseded_by(ours, committed):
            self.store.delete(ours)  # theirs is live (or elsewhere): ours was never needed
            return
        with self.ledger.write(self.run_id, "commit") as tx:
            tx.check_producer(self.producer_id, self.epoch)
            now = tx.commits([ours.sample_id]).get(ours.sample_id)
            if now is not None and now[0] == revision:
                tx.append([self._commit_event(ours, revision + 1)])

    def _superseded_by(self, ours: SampleRef, theirs: SampleRef) -> bool:
        """Whether our put replaced their committed features in this store (ours are the
        only copy left), rather than theirs being live or kept elsewhere."""
        return theirs.store == ours.store and not self.store.exists(theirs)

    def regenerate(
        self,
        sample_id: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> SampleRef:
        """Commit fresh features for a sample whose features were released or lost.

        For the ``regenerate`` list of a ReconcilePlan or of ``state``: the
        sample must be trained again, but its features are gone (released by
        the policy, or reported lost by a consumer). Unlike ``emit``, allowed
        after ``close()`` (no consumer finishes while a sample waits for its
        regeneration): the producer is open again until it closes again.
        """
        validate_sample_id(sample_id)
        # Checked before the put too: a put would supersede features that are live.
        checked = self._check_regenerable(
            self.ledger.commits(self.run_id, [sample_id]),
            self.ledger.released_revision(self.run_id, sample_id),
            sample_id,
        )
        ref = self.store.put(sample_id, tensors, metadata=metadata)
        try:
            self._check_sendable([ref])
            with self.ledger.write(self.run_id, "regenerate") as tx:
                tx.check_producer(self.producer_id, self.epoch)
                newest = tx.commits([sample_id])
                if sample_id in newest and newest[sample_id][0] > checked:
                    revision = self._settle_regeneration(ref, newest[sample_id])
                else:
                    revision = self._check_regenerable(
                        newest, tx.released_revision(sample_id), sample_id
                    )
                tx.append([self._commit_event(ref, revision + 1)])
        except BaseException:
            self.store.delete(ref)
            raise
        self._closed = False  # open again until it closes again, as the fold counts it
        self._send([ref])
        return ref

    def _commit_event(self, ref: SampleRef, revision: int) -> NewEvent:
        return NewEvent(
            Kind.COMMIT,
            self.producer_id,
            ref.sample_id,
            epoch=self.epoch,
            payload=ref_json(ref),
            revision=revision,
        )

    def _settle_regeneration(self, ours: SampleRef, newest: tuple[int, str]) -> int:
        """Another producer regenerated the sample between our check and our commit.

        In a store where a put supersedes older generations, our put may have made
        their committed features stale: then ours are the only copy, and they are
        committed as the next revision (the revision returned). Else theirs are
        live and ours were never needed: LedgerStateError, and ours are deleted.
        """
        revision, payload = newest
        if self._superseded_by(ours, ref_from_ledger(payload)):
            return revision
        raise LedgerStateError(
            f"{ours.sample_id!r} was regenerated meanwhile by another producer (revision "
            f"{revision}, still stored): nothing to do"
        )

    def _check_regenerable(
        self, newest: dict[str, tuple[int, str]], released: int | None, sample_id: str
    ) -> int:
        if sample_id not in newest:
            raise LedgerStateError(
                f"{sample_id!r} was never committed in run {self.run_id!r}; use emit()"
            )
        revision = newest[sample_id][0]
        if released != revision:
            raise LedgerStateError(
                f"the features of {sample_id!r} (revision {revision}) are still stored; "
                "only samples whose features were released or lost can be regenerated"
            )
        return revision

    def close(self) -> None:
        """End this producer's stream, record that it is done and stop serving its metrics.

        The close counts only while this Producer holds its id: after another process
        claimed it, ProducerFencedError (the stream and metrics are closed all the same).
        Closing again does nothing.
        """
        if self._closed:
            return
        try:
            if self.stream is not None:
                # The stream's end first: its EOF follows every ref sent, so a consumer
                # that later reads the ledger's close has received them all. Closing
                # the ledger first left refs in flight after a close that consumers
                # took for the end of the stream.
                self.stream.close()
        finally:
            try:
                # Without a stream, the close says so: consumers' streams then do not
                # count this producer among those they wait for.
                payload = dump_payload({"streamed": False}) if self.stream is None else None
                with self.ledger.write(self.run_id, "close", shared=True) as tx:
                    tx.check_producer(self.producer_id, self.epoch)
                    tx.append(
                        [NewEvent(Kind.CLOSE, self.producer_id, epoch=self.epoch, payload=payload)]
                    )
                self._closed = True
            finally:
                if self._outbox is not None:
                    self._outbox.credit.end("closes")
                if self._gate is not None:
                    self._gate.blocking.end("closes")
                if self.metrics is not None:
                    self.metrics.close()
