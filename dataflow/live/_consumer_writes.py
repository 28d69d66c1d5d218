"""The Consumer's fenced writes: its live fold, its lock, and the transactions it appends in.

Every write of a consumer is one ledger transaction fenced by the consumer's
fencing epoch (the generation of the run's consumers that :meth:`Consumer.resume`
starts; a newer one fences the older off with StaleEpochError). Inside it the
consumer's :class:`~dataflow.live._view.RunView` folds what it has not seen
yet, the write is checked against that exact state, appended, and folded
back in (see :mod:`dataflow.live._args`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from dataflow.interfaces._store import FeatureStore
from dataflow.interfaces._stream import RefReceiver
from dataflow.live._view import RunView
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    DataflowError,
    LedgerStateError,
    StaleEpochError,
)
from dataflow.model._events import Kind, batch_payloads, dump_payload
from dataflow.model._fold import RunState
from dataflow.model._ref_codec import ref_from_json
from dataflow.model._refs import SampleRef
from dataflow.recorder._ledger import Ledger, NewEvent, WriteTransaction

log = logging.getLogger("dataflow")
_T = TypeVar("_T")

#: How long a consumer waits between two looks at the ledger or the stream.
_POLL_S = 0.02
#: The first schema version whose readers read batch rows (dataflow.model._events).
_BATCH_ROWS_SCHEMA = 4
#: Said with a CommitOutcomeUnknownError that the consumer could not settle itself.
_IN_DOUBT = (
    "the consumer could not read the ledger back to settle this write: make the same "
    "call again once the ledger answers (a lease then hands out first what this one "
    "leased; the same ack returns without writing a second one)"
)


def batch_events(
    kind: str,
    actor: str,
    sample_ids: list[str],
    *,
    epoch: int,
    step: int | None = None,
    batched: bool = True,
    **fields: Any,
) -> list[NewEvent]:
    """The rows of a lease, ack, nack or release of ``sample_ids`` by ``actor``: batch rows
    (one per MAX_BATCH_SAMPLES), or with ``batched=False`` one row per sample (for a ledger
    of a schema before 4, whose readers know no batch rows). ``fields``: a nack's
    ``retryable``, ``reason`` and ``rank``; a release's ``revisions`` (one per sample)."""
    if not sample_ids:
        return []
    if batched:
        payloads = batch_payloads(kind, sample_ids, **fields)
        return [NewEvent(kind, actor, epoch=epoch, step=step, payload=p) for p in payloads]
    revisions = fields.pop("revisions", None)
    if revisions is not None:
        single = [dump_payload({"revision": r}) for r in revisions]
    else:
        single = [dump_payload(fields)] * len(sample_ids)
    return [
        NewEvent(kind, actor, sid, epoch=epoch, step=step, payload=payload)
        for sid, payload in zip(sample_ids, single, strict=True)
    ]


def _trim_heap(events: int) -> None:
    """After the first fold of a long run, give the heap's free pages back (glibc).

    Decoding a snapshot and reconciling a resume allocate far more than the fold
    keeps; without this the process would go on holding that peak.
    """
    if events < 100_000 or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the pages stay, no more
        ctypes.CDLL(None).malloc_trim(0)


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a Consumer method under the consumer's lock (one thread at a time)."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class _FencedWrites:
    """What every concern of the Consumer builds on: the fold, the lock, fenced writes.

    The attributes are set by ``Consumer.__init__``.
    """

    ledger: Ledger
    store: FeatureStore
    run_id: str
    consumer_id: str
    rank: int
    world_size: int
    stream: RefReceiver | None
    release_policy: str
    max_attempts: int
    order_seed: int | None
    producers: frozenset[str]
    #: The fencing epoch this consumer joined (``resume``/``rejoin``); None before.
    epoch: int | None
    _lock: threading.RLock
    _view: RunView
    #: Sample ids leased from the stream and not finished yet: their stream slots come
    #: back when they are acked, nacked or reported lost.
    _from_stream: set[str]

    @property
    def state(self) -> RunState:
        """The live fold of the run, brought up to date on every write."""
        return self._view.state

    @property
    def forget_finished(self) -> bool:
        """Whether the live fold forgets finished samples (default False).

        Set True for a long run: each sample committed, trained in the current lineage
        and released (or trained, under the release policy 'never') then costs the
        consumer about 12 bytes instead of about 250, so its memory stays flat. Leasing,
        acking, dedup of resent refs, resumes and checkpoints stay exact (a row the
        fold cannot take without what it forgot makes it fold the run anew, whole);
        what changes is ``state``: its ``committed``, ``trained``, ``released`` and
        lineage hold the samples it keeps only (``state.is_trained`` answers for all,
        ``state.forgotten_count`` counts the others), and rank 0 writes no snapshot
        (a restart folds the log from the last one). A seeded run forgets nothing.
        Read a whole run with ``dataflow.replay`` or the tools.
        """
        return self._view.forget

    @forget_finished.setter
    def forget_finished(self, forget: bool) -> None:
        if not isinstance(forget, bool):
            raise ArgumentTypeError(
                f"forget_finished must be a bool, got {type(forget).__name__} {forget!r}"
            )
        with self._lock:
            if not forget and self.state.forgetting:
                self._view.stale = True  # the next catch-up folds the run whole again
            self._view.forget = forget
            # Leasing from the ledger, a rank takes its own queue's samples: the others' ref
            # JSON need not stay in memory. A stream hands a rank samples of any queue.
            self._view.rank = self.rank if self.stream is None else None

    @property
    def _snapshot_seq(self) -> int:
        """The seq of the snapshot the fold started from or last wrote (0: the start of
        the log); -1 until the first fold."""
        return self._view.snapshot_seq

    # -- the fold --------------------------------------------------------------
    def _catch_up(self) -> None:
        """Fold what came since (the first time: from the newest snapshot; after a write
        that may not have landed: anew)."""
        self._view.catch_up()

    def _sync(self, tx: WriteTransaction) -> None:
        """Fold what ``tx`` reads that the fold has not seen: before a write is checked, and
        after it appended its events."""
        self._view.catch_up_in(tx)

    # -- fencing ---------------------------------------------------------------
    def _fencing_epoch(self) -> int:
        """The fencing epoch this consumer joined; LedgerStateError before it resumed."""
        if self.epoch is None:
            raise LedgerStateError(
                f"consumer {self.consumer_id!r} has not resumed: call resume() before "
                "leasing, acking or checkpointing"
            )
        return self.epoch

    def _check_not_fenced(self) -> None:
        if self.state.epoch != self.epoch:
            raise StaleEpochError(
                f"{self.consumer_id!r} is at epoch {self.epoch} of run {self.run_id!r}, but the "
                f"run moved to epoch {self.state.epoch}: a newer consumer resumed; stop this one"
            )

    # -- transactions ----------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[WriteTransaction]:
        """``ledger.write``, after which the fold agrees with the ledger however it ended.

        Inside it the fold takes what the transaction appended (the writes that
        follow read it: a resume its plan, a checkpoint its releases). If the
        transaction then rolls back, or its COMMIT fails (and may have landed),
        those events are in the fold and perhaps not in the ledger: the fold is
        rebuilt from the ledger (at once, or on the next read while the ledger
        cannot be read), rather than skip the events that take their place in
        the log.
        """
        transaction: WriteTransaction | None = None
        try:
            # consumers=True: beside the producers, after the consumer writes begun before it.
            with self.ledger.write(self.run_id, what, consumers=True) as tx:
                transaction = tx
                yield tx
        except BaseException as exc:
            if transaction is not None and transaction.appended:
                self._view.stale = True
                if isinstance(exc, Exception):  # not on KeyboardInterrupt: later then
                    try:
                        self._view.refold()
                    except DataflowError:  # the ledger is away: rebuilt on the next read
                        if isinstance(exc, CommitOutcomeUnknownError):
                            exc.add_note(_IN_DOUBT)
            raise

    @contextlib.contextmanager
    def _write(self, what: str) -> Iterator[WriteTransaction]:
        """A fenced write: refused with StaleEpochError once a newer fencing epoch started."""
        epoch = self._fencing_epoch()
        with self._transaction(what) as tx:
            tx.check_epoch(epoch, self.consumer_id)
            self._sync(tx)
            yield tx

    #: The samples of the last write whose COMMIT failed while the ledger could not be
    #: read back either (a link cut after the server committed): the caller was told
    #: CommitOutcomeUnknownError, and its retry of the same write is settled from the
    #: ledger (:meth:`_repeats_landed`) instead of being refused as a second one.
    _in_doubt: frozenset[str] = frozenset()

    def _landed(self, sample_ids: list[str], shows: Callable[[str], bool]) -> bool:
        """After a COMMIT of unknown outcome: whether the ledger holds the write, read
        again; it did when every one of ``sample_ids`` ``shows`` it. False if unreadable
        (and the write is in doubt until it is made again)."""
        try:
            self._catch_up()
        except DataflowError:
            self._in_doubt = frozenset(sample_ids)
            return False
        return bool(sample_ids) and all(shows(s) for s in sample_ids)

    def _repeats_landed(self, sample_ids: list[str], shows: Callable[[str], bool]) -> bool:
        """Whether this write repeats the one in doubt (the same samples) and that one
        landed after all: every sample ``shows`` it in the ledger, read now. Then the
        retry is done, with nothing written twice. Another write ends the doubt; one
        that cannot read the ledger yet raises and leaves it."""
        if not self._in_doubt:
            return False
        if self._in_doubt != frozenset(sample_ids):
            self._in_doubt = frozenset()
            return False
        self._catch_up()
        self._in_doubt = frozenset()
        return all(shows(s) for s in sample_ids)

    # -- rows ------------------------------------------------------------------
    def _events(
        self, kind: str, sample_ids: list[str], epoch: int, step: int | None = None, **fields: Any
    ) -> list[NewEvent]:
        """The rows of this consumer's ``kind`` of ``sample_ids`` (see :func:`batch_events`)."""
        batched = self.ledger.schema_version >= _BATCH_ROWS_SCHEMA
        return batch_events(
            kind, self.consumer_id, sample_ids, epoch=epoch, step=step, batched=batched, **fields
        )

    # -- releases --------------------------------------------------------------
    #: The revision of each sample the last release events name: a fold that forgets
    #: finished samples may have forgotten them by the time their features are deleted.
    _released_revisions: dict[str, int] = {}  # replaced, never mutated: shared is harmless

    def _release_events(self, sample_ids: Iterable[str]) -> list[NewEvent]:
        ids = list(sample_ids)
        revisions = [self.state.revision(sid) for sid in ids]
        self._released_revisions = dict(zip(ids, revisions, strict=True))
        return self._events(Kind.RELEASE, ids, self._fencing_epoch(), revisions=revisions)

    def _released_refs(self, sample_ids: Iterable[str]) -> dict[str, SampleRef]:
        """The refs of ``sample_ids``, just released: from the fold, or from the ledger for
        those a forgetting fold (``forget_finished``) no longer keeps."""
        ids = list(sample_ids)
        kept = self.state.committed
        refs = self.state.refs([s for s in ids if s in kept])
        stashed = self._released_revisions
        gone = {s: stashed[s] for s in ids if s not in refs and s in stashed}
        if gone:
            payloads = self.ledger.commit_payloads(self.run_id, gone)
            refs.update((sid, ref_from_json(text)) for sid, text in payloads.items())
        return refs

    def _delete_features(self, sample_ids: Iterable[str]) -> None:
        # The release events are durable before the features go: a crash in
        # between leaks features, it never leaves a ledger that promises
        # features which are gone.
        for sid, ref in self._released_refs(sample_ids).items():
            try:
                self.store.delete(ref)
            except DataflowError as exc:
                log.warning("could not delete features of %r from %s: %s", sid, ref.store, exc)

    # -- the stream's credits --------------------------------------------------
    def _credit(self, ids: list[str]) -> None:
        """Give the stream back the slots of the finished ``ids`` that came through it."""
        if self.stream is None:
            return
        streamed = [s for s in ids if s in self._from_stream]
        self._from_stream.difference_update(streamed)
        if streamed:
            self.stream.credit(len(streamed))
