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

:class:`Backlog` keeps the count current by folding only the events it has
not seen (``Ledger.rows(after_seq=...)``) into a live RunState; the metrics
collector uses it too.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from dataflow._errors import ArgumentTypeError, BackpressureError, InvalidArgumentError
from dataflow._events import Kind
from dataflow._projection import RunState

if TYPE_CHECKING:
    from dataflow._ledger import Ledger

log = logging.getLogger("dataflow")

#: How often a blocked producer looks at the ledger again.
POLL_S = 0.05
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
    the live fold ``state``: committed, stored, not trained in the current
    lineage, not dead, not waiting for regeneration. A refresh reads the
    events after ``state.head_seq`` and settles only the samples they name,
    except after a resume or a new data epoch, which move every sample.
    """

    def __init__(self, ledger: Ledger, run_id: str) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.state = RunState(run_id, ref_source=ledger)
        self._nbytes: dict[str, int] = {}  # committed id -> bytes of its newest revision
        self._members: dict[str, int] = {}  # backlog id -> the bytes it counts with
        self.bytes = 0
        #: Events folded so far, by kind.
        self.kinds: collections.Counter[str] = collections.Counter()

    @property
    def refs(self) -> int:
        return len(self._members)

    def nbytes(self, sample_id: str) -> int:
        """Tensor bytes of ``sample_id``'s newest committed revision (0 if unknown)."""
        return self._nbytes.get(sample_id, 0)

    def refresh(self) -> None:
        """Fold the events that came since the last refresh (a failed read loses none)."""
        recount = self.state.head_seq == 0  # the first refresh: count once at the end
        if recount:
            self._start_from_snapshot()
        rows = iter(self.ledger.rows(self.run_id, after_seq=self.state.head_seq))
        try:
            while chunk := list(itertools.islice(rows, _CHUNK)):
                commits = [(r[2], r[3] or 0, r[7]) for r in chunk if r[1] == Kind.COMMIT]
                self.state.apply_rows(chunk)
                chunk_kinds = collections.Counter(r[1] for r in chunk)
                self.kinds.update(chunk_kinds)
                for sid, revision, payload in commits:
                    try:
                        newest = self.state.revision(sid)
                    except KeyError:
                        continue  # refused by the fold (a damaged commit)
                    if newest == revision:
                        self._nbytes[sid] = ref_nbytes(payload)
                if chunk_kinds[Kind.RESUME] or chunk_kinds[Kind.DATA_EPOCH]:
                    recount = True  # every sample may have moved
                if not recount:
                    for sid in {r[2] for r in chunk if r[2] is not None}:
                        self._settle(sid)
        finally:
            if recount:
                self._recount()

    def _start_from_snapshot(self) -> None:
        """Start from the run's newest snapshot, with the sizes of what it holds un-trained."""
        restored = self.ledger.load_snapshot(self.run_id)
        if restored is None:
            return
        # The counts by kind go on from the run's start, not from the snapshot.
        counts = self.ledger.kind_counts(self.run_id, upto_seq=restored.head_seq)
        self.state = restored
        self.kinds.update(counts)

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


class ProducerGate:
    """A producer's side of backpressure: the gate over its run's backlog."""

    def __init__(self, ledger: Ledger, run_id: str, marks: Watermarks) -> None:
        self.gate = Gate(marks)
        self.backlog = Backlog(ledger, run_id)

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
        what its stream did not take, so that the backlog can drain).
        """
        started = time.monotonic()
        waiting = False
        while True:
            if idle is not None:
                idle()
            self.backlog.refresh()
            refs, nbytes = self.backlog.refs, self.backlog.bytes
            if self.gate.admit(refs, nbytes, add_refs, add_bytes):
                if waiting:
                    log.info(
                        "backpressure: run %r is below the low marks again (%d un-trained refs, "
                        "%d bytes); the producer goes on after %.1f s",
                        self.backlog.run_id, refs, nbytes, time.monotonic() - started,
                    )  # fmt: skip
                return
            waited = time.monotonic() - started
            if not block or (timeout is not None and waited >= timeout):
                raise BackpressureError(self._refusal(refs, nbytes, add_refs, block, waited))
            if not waiting:
                waiting = True
                log.info(
                    "backpressure: run %r has %d un-trained refs (%d bytes) in the store, at the "
                    "producer's high mark (%s); waiting until it is below the low marks",
                    self.backlog.run_id, refs, nbytes, self.gate.marks.describe(),
                )  # fmt: skip
            time.sleep(POLL_S if timeout is None else min(POLL_S, max(0.0, timeout - waited)))

    def _refusal(self, refs: int, nbytes: int, add_refs: int, block: bool, waited: float) -> str:
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


def check_wait(block: object, timeout: object) -> None:
    """Refuse bad ``block`` / ``timeout`` arguments of an emit, naming them."""
    if not isinstance(block, bool):
        raise ArgumentTypeError(f"block must be a bool, got {type(block).__name__} {block!r}")
    check_timeout(timeout, none_means="wait as long as it takes")


def check_timeout(timeout: object, *, none_means: str) -> None:
    """Refuse a ``timeout`` that is not None or a finite number of seconds >= 0."""
    if timeout is not None and (
        not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)
        or timeout < 0
    ):
        raise InvalidArgumentError(
            f"timeout must be a non-negative number of seconds or None ({none_means}), "
            f"got {timeout!r}"
        )
