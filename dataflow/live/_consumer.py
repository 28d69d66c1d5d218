"""Consumer: a trainer rank's role, leasing, acking and checkpointing what producers committed.

Each write is one ledger transaction (see :mod:`dataflow.live._args`), fenced by
the consumer's epoch, which :meth:`Consumer.resume` starts.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import re
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from dataflow.interfaces._store import FeatureStore
from dataflow.interfaces._stream import RefReceiver
from dataflow.live._args import _check_roles_args, check_timeout
from dataflow.live._collectives import agree, broadcast_int, group_active
from dataflow.live._metrics import MetricsServer, serve_run_metrics
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    CorruptLedgerError,
    DataflowError,
    InvalidArgumentError,
    InvalidCheckpointPathError,
    LedgerStateError,
    PeerFailedError,
    StaleEpochError,
    StreamIdleError,
    UnknownCheckpointError,
)
from dataflow.model._events import Kind, dump_payload
from dataflow.model._fold import RELEASE_POLICIES, Checkpoint, ReconcilePlan, RunState
from dataflow.model._refs import SampleRef, validate_sample_id
from dataflow.recorder._ledger import Ledger, NewEvent, WriteTransaction, check_id

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dataflow")
_T = TypeVar("_T")

_POLL_S = 0.02
_MAX_INT64 = 2**63 - 1
#: A lease that has waited this long on a run no producer ever committed to or closed
#: warns (the run id may be mistyped), then goes on waiting.
NO_PRODUCER_WARNING_S = 30.0
#: ``scheme://...``: a checkpoint on remote storage, which the ledger cannot look at.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_int(name: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    if value > _MAX_INT64:
        raise InvalidArgumentError(f"{name} must fit in 64 bits (<= {_MAX_INT64}), got {value}")
    return value


def _check_step(what: str, step: object, *, minimum: int) -> int:
    _check_int("step", step, minimum=-_MAX_INT64 - 1)
    if step < minimum:  # type: ignore[operator]
        raise LedgerStateError(
            f"{what} step must be >= {minimum}, got {step}: step N is the N-th optimizer "
            "step (acks name the step their samples were trained into, from 1; a "
            "checkpoint at step 0 holds the state before the first step)"
        )
    return step  # type: ignore[return-value]


def _checkpoint_path(path: object) -> str:
    """``path`` as a str, refused when it cannot name a checkpoint (checked on every rank)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidCheckpointPathError(
            f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}"
        )
    if not path.isprintable():
        bad = next(c for c in path if not c.isprintable())
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r} holds the control character {bad!r}; pass the path "
            "the checkpoint's files were written to"
        )
    if _URI.match(path):
        if path.lower().startswith("file:"):
            raise InvalidCheckpointPathError(
                f"checkpoint path {path!r} is a file:// URI; pass the local path instead"
            )
        return path
    if ".." in path.replace("\\", "/").split("/"):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r} has a '..' part, so it may name a place other than it "
            "seems (through symbolic links); pass the checkpoint's path without '..', "
            "absolute or relative to the working directory"
        )
    return path


def _existing_checkpoint(path: str) -> str:
    """A local checkpoint path as it is recorded: existing, a file or directory, absolute."""
    if _URI.match(path):
        return path  # remote storage: recorded as given
    absolute = os.path.abspath(path)
    where = "" if absolute == path else f" (resolved to {absolute})"
    if not os.path.exists(absolute):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r}{where} does not exist; make the checkpoint's files "
            "durable first, then record it (name a checkpoint on remote storage by its "
            "URI, e.g. s3://bucket/step-100)"
        )
    if not (os.path.isfile(absolute) or os.path.isdir(absolute)):
        raise InvalidCheckpointPathError(
            f"checkpoint path {path!r}{where} is neither a file nor a directory"
        )
    return absolute


def _sample_ids(refs: object, what: str) -> list[str]:
    """Ids of ``refs`` (SampleRefs or ids), refusing duplicates and bad types."""
    if isinstance(refs, (str, SampleRef)) or not isinstance(refs, Iterable):
        raise ArgumentTypeError(f"{what} takes a list of SampleRefs or sample ids, got {refs!r}")
    ids = [r.sample_id if isinstance(r, SampleRef) else validate_sample_id(r) for r in refs]
    duplicates = sorted(s for s, n in collections.Counter(ids).items() if n > 1)
    if duplicates:
        raise InvalidArgumentError(f"{what} got the same sample more than once: {duplicates}")
    return ids


def _check_producers(producers: object) -> frozenset[str]:
    """``Consumer(producers=...)``: the producer ids, checked as ``Producer`` checks its own."""
    if producers is None:
        return frozenset()
    if isinstance(producers, (str, bytes)) or not isinstance(producers, Iterable):
        raise ArgumentTypeError(
            f"producers takes a list of producer ids, e.g. ['prod-0', 'prod-1'], got {producers!r}"
        )
    return frozenset(check_id("a producer id in producers", p) for p in producers)


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
    def locked(self: Consumer, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class Consumer:
    """A trainer rank's side of a run: resume, lease, ack, nack, checkpoint.

    Call :meth:`resume` first: it starts a new consumer epoch (fencing off any
    older trainer of the run) and reconciles from a checkpoint. Then lease
    refs, train on them, and ack them at the optimizer boundary.

    ``release_policy``: ``"on_checkpoint"`` (default) frees a sample's features
    once it is trained into a durable checkpoint; ``"on_ack"`` right after
    its ack; ``"never"`` keeps them (offline datasets iterated many times).

    Multi-rank: requeued work is split across ranks deterministically. Rank 0
    appends the resume and checkpoint events; with torch.distributed
    initialized the ranks synchronize through collectives, otherwise the
    caller must make rank 0 resume before the others and checkpoint only
    after every rank's acks up to that step have returned. A rank whose process
    restarted alone calls :meth:`rejoin` instead of :meth:`resume`.

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
            if stream is not None:
                raise InvalidArgumentError(
                    "order_seed orders a committed dataset; a streaming consumer takes refs "
                    "in arrival order: pass one or the other"
                )
        self.order_seed = order_seed
        self.ledger = ledger
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self.release_policy = release_policy
        self.max_attempts = max_attempts
        #: The live fold of the run, brought up to date on every write.
        self.state = RunState(run_id, ref_source=ledger)
        self._lock = threading.RLock()
        self.epoch: int | None = None
        #: before_checkpoint callbacks, each behind a function that returns it (None once a
        #: bound method's object is gone).
        self._before_checkpoint: list[Callable[[], Callable[[], object] | None]] = []
        self._from_stream: set[str] = set()
        self._marked_closed: set[str] = set()
        #: The run's Prometheus metrics endpoint (``metrics_port``, on ``metrics_host``,
        #: default 127.0.0.1); None when not serving. ``metrics.close()`` stops it.
        self.metrics: MetricsServer | None = serve_run_metrics(
            ledger, run_id, store, metrics_port, metrics_host
        )

    _snapshot_every: int | None = 50_000

    @property
    def snapshot_every(self) -> int | None:
        """Rank 0 stores a snapshot of its fold at a checkpoint once this many events
        came since the last one (None: never); a restart then folds only the tail."""
        return self._snapshot_every

    @snapshot_every.setter
    def snapshot_every(self, every: int | None) -> None:
        if every is not None:
            _check_int("snapshot_every", every, minimum=1)
        self._snapshot_every = every

    _snapshot_seq = -1  # the seq of the last snapshot written or read; -1: none looked for

    # -- internals -----------------------------------------------------------
    def _sync(self, tx: WriteTransaction) -> None:
        if self._snapshot_seq < 0 or self._refold_needed:
            # The first fold: page through the log outside the transaction (rows_after
            # holds what it reads in memory at once), so the transaction reads the tail.
            self._catch_up()
        self.state.apply_rows(tx.rows_after(self.state.head_seq))

    def _catch_up(self) -> None:
        if self._refold_needed:
            self._refold()
            return
        self._start_from_snapshot()
        self.state.apply_rows(self.ledger.rows(self.run_id, after_seq=self.state.head_seq))

    #: Set when a write that folded its own events did not commit, or its COMMIT failed:
    #: the fold may hold events the ledger does not. The next read folds the run anew.
    _refold_needed = False

    def _refold(self) -> None:
        """Fold the run anew (its newest snapshot, then the log); swapped in once whole."""
        state, snapshot_seq = self._newest_snapshot()
        state.apply_rows(self.ledger.rows(self.run_id, after_seq=state.head_seq))
        self.state, self._snapshot_seq = state, snapshot_seq
        self._refold_needed = False

    def _newest_snapshot(self) -> tuple[RunState, int]:
        """The run's newest valid snapshot and its seq; an empty fold and 0 when none."""
        restored = self.ledger.load_snapshot(self.run_id)
        if restored is None:
            return RunState(self.run_id, ref_source=self.ledger), 0
        return restored, restored.head_seq

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
            with self.ledger.write(self.run_id, what) as tx:
                transaction = tx
                yield tx
        except BaseException as exc:
            if transaction is not None and transaction.appended:
                self._refold_needed = True
                if isinstance(exc, Exception):  # not on KeyboardInterrupt: later then
                    with contextlib.suppress(DataflowError):  # the ledger is away: later
                        self._refold()
            raise

    def _landed(self, sample_ids: list[str], shows: Callable[[str], bool]) -> bool:
        """After a COMMIT of unknown outcome: whether the ledger holds the write, read
        again; it did when every one of ``sample_ids`` ``shows`` it. False if unreadable."""
        try:
            self._catch_up()
        except DataflowError:
            return False
        return bool(sample_ids) and all(shows(s) for s in sample_ids)

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

    def _start_from_snapshot(self) -> None:
        """Before the first fold: start from the run's newest valid snapshot, if any."""
        if self._snapshot_seq >= 0:
            return
        self._snapshot_seq = 0
        if self.state.head_seq == 0:
            self.state, self._snapshot_seq = self._newest_snapshot()

    def _maybe_snapshot(self) -> None:
        every = self.snapshot_every
        if every is None or self.state.head_seq - max(self._snapshot_seq, 0) < every:
            return
        try:
            self.ledger.save_snapshot(self.run_id, self.state)
        except Exception as exc:  # a cache: a failed one costs a longer replay, no more
            log.warning("could not snapshot run %r: %s", self.run_id, exc)
            return
        self._snapshot_seq = self.state.head_seq

    def _require_epoch(self) -> int:
        if self.epoch is None:
            raise LedgerStateError(
                f"consumer {self.consumer_id!r} has not resumed: call resume() before "
                "leasing, acking or checkpointing"
            )
        return self.epoch

    @contextlib.contextmanager
    def _write(self, what: str) -> Iterator[WriteTransaction]:
        """A fenced write: refused with StaleEpochError once a newer epoch started."""
        epoch = self._require_epoch()
        with self._transaction(what) as tx:
            tx.check_epoch(epoch, self.consumer_id)
            self._sync(tx)
            yield tx

    def _release_events(self, sample_ids: Iterable[str]) -> list[NewEvent]:
        return [
            NewEvent(
                Kind.RELEASE,
                self.consumer_id,
                sid,
                epoch=self._require_epoch(),
                payload=dump_payload({"revision": self.state.revision(sid)}),
            )
            for sid in sample_ids
        ]

    def _delete_features(self, sample_ids: Iterable[str]) -> None:
        # The release events are durable before the features go: a crash in
        # between leaks features, it never leaves a ledger that promises
        # features which are gone.
        for sid, ref in self.state.refs(sample_ids).items():
            try:
                self.store.delete(ref)
            except DataflowError as exc:
                log.warning("could not delete features of %r from %s: %s", sid, ref.store, exc)

    # -- resume ----------------------------------------------------------------
    #: Ids still leased to this consumer id when it joined its epoch (a restarted rank's
    #: unfinished leases): the next lease() calls hand them out first. Set on joining.
    _reclaimed: tuple[str, ...] = ()

    @_locked
    def resume(self, checkpoint: object = "latest") -> ReconcilePlan:
        """Start a new epoch from ``checkpoint`` and reconcile; return the plan.

        ``checkpoint``: ``"latest"`` (the newest checkpoint of the current
        lineage, or from scratch when there is none), a step (int) naming a
        recorded checkpoint (UnknownCheckpointError otherwise), a Checkpoint
        from ``state.checkpoints``, or None (from scratch). Ranks other than 0
        join the epoch rank 0 started, and reclaim what their ``consumer_id``
        still holds in it (see :meth:`rejoin`). Resuming a run that has no events
        yet, in a ledger that holds other runs, warns and names them (a
        mistyped run id would otherwise start a new, empty run in silence);
        the first run of a new ledger starts quietly. With torch.distributed
        initialized it fails on every rank or on none: where it failed, its
        error; elsewhere :class:`PeerFailedError` (resume again on every rank).
        """
        if not (checkpoint is None or checkpoint == "latest" or isinstance(checkpoint, Checkpoint)):
            _check_int("checkpoint step", checkpoint)
        epoch = self._start_epoch(checkpoint) if self.rank == 0 else self._join_epoch()
        # Every rank of a group got here: from now on a failure on one raises on each.
        error: Exception | None = None
        try:
            plan = self._reconcile(epoch)
        except Exception as exc:
            error = exc
        if group_active(self.world_size):
            agree(error, what=f"resume of run {self.run_id!r}")
        elif error is not None:
            raise error
        return plan

    def _reconcile(self, epoch: int) -> ReconcilePlan:
        """A resume once ``epoch`` is known: catch up, reclaim, and (rank 0) release."""
        if self.rank != 0:
            while self.state.epoch < epoch:  # rank 0 broadcast it once it was written
                self._catch_up()
                if self.state.epoch < epoch:
                    time.sleep(_POLL_S)
            self._check_world_size(epoch)
        joined, self.epoch = self.epoch != epoch, epoch
        # Stream refs of the old epoch are finished by this resume: they go
        # back through reconcile, so their slots go back to the window.
        self._credit(list(self._from_stream))
        self._catch_up()
        self._mark_closed_producers()
        if joined:  # not again for leases this object has already handed out
            self._reclaim()
        if self.rank == 0 and self.state.violations:
            problems = self.state.violations
            warnings.warn(
                f"run {self.run_id!r} in {self.ledger.safe_url} fails verification "
                f"({len(problems)} problems, the first: {problems[0]}): the ledger may be damaged "
                "or hand-edited, and what this resume trusts may be wrong; "
                f"`dataflow replay --ledger URL --run {self.run_id}` lists them",
                stacklevel=4,  # the caller of resume(), through resume and its lock
            )
        plan = self.state.plans[epoch]
        if self.rank == 0 and plan.released:
            with self._write("release") as tx:
                pending_release = [s for s in plan.released if s not in self.state.released]
                tx.append(self._release_events(pending_release))
                self._sync(tx)
            self._delete_features(pending_release)
        _trim_heap(self.state.head_seq)
        return plan.for_rank(self.rank)

    def _known_runs_hint(self) -> str:
        known = [r for r in self.ledger.runs() if r != self.run_id]
        shown = ", ".join(repr(r) for r in known[:20]) or "none"
        more = f" (and {len(known) - 20} more)" if len(known) > 20 else ""
        return f"If you meant an existing run, check the run id; known runs: {shown}{more}"

    def _start_epoch(self, checkpoint: object) -> int:
        """Rank 0's part of a resume: the new epoch, written and then broadcast; if it fails,
        the other ranks are told so (they raise PeerFailedError) rather than left waiting."""
        distributed = group_active(self.world_size)
        try:
            epoch = self._write_epoch(checkpoint)
        except Exception:
            if distributed:
                broadcast_int(-1)
            raise
        if distributed:
            broadcast_int(epoch)
        return epoch

    def _write_epoch(self, checkpoint: object) -> int:
        if self.ledger.head_seq(self.run_id) == 0 and any(
            run != self.run_id for run in self.ledger.runs()
        ):
            warnings.warn(
                f"run {self.run_id!r} has no events in {self.ledger.safe_url}: resume() starts "
                f"it as a new run. {self._known_runs_hint()}",
                stacklevel=5,  # the caller of resume(), through resume and its lock
            )
        if self._snapshot_seq < 0:
            # The first fold (a snapshot, then the log) before the write lock: writers wait
            # only for the tail that the transaction reads.
            self._catch_up()
        with self._transaction("resume") as tx:
            self._sync(tx)
            ckpt = self._resolve_checkpoint(checkpoint)
            epoch = max(tx.epoch, self.state.epoch) + 1
            tx.set_epoch(epoch)
            payload = {
                "checkpoint_seq": ckpt.seq if ckpt else None,
                "checkpoint_step": ckpt.step if ckpt else None,
                "world_size": self.world_size,
                "release_policy": self.release_policy,
                "max_attempts": self.max_attempts,
            }
            if self.order_seed is not None:
                payload["order_seed"] = self.order_seed
            tx.append(
                [
                    NewEvent(
                        Kind.RESUME,
                        self.consumer_id,
                        epoch=epoch,
                        step=ckpt.step if ckpt else None,
                        payload=dump_payload(payload),
                    )
                ]
            )
            self._sync(tx)
        return epoch

    def _resolve_checkpoint(self, checkpoint: object) -> Checkpoint | None:
        if checkpoint is None:
            return None
        if isinstance(checkpoint, Checkpoint):
            if checkpoint not in self.state.checkpoints:
                raise UnknownCheckpointError(f"{checkpoint} is not recorded in run {self.run_id!r}")
            removed = self.state.removed_checkpoints.get(checkpoint.seq)
            if removed is not None:
                raise UnknownCheckpointError(
                    f"the checkpoint at step {checkpoint.step} (seq {checkpoint.seq}) of run "
                    f"{self.run_id!r} was removed ({removed}); resume from another one"
                )
            return checkpoint
        found = self.state.checkpoint_for(checkpoint)
        if found is None and checkpoint != "latest":
            steps = sorted({c.step for c in self.state.checkpoints})
            raise UnknownCheckpointError(
                f"run {self.run_id!r} has no checkpoint at step {checkpoint}; "
                f"recorded steps: {steps[-20:]} (pass None to start from scratch)"
            )
        return found

    def _join_epoch(self) -> int:
        """The epoch rank 0 started: broadcast by rank 0 in a group, else the ledger's."""
        if group_active(self.world_size):
            epoch = broadcast_int(0)
            if epoch < 0:
                raise PeerFailedError(
                    f"resume of run {self.run_id!r} failed on rank 0 (this is rank "
                    f"{self.rank}); see the error raised there"
                )
            return epoch
        return self._current_epoch(
            f"rank {self.rank} cannot join run {self.run_id!r}: rank 0 has not resumed "
            "yet (resume rank 0 first, or initialize torch.distributed)"
        )

    def _current_epoch(self, refusal: str) -> int:
        """The run's epoch, caught up; LedgerStateError(``refusal``) when none started yet."""
        self._catch_up()
        if self.state.epoch == 0:
            raise LedgerStateError(refusal)
        return self.state.epoch

    def _check_world_size(self, epoch: int) -> None:
        if self.state.world_size != self.world_size:
            raise LedgerStateError(
                f"epoch {epoch} of run {self.run_id!r} was started with world_size "
                f"{self.state.world_size}, but this consumer has world_size {self.world_size}: "
                "join it with the epoch's world size, or resume the whole run on the new one"
            )

    @_locked
    def rejoin(self) -> tuple[str, ...]:
        """Join the run's current epoch alone, after this rank's process restarted.

        For one rank that restarts while the others go on (independent consumers,
        asynchronous ranks; in synchronous data parallel training every rank restarts
        together and resumes). Nothing is appended, so no other rank is fenced off, and
        no collective runs, so any rank may rejoin, rank 0 included. The samples this
        ``consumer_id`` leased in the epoch and never acked, nacked or reported lost are
        handed out again, first, by the next :meth:`lease` calls, without a new lease
        event (they are still leased to it); returns their ids. Its acks stay.

        The restarted process must use the same ``consumer_id``, ``rank`` and
        ``world_size``: leases belong to the consumer id (another id reclaims nothing,
        and the old id's leases wait for the next resume). Its acks go on from step
        ``state.last_ack_step(consumer_id)``; its model state is the trainer's business.
        Rejoin only once the old process is dead: the two would share the leases.

        LedgerStateError when no consumer resumed the run yet, when the epoch has
        another world size, or when this Consumer already resumed or rejoined.
        """
        if self.epoch is not None:
            raise LedgerStateError(
                f"consumer {self.consumer_id!r} already joined epoch {self.epoch} of run "
                f"{self.run_id!r}: rejoin() is for a new Consumer in a restarted process"
            )
        epoch = self._current_epoch(
            f"consumer {self.consumer_id!r} cannot rejoin run {self.run_id!r}: no consumer "
            "has resumed it, so there is no epoch to rejoin; call resume() (rank 0 first)"
        )
        self._check_world_size(epoch)
        self.epoch = epoch
        self._mark_closed_producers()
        _trim_heap(self.state.head_seq)
        return self._reclaim()

    def _reclaim(self) -> tuple[str, ...]:
        """Queue what this consumer id still holds in the epoch, in lease order, to hand out."""
        mine = self.consumer_id
        self._reclaimed = tuple(sid for sid, holder in self.state.leased.items() if holder == mine)
        return self._reclaimed

    def _still_reclaimed(self) -> list[str]:
        """The reclaimed ids not handed out yet that this consumer id still holds."""
        mine = self.consumer_id
        return [s for s in self._reclaimed if self.state.leased.get(s) == mine]

    # -- leasing -------------------------------------------------------------
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
            self._require_epoch()
        if not self._share_fixed():
            return None
        return self.state.pending_count(self.rank)

    @_locked
    def refresh(self) -> None:
        """Fold new events; raise StaleEpochError if a newer consumer fenced this one off."""
        self._require_epoch()
        self._catch_up()
        self._check_not_fenced()

    def _check_not_fenced(self) -> None:
        if self.state.epoch != self.epoch:
            raise StaleEpochError(
                f"{self.consumer_id!r} is at epoch {self.epoch} of run {self.run_id!r}, but the "
                f"run moved to epoch {self.state.epoch}: a newer consumer resumed; stop this one"
            )

    def lease(self, max_refs: int, *, timeout: float | None = 0.0) -> list[SampleRef]:
        """Take up to ``max_refs`` samples: requeued work first, then new commits.

        After :meth:`rejoin` (or a rank > 0 :meth:`resume`), the leases this consumer
        id still held come first, alone in their batches and without new lease events.

        Waits up to ``timeout`` seconds (None: until something comes or this
        rank is drained) for at least one; returns [] when nothing came.
        After ``NO_PRODUCER_WARNING_S`` (30 s) of waiting on a run to which no
        producer ever committed or closed, or for a producer named in ``producers``
        that never did, it warns once and goes on waiting (the wait counts across
        calls that find nothing, as a loader's short leases do).

        It waits without the consumer's lock, so that other threads' calls go on
        meanwhile: an ack from another thread returns the stream's credits that let
        the producers send what this lease waits for.
        """
        with self._lock:
            self._require_epoch()
        _check_int("max_refs", max_refs, minimum=1)
        check_timeout(timeout, none_means="wait until something comes or this rank is drained")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            refs = self._lease_once(max_refs, deadline)
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

    def _lease_once(self, max_refs: int, deadline: float | None) -> list[SampleRef]:
        with self._lock:
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
        with self._lock:
            return self._lease_ids([r.sample_id for r in received], streamed=True)

    def _lease_ids(self, sample_ids: list[str], *, streamed: bool) -> list[SampleRef]:
        take: list[str] = []
        try:
            with self._write("lease") as tx:
                take = self._deliverable(sample_ids)
                refs = self._committed_refs(take)  # before anything is leased
                tx.append(NewEvent(Kind.LEASE, self.consumer_id, s, epoch=tx.epoch) for s in take)
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(take, lambda s: self.state.leased.get(s) == self.consumer_id):
                self._unreceive(sample_ids if streamed else [])
                raise
        except BaseException:
            self._unreceive(sample_ids if streamed else [])
            raise
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

    # -- finishing samples ----------------------------------------------------
    def _check_leased(self, ids: list[str], what: str) -> None:
        """Every id is leased by this consumer; ``what`` is the verb ("ack", "report lost")."""
        for sid in ids:
            holder = self.state.leased.get(sid)
            if holder != self.consumer_id:
                held = f"leased by {holder!r}" if holder else "not leased"
                raise LedgerStateError(
                    f"cannot {what} {sid!r}: it is {held} in epoch {self.epoch} of run "
                    f"{self.run_id!r}; only samples this consumer leased can take a {what}"
                )

    def _credit(self, ids: list[str]) -> None:
        if self.stream is None:
            return
        streamed = [s for s in ids if s in self._from_stream]
        self._from_stream.difference_update(streamed)
        if streamed:
            self.stream.credit(len(streamed))

    def ack(self, refs: Iterable[SampleRef | str], *, step: int) -> None:
        """Record that ``refs`` were trained into optimizer step ``step`` (one transaction).

        Steps count optimizer steps from 1. A step must come after the
        lineage's newest checkpoint, and must not be lower than a step this
        consumer already acked in its epoch (a resume from an older
        checkpoint starts a new epoch, which goes on after that checkpoint's
        step). LedgerStateError otherwise, before anything is written.
        """
        self.ack_many([(refs, step)])

    @_locked
    def ack_many(self, acks: Iterable[tuple[Iterable[SampleRef | str], int]]) -> None:
        """The acks of several optimizer steps, ``[(refs, step), ...]``, in one transaction.

        The same as :meth:`ack` of each in turn (steps in order, none lower than the
        one before), but all or nothing and one ledger write: a loader that acks a
        few steps at once pays one transaction for them. A sample may appear once.
        """
        steps, ids = self._checked_acks(acks)
        if not steps:
            return
        release: list[str] = []
        try:
            with self._write("ack") as tx:
                tx.append(self._ack_events(tx, steps, ids, release))
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._trained_by_an_ack):
                raise
        self._acked(ids, release)

    @_locked
    def ack_and_lease(
        self, acks: Iterable[tuple[Iterable[SampleRef | str], int]], max_refs: int
    ) -> list[SampleRef]:
        """:meth:`ack_many` of ``acks``, then :meth:`lease` of up to ``max_refs`` refs ready
        now (``timeout=0``), in one ledger transaction.

        A loader that leases ahead while the current batch trains writes the acks
        of the steps since its last lease with the next one: one write instead of
        two. The acks are checked as ``ack_many`` checks them, and written whether
        or not anything is leased; if the write fails, neither is in the ledger.
        While refs still come from a stream, those it holds now are taken before
        the transaction, as ``lease`` would take them. With leases reclaimed by
        :meth:`rejoin` to hand out, it is ``ack_many`` and then ``lease``: two
        transactions, the same outcome.
        """
        self._require_epoch()
        steps, ids = self._checked_acks(acks)
        _check_int("max_refs", max_refs, minimum=1)
        if not steps or self._still_reclaimed():
            self.ack_many(steps)
            return self.lease(max_refs, timeout=0)
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
                        *(NewEvent(Kind.LEASE, self.consumer_id, s, epoch=tx.epoch) for s in take),
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
                raise
        except BaseException:
            self._unreceive(received)
            raise
        self._acked(ids, release)
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

    def _checked_acks(
        self, acks: Iterable[tuple[Iterable[SampleRef | str], int]]
    ) -> tuple[list[tuple[list[str], int]], list[str]]:
        """``acks`` as (ids, step) pairs in step order, and all their ids; raise on bad input."""
        if isinstance(acks, (str, bytes)) or not isinstance(acks, Iterable):
            raise ArgumentTypeError(
                f"ack_many takes a list of (refs, step) pairs, got {acks!r:.100}"
            )
        steps: list[tuple[list[str], int]] = []
        for pair in acks:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ArgumentTypeError(f"ack_many takes (refs, step) pairs, got {pair!r:.100}")
            refs, step = pair
            steps.append((_sample_ids(refs, "ack"), _check_step("ack", step, minimum=1)))
        ids = _sample_ids([s for batch, _ in steps for s in batch], "ack_many")
        for (_, earlier), (_, later) in itertools.pairwise(steps):
            if later < earlier:
                raise LedgerStateError(
                    f"ack_many got step {later} after step {earlier}: give the steps in order"
                )
        return steps, ids

    def _acked(self, ids: list[str], release: list[str]) -> None:
        """After acks landed: delete what they released, give the stream its credits."""
        self._delete_features(release)
        self._credit(ids)

    def _trained_by_an_ack(self, sample_id: str) -> bool:
        return sample_id in self.state.trained and self._lease_ended(sample_id)

    def _lease_ended(self, sample_id: str) -> bool:
        """Whether this consumer no longer holds ``sample_id`` (after settling its lease)."""
        return self.state.leased.get(sample_id) != self.consumer_id

    def _ack_events(
        self,
        tx: WriteTransaction,
        steps: list[tuple[list[str], int]],
        ids: list[str],
        release: list[str],
    ) -> list[NewEvent]:
        """The events of the acks of ``steps`` in ``tx`` (their releases after them), once
        the ledger allows them; ``release`` gets the ids they release."""
        self._check_acks_allowed(steps, ids)
        if self.release_policy == "on_ack":
            release += ids
        return [
            *(
                NewEvent(Kind.ACK, self.consumer_id, s, epoch=tx.epoch, step=step)
                for batch, step in steps
                for s in batch
            ),
            *self._release_events(release),
        ]

    def _check_acks_allowed(self, steps: list[tuple[list[str], int]], ids: list[str]) -> None:
        """Raise unless the fold allows the acks of ``steps`` (``ids``: all their ids)."""
        self._check_leased(ids, "ack")
        first = steps[0][1]
        floor = self.state.last_checkpoint_step
        if first <= floor:
            raise LedgerStateError(
                f"ack at step {first} in run {self.run_id!r}, but a checkpoint at step "
                f"{floor} already exists in this lineage: acks must name a later step"
            )
        newest = self.state.last_ack_step(self.consumer_id)
        if first < newest:
            raise LedgerStateError(
                f"ack at step {first} in run {self.run_id!r}, but {self.consumer_id!r} "
                f"already acked step {newest} in epoch {self.epoch}: steps must not go "
                "backwards; ack with the number of the optimizer step just taken"
            )

    @_locked
    def nack(
        self, refs: Iterable[SampleRef | str], *, retryable: bool = True, reason: str = ""
    ) -> None:
        """Give samples back: pending again if retryable, dead after ``max_attempts`` or if not.

        A retry goes back to this rank's queue (this rank is alive, so it is never stranded
        on a rank that already drained); with several ranks the nack records the rank.
        """
        ids = _sample_ids(refs, "nack")
        if not isinstance(retryable, bool):
            raise ArgumentTypeError(f"retryable must be a bool, got {retryable!r}")
        if not isinstance(reason, str) or len(reason) > 1000:
            raise InvalidArgumentError(
                f"reason must be a str of at most 1000 characters, got {reason!r}"
            )
        try:
            with self._write("nack") as tx:
                self._check_leased(ids, "nack")
                fields: dict[str, Any] = {"retryable": retryable, "reason": reason}
                if self.world_size > 1:
                    fields["rank"] = self.rank
                payload = dump_payload(fields)
                tx.append(
                    NewEvent(Kind.NACK, self.consumer_id, s, epoch=tx.epoch, payload=payload)
                    for s in ids
                )
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._lease_ended):
                raise
        self._credit(ids)

    @_locked
    def lost(self, refs: Iterable[SampleRef | str], *, reason: str) -> None:
        """Report leased samples whose features are gone or corrupt on a load.

        For a StaleRefError or CorruptFeatureError from ``load`` (a store server
        restarted, a file deleted or damaged): not a training failure, so no
        attempt is counted and the sample never dies of it. It leaves this
        consumer's leases, is listed in ``state.lost`` and ``state.regenerate``,
        and comes back, to this rank, once it is regenerated
        (``Producer.regenerate``). What is left of its features is deleted.
        """
        ids = _sample_ids(refs, "lost")
        if not isinstance(reason, str) or not 0 < len(reason) <= 1000:
            raise InvalidArgumentError(
                f"reason must be a str of 1 to 1000 characters, got {reason!r:.80}"
            )
        try:
            with self._write("lost") as tx:
                self._check_leased(ids, "report lost")
                tx.append(
                    NewEvent(
                        Kind.LOST,
                        self.consumer_id,
                        sid,
                        epoch=tx.epoch,
                        payload=dump_payload(
                            {"revision": self.state.revision(sid), "reason": reason}
                        ),
                    )
                    for sid in ids
                )
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._lease_ended):
                raise
        self._credit(ids)
        self._delete_features(s for s in ids if s in self.state.lost)

    def before_checkpoint(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` at the start of every :meth:`checkpoint` of this consumer,
        before the ranks meet; an error it raises is raised by that ``checkpoint``, which
        then records nothing.

        For acks written behind the training loop: a ``FeatureLoader`` with ``prefetch``
        registers its ``flush``, so the acks it still holds are in the ledger before a
        checkpoint records what was trained, whoever calls ``checkpoint``. A bound
        method is held weakly (it stops being called once its object is gone).
        """
        if not callable(callback):
            raise ArgumentTypeError(
                f"before_checkpoint takes a callable, got {type(callback).__name__}"
            )
        held: Callable[[], Callable[[], object] | None] = (
            weakref.WeakMethod(callback)
            if isinstance(callback, types.MethodType)
            else lambda: callback
        )
        with self._lock:
            self._before_checkpoint.append(held)

    def checkpoint(
        self, step: int, path: str | os.PathLike[str], *, digest: str | None = None
    ) -> Checkpoint | None:
        """Record a durable checkpoint at ``step``; release features per the policy.

        Call it after the checkpoint files are durable. Every rank calls it:
        the :meth:`before_checkpoint` callbacks run first, then with
        torch.distributed initialized the ranks meet, so rank 0 appends only
        once every rank's acks up to ``step`` are in the ledger, and meet again
        once it has. It fails on every rank or on none: the rank where it
        failed (a callback, or rank 0's write) raises that error, and the
        others raise :class:`PeerFailedError` rather than wait in a collective;
        then nothing is recorded, or (rank 0's write failing after it landed)
        the ledger says whether it was.
        ``digest`` (e.g. the sha256 of the checkpoint's manifest) is recorded
        so a resume can check it loads exactly these bytes. Returns the
        Checkpoint on rank 0, None elsewhere.

        ``path``: the checkpoint's file or directory. A local path must exist
        (rank 0 checks it) and must not have a ``..`` part; it is recorded as
        an absolute path, so a resume from another working directory finds
        it. A URI (``s3://bucket/step-100``) names a checkpoint on remote
        storage and is recorded as given. ``step`` counts optimizer steps
        (0: before the first) and must be above the lineage's newest
        checkpoint step.
        """
        _check_step("checkpoint", step, minimum=0)
        path = _checkpoint_path(path)
        if digest is not None and (not isinstance(digest, str) or not digest):
            raise InvalidArgumentError(
                f"checkpoint digest must be a non-empty str or None, got {digest!r}"
            )
        self._require_epoch()
        # Outside the lock: a loader's flush waits for its thread, which may be waiting
        # for this lock to lease.
        with self._lock:
            live = [(get, callback) for get in self._before_checkpoint if (callback := get())]
            self._before_checkpoint = [get for get, _ in live]
        error: Exception | None = None
        try:
            for _, callback in live:
                callback()
        except Exception as exc:
            error = exc
        return self._record_checkpoint(step, path, digest, error)

    @_locked
    def _record_checkpoint(
        self, step: int, path: str, digest: str | None, error: Exception | None
    ) -> Checkpoint | None:
        """Every rank: meet (raising everywhere if ``error`` is on any rank), rank 0 appends,
        meet again (raising everywhere if that failed)."""
        distributed = group_active(self.world_size)
        what = f"checkpoint at step {step} of run {self.run_id!r}"
        if distributed:
            agree(error, what=what)
        elif error is not None:
            raise error
        recorded = None
        if self.rank == 0:
            try:
                recorded = self._append_checkpoint(step, path, digest)
            except Exception as exc:
                error = exc
        if distributed:
            agree(error, what=what)
        elif error is not None:
            raise error
        return recorded

    def _append_checkpoint(self, step: int, path: str, digest: str | None) -> Checkpoint:
        with self._write("checkpoint") as tx:
            floor = self.state.last_checkpoint_step
            if step <= floor:
                raise LedgerStateError(
                    f"checkpoint at step {step} in run {self.run_id!r}, but this lineage already "
                    f"has one at step {floor}: checkpoint steps must increase"
                )
            path = _existing_checkpoint(path)
            tx.append(
                [
                    NewEvent(
                        Kind.CHECKPOINT,
                        self.consumer_id,
                        epoch=tx.epoch,
                        step=step,
                        payload=dump_payload(
                            {"path": path} if digest is None else {"path": path, "digest": digest}
                        ),
                    )
                ]
            )
            self._sync(tx)
            release = (
                self.state.releasable_at(step) if self.release_policy == "on_checkpoint" else []
            )
            tx.append(self._release_events(release))
            self._sync(tx)
        self._delete_features(release)
        self._maybe_snapshot()
        return self.state.checkpoints[-1]

    @_locked
    def remove_checkpoints(self, checkpoints: Iterable[Checkpoint], *, reason: str) -> None:
        """Record that these checkpoints' files are being deleted (rank 0, before deleting).

        Once recorded, a checkpoint is never chosen by ``resume`` again and a
        resume naming it fails before anything is written; ``replay`` lists it
        under ``removed_checkpoints``. Already removed ones are skipped.
        """
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError(f"reason must be a non-empty str, got {reason!r}")
        if self.rank != 0:
            raise LedgerStateError("only rank 0 records removed checkpoints")
        checkpoints = list(checkpoints)
        for c in checkpoints:
            if not isinstance(c, Checkpoint):
                raise InvalidArgumentError(f"expected dataflow.Checkpoint objects, got {c!r}")
        with self._write("checkpoint removal") as tx:
            events = []
            for c in checkpoints:
                if c not in self.state.checkpoints:
                    raise UnknownCheckpointError(f"{c} is not recorded in run {self.run_id!r}")
                if c.seq in self.state.removed_checkpoints:
                    continue
                payload = {"checkpoint_seq": c.seq, "step": c.step, "reason": reason}
                events.append(
                    NewEvent(
                        Kind.CHECKPOINT_REMOVED,
                        self.consumer_id,
                        epoch=tx.epoch,
                        step=c.step,
                        payload=dump_payload(payload),
                    )
                )
            tx.append(events)
            self._sync(tx)

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
