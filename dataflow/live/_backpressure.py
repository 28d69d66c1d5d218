"""Backpressure: producers wait while too many un-trained features sit in the store.

The **backlog** of a run is what its store holds for training: samples
committed to the run whose features are stored and that are not trained yet
(pending or leased in the current lineage; not trained, released, dead or
lost). A :class:`Watermarks` gives it a high and a low mark, in refs, in
bytes, or both. The gate between them has hysteresis: an emit that would
take the backlog above a high mark closes it, and it stays closed until the
backlog is below every low mark, so a producer does not wake for each single
ack. An emit into an empty backlog always goes, so a batch larger than a mark
cannot wait forever.

:class:`Backlog` keeps the count current through a :class:`RunView` (the one
fold of a live run: the newest snapshot, then only the events it has not
seen); the metrics collector uses it too.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from dataflow.live._view import Row, RunView
from dataflow.model._errors import ArgumentTypeError, BackpressureError, InvalidArgumentError
from dataflow.model._events import Kind, row_samples
from dataflow.model._fold import RunState

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

log = logging.getLogger("dataflow.backpressure")

#: How often a blocked producer looks at the ledger again.
POLL_S = 0.05
#: A producer blocked this long in one episode logs a warning, and the episode's end.
BLOCKED_WARNING_S = 2.0
#: How often the watch thread looks at the episodes that have not warned yet.
_WATCH_S = 0.1
_CHUNK = 5000
_BITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Watermarks:
    """When a producer waits: high and low marks on the run's un-trained backlog.

    ``Producer(..., backpressure=Watermarks(high_refs=1024, low_refs=512))``:
    an emit that would take the backlog above ``high_refs`` refs (or
    ``high_bytes`` tensor bytes) waits until it is below ``low_refs`` (and
    ``low_bytes``), then goes on. Give one pair or both; each mark is an int
    from 1, and a low mark is below its high mark.
    """

    #: Most un-trained refs in the store; an emit that would pass it waits.
    high_refs: int | None = None
    #: A waiting producer goes on once fewer un-trained refs than this are stored.
    low_refs: int | None = None
    #: Most un-trained tensor bytes in the store (from the refs' shapes and dtypes).
    high_bytes: int | None = None
    #: A waiting producer goes on once fewer un-trained bytes than this are stored.
    low_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentTypeError(
                    f"Watermarks.{f.name} must be an int or None, got {type(value).__name__} "
                    f"{value!r}"
                )
            if value < 1:
                raise InvalidArgumentError(
                    f"Watermarks.{f.name} must be >= 1, got {value}: a producer waits until the "
                    "backlog is below the low mark, and no backlog is below 0"
                )
        pairs = 0
        for unit in ("refs", "bytes"):
            high, low = getattr(self, f"high_{unit}"), getattr(self, f"low_{unit}")
            if (high is None) != (low is None):
                raise InvalidArgumentError(
                    f"Watermarks needs high_{unit} and low_{unit} together, got "
                    f"high_{unit}={high!r} and low_{unit}={low!r}: a producer waits at the high "
                    "mark until the backlog is below the low mark"
                )
            if high is None:
                continue
            pairs += 1
            if low >= high:
                raise InvalidArgumentError(
                    f"Watermarks.low_{unit} ({low}) must be below high_{unit} ({high}), e.g. "
                    f"Watermarks(high_{unit}={high}, low_{unit}={max(1, high // 2)})"
                )
        if not pairs:
            raise InvalidArgumentError(
                "Watermarks needs a pair of marks: high_refs and low_refs, or high_bytes and "
                "low_bytes (or both), e.g. Watermarks(high_refs=1024, low_refs=512)"
            )

    def over_high(self, refs: int, nbytes: int) -> bool:
        """Whether a backlog of ``refs`` refs and ``nbytes`` bytes is above a high mark."""
        return (self.high_refs is not None and refs > self.high_refs) or (
            self.high_bytes is not None and nbytes > self.high_bytes
        )

    def below_low(self, refs: int, nbytes: int) -> bool:
        """Whether a backlog of ``refs`` refs and ``nbytes`` bytes is below every low mark."""
        return (self.low_refs is None or refs < self.low_refs) and (
            self.low_bytes is None or nbytes < self.low_bytes
        )

    def describe(self) -> str:
        parts = []
        if self.high_refs is not None:
            parts.append(f"high_refs={self.high_refs}, low_refs={self.low_refs}")
        if self.high_bytes is not None:
            parts.append(f"high_bytes={self.high_bytes}, low_bytes={self.low_bytes}")
        return ", ".join(parts)


class Gate:
    """The hysteresis between the marks: open, or closed until below the low marks."""

    def __init__(self, marks: Watermarks) -> None:
        if not isinstance(marks, Watermarks):
            raise ArgumentTypeError(
                f"backpressure must be a dataflow.Watermarks or None, got {type(marks).__name__}"
            )
        self.marks = marks
        self.open = True

    def admit(self, refs: int, nbytes: int, add_refs: int, add_bytes: int) -> bool:
        """One step: may ``add_refs`` refs of ``add_bytes`` bytes join this backlog now?"""
        if not self.open and self.marks.below_low(refs, nbytes):
            self.open = True
        if self.open and refs > 0 and self.marks.over_high(refs + add_refs, nbytes + add_bytes):
            self.open = False
        return self.open


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a torch dtype, by its name (``float32`` -> 4), without torch.

    Every torch dtype names its bits (``bfloat16``, ``float8_e4m3fn``,
    ``complex64``, ``bits4x2``); the ones under a byte (``int4``, ``bits1x8``,
    ``float4_e2m1fn_x2``) take a byte each, as torch stores them, and so does
    ``bool``.
    """
    bits = _BITS.search(dtype_name)
    return max(1, int(bits.group()) // 8) if bits else 1


def ref_nbytes(ref_json: str) -> int:
    """Tensor bytes of a committed ref, from its JSON specs (0 if it cannot be read)."""
    try:
        specs = json.loads(ref_json)["specs"]
        return sum(math.prod(s["shape"]) * itemsize(s["dtype"]) for s in specs.values())
    except (ValueError, TypeError, KeyError, AttributeError):
        return 0  # a damaged commit: the fold reports it (replay(...).verify())


class Backlog:
    """A run's un-trained features in the store, kept current by folding new events only.

    ``refs`` and ``bytes`` count the samples that are pending or leased in
    the live fold ``state`` (a :class:`RunView`'s): committed, stored, not
    trained in the current lineage, not dead, not waiting for regeneration.
    A refresh folds the events after ``state.head_seq`` and settles only the
    samples they name, except after a resume or a new data epoch, which move
    every sample.
    """

    def __init__(self, ledger: Ledger, run_id: str) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.view = RunView(ledger, run_id, after_rows=self._folded)
        self._nbytes: dict[str, int] = {}  # committed id -> bytes of its newest revision
        self._members: dict[str, int] = {}  # backlog id -> the bytes it counts with
        self.bytes = 0
        #: Events folded so far, by kind (a batch row once for each sample it names).
        self.kinds: collections.Counter[str] = collections.Counter()
        self._snapshot_counted = False  # the kinds the view's snapshot holds are in ``kinds``
        self._recount_due = False

    @property
    def state(self) -> RunState:
        """The live fold of the run."""
        return self.view.state

    @property
    def refs(self) -> int:
        return len(self._members)

    def nbytes(self, sample_id: str) -> int:
        """Tensor bytes of ``sample_id``'s newest committed revision (0 if unknown)."""
        return self._nbytes.get(sample_id, 0)

    def refresh(self) -> None:
        """Fold the events that came since the last refresh (a failed read loses none)."""
        self._recount_due = self.state.head_seq == 0  # the first refresh: count once at the end
        try:
            self.view.catch_up()
            self._count_snapshot_kinds()
        finally:
            if self._recount_due:
                self._recount()

    def _folded(self, chunk: list[Row]) -> None:
        """After the view folded ``chunk``: the kinds, the sizes of new commits, the members."""
        chunk_kinds = collections.Counter(r[1] for r in chunk)
        batches = [
            (r[1], row_samples(r[1], None, r[7]))
            for r in chunk
            if r[2] is None and r[1] in Kind.BATCHED
        ]
        for kind, ids in batches:  # counted by sample: a batch row once for each it names
            chunk_kinds[kind] += max(len(ids), 1) - 1
        self.kinds.update(chunk_kinds)
        if chunk_kinds[Kind.COMMIT]:
            for r in chunk:
                if r[1] == Kind.COMMIT:
                    self._sized(r[2], r[3] or 0, r[7])
        if chunk_kinds[Kind.RESUME] or chunk_kinds[Kind.DATA_EPOCH]:
            self._recount_due = True  # every sample may have moved
        if chunk_kinds[Kind.EXCLUDE] or chunk_kinds[Kind.INCLUDE]:
            self._recount_due = True  # their rows name a batch of samples in the payload
        if not self._recount_due:
            named = {r[2] for r in chunk if r[2] is not None}
            for sid in named.union(*(ids for _, ids in batches)):
                self._settle(sid)

    def _sized(self, sample_id: str, revision: int, payload: str) -> None:
        """Note the size of a commit the fold took, if it is the sample's newest revision."""
        try:
            newest = self.state.revision(sample_id)
        except KeyError:
            return  # refused by the fold (a damaged commit)
        if newest == revision:
            self._nbytes[sample_id] = ref_nbytes(payload)

    def _count_snapshot_kinds(self) -> None:
        """The counts by kind go on from the run's start, not from the view's snapshot."""
        if self._snapshot_counted or not self.view.started:
            return
        if self.view.snapshot_seq > 0:
            counts = self.ledger.kind_counts(
                self.run_id, upto_seq=self.view.snapshot_seq, by_sample=True
            )
            self.kinds.update(counts)
        self._snapshot_counted = True

    def _sizes(self, sample_ids: list[str]) -> None:
        """Fill in the sizes of ``sample_ids`` from their commits in the ledger."""
        for start in range(0, len(sample_ids), _CHUNK):
            chunk = sample_ids[start : start + _CHUNK]
            revisions = {sid: self.state.revision(sid) for sid in chunk}
            for sid, payload in self.ledger.commit_payloads(self.run_id, revisions).items():
                self._nbytes[sid] = ref_nbytes(payload)

    def _holds(self, sample_id: str) -> bool:
        return self.state.is_pending(sample_id) or sample_id in self.state.leased

    def _settle(self, sample_id: str) -> None:
        counted = self._members.pop(sample_id, None)
        if counted is not None:
            self.bytes -= counted
        if self._holds(sample_id):
            if sample_id not in self._nbytes:
                self._sizes([sample_id])
            nbytes = self._nbytes.get(sample_id, 0)
            self._members[sample_id] = nbytes
            self.bytes += nbytes
        else:
            self._nbytes.pop(sample_id, None)  # read again from the ledger if it comes back

    def _recount(self) -> None:
        held = [*self.state.pending, *self.state.leased]
        self._sizes([s for s in held if s not in self._nbytes])
        self._members = {s: self._nbytes.get(s, 0) for s in held}
        self._nbytes = {s: self._nbytes[s] for s in held if s in self._nbytes}
        self.bytes = sum(self._members.values())


class ProducerBlocking:
    """One producer's time blocked on one cause, in episodes: logged once each, and counted.

    ``cause`` is ``"credit"`` (its stream's consumers grant no credit: every window is
    full, or none is reachable) or ``"high_mark"`` (the run's un-trained backlog is at
    its :class:`Watermarks`' high mark). An episode starts when the producer has to wait
    and ends when it gets through (the stream took every committed ref; the gate
    admitted an emit) or closes. One that lasts ``BLOCKED_WARNING_S`` logs a warning
    then (on logger ``dataflow.backpressure``, with the run and producer id, while the
    producer is still blocked), and another with its duration when it ends. The metrics
    (:class:`RunMetrics`) report ``blocked`` and the ``seconds`` spent waiting.
    """

    def __init__(self, run_id: str, producer_id: str, cause: str, what: str) -> None:
        self.run_id = run_id
        self.producer_id = producer_id
        self.cause = cause
        self._what = what  # what the producer waits for, in the log
        self._lock = threading.Lock()
        self._seconds = 0.0  # waits that ended
        self._wait_started: float | None = None
        self._episode_started: float | None = None
        self._warned = False
        with _blockings_lock:  # a metrics thread may be listing them
            _BLOCKINGS.add(self)

    @property
    def in_episode(self) -> bool:
        """Whether the producer is blocked now (read without the lock: a hint)."""
        return self._episode_started is not None

    def reading(self) -> tuple[bool, float]:
        """Whether an episode is on, and the seconds spent waiting so far (this wait's too)."""
        with self._lock:
            waiting = 0.0 if self._wait_started is None else time.monotonic() - self._wait_started
            return self._episode_started is not None, self._seconds + waiting

    @contextlib.contextmanager
    def waiting(self, what: str | None = None) -> Iterator[None]:
        """Around one wait of the producer; it starts an episode unless one is on."""
        with self._lock:
            self._wait_started = now = time.monotonic()
            starts = self._episode_started is None
            if starts:
                self._episode_started = now
            if what is not None:
                self._what = what
        if starts:
            _watch(self)  # outside our lock: the watch thread takes its lock, then ours
            log.debug(
                "producer %r of run %r waits (%s): %s",
                self.producer_id, self.run_id, self.cause, self._what,
                extra=self._extra(0.0),
            )  # fmt: skip
        try:
            yield
        finally:
            with self._lock:
                self._seconds += time.monotonic() - now
                self._wait_started = None

    def warn_if_long(self) -> bool:
        """Warn once the episode has lasted ``BLOCKED_WARNING_S``; True when no longer watched."""
        with self._lock:
            if self._episode_started is None or self._warned:
                return True
            lasted = time.monotonic() - self._episode_started
            if lasted < BLOCKED_WARNING_S:
                return False
            self._warned = True
            log.warning(
                "producer %r of run %r is blocked for %.1f s so far: %s",
                self.producer_id, self.run_id, lasted, self._what,
                extra=self._extra(lasted),
            )  # fmt: skip
            return True

    def end(self, how: str = "goes on") -> None:
        """The producer got through (or closes): the episode, if one is on, ends."""
        if not self.in_episode:  # the common case, read without the lock
            return
        with self._lock:
            if self._episode_started is None:
                return
            lasted = time.monotonic() - self._episode_started
            self._episode_started = None
            warned, self._warned = self._warned, False
            if warned:
                log.warning(
                    "producer %r of run %r %s after %.1f s blocked (%s)",
                    self.producer_id, self.run_id, how, lasted, self.cause,
                    extra=self._extra(lasted),
                )  # fmt: skip
            else:
                log.debug(
                    "producer %r of run %r %s after %.3f s blocked (%s)",
                    self.producer_id, self.run_id, how, lasted, self.cause,
                    extra=self._extra(lasted),
                )  # fmt: skip

    def _extra(self, lasted: float) -> dict[str, object]:
        return {
            "run_id": self.run_id,
            "producer_id": self.producer_id,
            "blocked_on": self.cause,
            "blocked_seconds": lasted,
        }


def producer_blockings(run_id: str) -> list[ProducerBlocking]:
    """The producers of ``run_id`` in this process, each cause apart (for the metrics)."""
    with _blockings_lock:
        return [b for b in _BLOCKINGS if b.run_id == run_id]


_BLOCKINGS: weakref.WeakSet[ProducerBlocking] = weakref.WeakSet()
_blockings_lock = threading.Lock()
_watched: set[ProducerBlocking] = set()
_watch_lock = threading.Lock()
_watcher: threading.Thread | None = None


def _watch(blocking: ProducerBlocking) -> None:
    """Have the watch thread warn for ``blocking``'s episode once it lasts long enough.

    A producer blocked in a send does not get the control back for the sender's whole
    timeout (30 s by default), so a thread of its own says it while the wait goes on.
    The thread runs only while an episode has not warned and not ended.
    """
    global _watcher
    with _watch_lock:
        _watched.add(blocking)
        if _watcher is None or not _watcher.is_alive():  # not alive: a forked child
            _watcher = threading.Thread(
                target=_watch_episodes, name="dataflow-backpressure-watch", daemon=True
            )
            _watcher.start()


def _watch_episodes() -> None:
    global _watcher
    while True:
        time.sleep(_WATCH_S)
        with _watch_lock:
            done = {blocking for blocking in _watched if blocking.warn_if_long()}
            _watched.difference_update(done)
            if not _watched:
                _watcher = None
                return


class ProducerGate:
    """A producer's side of backpressure: the gate over its run's backlog."""

    def __init__(self, ledger: Ledger, run_id: str, producer_id: str, marks: Watermarks) -> None:
        self.gate = Gate(marks)
        self.backlog = Backlog(ledger, run_id)
        self.blocking = ProducerBlocking(run_id, producer_id, "high_mark", "at the high mark")

    def wait(
        self,
        add_refs: int,
        add_bytes: int,
        *,
        block: bool,
        timeout: float | None,
        idle: Callable[[], object] | None = None,
    ) -> None:
        """Return once the gate admits the emit; BackpressureError if not blocking or timed out.

        ``idle`` is called before each look at the backlog (the producer sends there
        what its stream did not take, so that the backlog can drain). A wait is an
        episode of ``self.blocking``, which ends when an emit is admitted.
        """
        if not self._admits(add_refs, add_bytes, idle):
            started = time.monotonic()
            if not block:
                raise BackpressureError(self._refusal(add_refs, block, 0.0))
            with self.blocking.waiting(self._waiting_for()):
                while True:
                    waited = time.monotonic() - started
                    if timeout is not None and waited >= timeout:
                        raise BackpressureError(self._refusal(add_refs, block, waited))
                    time.sleep(
                        POLL_S if timeout is None else min(POLL_S, max(0.0, timeout - waited))
                    )
                    if self._admits(add_refs, add_bytes, idle):
                        break
        if self.blocking.in_episode:
            self.blocking.end(
                f"goes on, the backlog below the low marks ({self.backlog.refs} un-trained "
                f"refs, {self.backlog.bytes} bytes)"
            )

    def _admits(self, add_refs: int, add_bytes: int, idle: Callable[[], object] | None) -> bool:
        if idle is not None:
            idle()
        self.backlog.refresh()
        return self.gate.admit(self.backlog.refs, self.backlog.bytes, add_refs, add_bytes)

    def _waiting_for(self) -> str:
        return (
            f"run {self.backlog.run_id!r} has {self.backlog.refs} un-trained refs "
            f"({self.backlog.bytes} bytes) in the store, at the producer's high mark "
            f"({self.gate.marks.describe()}); it waits until the backlog is below the low "
            "marks: the consumers are not acking (down, or slower than the producers)"
        )

    def _refusal(self, add_refs: int, block: bool, waited: float) -> str:
        refs, nbytes = self.backlog.refs, self.backlog.bytes
        why = "emit(block=False)" if not block else f"waited {waited:.1f} s (the timeout)"
        return (
            f"run {self.backlog.run_id!r} has {refs} un-trained refs ({nbytes} bytes) in the "
            f"store: {add_refs} more would pass the producer's high mark, or it has not fallen "
            f"below the low mark since ({self.gate.marks.describe()}); {why}: nothing was "
            "stored or committed. Emits go on once the backlog is below the low marks: train "
            "(ack) what is pending, or retry later"
        )


def tensors_nbytes(tensors: object) -> int:
    """Bytes of an emit's tensors (0 for what is not a tensor: the store's put refuses it)."""
    if not isinstance(tensors, Mapping):
        return 0
    total = 0
    for tensor in tensors.values():
        nbytes = getattr(tensor, "nbytes", 0)
        total += nbytes if isinstance(nbytes, int) else 0
    return total
