"""A reproducible order for a streaming run: ``Consumer(order_seed=N, stream=..., producers=...)``.

Arrival order depends on timing; this order does not. Each named producer's samples are
numbered by the order of its first commits in the ledger (its k-th sample: deterministic
for a producer process that commits in order). The run's order is a sequence of slots,
round by round: round k holds the k-th sample of each named producer (sorted ids), in an
order the seed shuffles anew each round. Slot i belongs to rank ``i % world_size``, and
a rank leases its slots in order: it waits for the producer whose turn it is, and skips
the slots that are done (trained, dead, excluded) and those of a producer that closed
before making that many samples.

A lease takes ``max_refs`` slots or none (until the producers closed: then the rest),
so batches line up the same way whatever the timing: a run whose producers make the
same samples in the same order trains in the same order, and a resume from any
checkpoint continues exactly where the uninterrupted run would have. The stream's refs
only wake the rank: it hands their slots back at once and leases from the ledger.
"""

from __future__ import annotations

import hashlib
import itertools

from dataflow.live._consumer_writes import _FencedWrites, _locked
from dataflow.model._errors import InvalidArgumentError, LedgerStateError, StreamIdleError
from dataflow.model._fold import RunState


def round_order(producers: tuple[str, ...], seed: int, round_number: int) -> tuple[str, ...]:
    """The producers' order in round ``round_number``: a keyed hash of each id (stable
    across machines and Python versions)."""
    key = f"{seed}:{round_number}".encode()[:64]
    return tuple(
        sorted(
            producers,
            key=lambda p: hashlib.blake2b(p.encode(), key=key, digest_size=8).digest(),
        )
    )


class ProducerSlots:
    """The slots of one rank in a seeded streaming run (see the module's docstring)."""

    def __init__(self, producers: tuple[str, ...], seed: int, rank: int, world_size: int) -> None:
        self.producers = producers
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._rounds: dict[int, tuple[str, ...]] = {}

    def owner(self, slot: int) -> tuple[str, int]:
        """(producer id, k): slot ``slot`` holds that producer's k-th sample."""
        count = len(self.producers)
        number, place = divmod(slot, count)
        order = self._rounds.get(number)
        if order is None:
            if len(self._rounds) > 4096:
                self._rounds.clear()
            order = self._rounds[number] = round_order(self.producers, self.seed, number)
        return order[place], number

    def walk(self, start: int) -> itertools.count[int]:
        """This rank's slots from ``start`` (one of this rank's), without end."""
        return itertools.count(start, self.world_size)


#: What a slot holds, for a rank walking its slots.
_TAKE, _SKIP, _DONE, _WAIT, _END = range(5)


def slot_state(state: RunState, slots: ProducerSlots, slot: int) -> tuple[int, str | None]:
    """What ``slot`` holds in ``state``: take its sample (pending), skip it for now (leased
    by this rank, excluded), skip it for good in this lineage (trained, dead, or an
    empty slot of a closed producer), wait (its producer has not made it yet, or it waits
    for regeneration), or end (every producer closed, and no later slot holds a sample)."""
    producer, k = slots.owner(slot)
    made = state.producer_commits.get(producer, ())
    if k >= len(made):
        if producer not in state.closed:
            return _WAIT, None
        if k >= max(len(state.producer_commits.get(p, ())) for p in slots.producers) and all(
            p in state.closed for p in slots.producers
        ):
            return _END, None
        return _DONE, None
    sid = made[k]
    if state.is_pending(sid):
        return _TAKE, sid
    if sid in state.excluded or sid in state.leased:
        return _SKIP, sid
    if sid in state.trained or sid in state.dead:
        return _DONE, sid
    return _WAIT, sid  # to regenerate (released or lost): it comes back to its slot


class _SeededStream(_FencedWrites):
    """The Consumer's leases in a seeded streaming run (``order_seed`` with a ``stream``):
    it overrides where a rank's work comes from and when the rank is done."""

    #: This rank's slots (None: not a seeded streaming run).
    _slots: ProducerSlots | None = None
    #: The first of this rank's slots that may not be done, for (epoch, data epoch).
    _cursor: tuple[int, int, int] = (-1, -1, 0)

    def _start_slots(self) -> None:
        """Set up the slots when ``order_seed`` and ``stream`` are both given (at init)."""
        if self.order_seed is None or self.stream is None:
            return
        if not self.producers:
            raise InvalidArgumentError(
                "order_seed with a stream needs producers=[...]: the order is fixed by each "
                "named producer's own sequence of samples (name every producer of the run)"
            )
        self._slots = ProducerSlots(
            tuple(sorted(self.producers)), self.order_seed, self.rank, self.world_size
        )

    def _walk_slots(self, max_refs: int | None) -> tuple[list[str], bool, int]:
        """This rank's next pending slots, in order, up to ``max_refs`` (None: count them
        all): their ids, whether the walk reached the end of the run's slots, and how many
        slots of this rank are still to train (pending or waiting), counted when
        ``max_refs`` is None."""
        state, slots = self.state, self._slots
        assert slots is not None
        self._check_named(state)
        epoch, data_epoch, start = self._cursor
        if (epoch, data_epoch) != (state.epoch, state.data_epoch):
            start = self.rank
        take: list[str] = []
        todo = 0
        advancing = True
        what = _END
        for slot in slots.walk(start):
            what, sid = slot_state(state, slots, slot)
            if what == _END:
                break
            if what == _DONE:
                if advancing:
                    start = slot + self.world_size
                continue
            advancing = False
            if what == _SKIP:
                continue
            if max_refs is None:
                todo += 1
                continue
            if what == _WAIT:
                break
            take.append(sid)  # type: ignore[arg-type]
            if len(take) >= max_refs:
                break
        self._cursor = (state.epoch, state.data_epoch, start)
        return take, what == _END, todo

    def _check_named(self, state: RunState) -> None:
        unnamed = sorted(set(state.producer_commits) - set(self._slots.producers))  # type: ignore[union-attr]
        if unnamed:
            raise LedgerStateError(
                f"producers {unnamed} committed to run {self.run_id!r} but are not named in "
                f"producers={sorted(self.producers)}: a seeded streaming run leases only the "
                "named producers' samples; name every producer of the run"
            )

    # -- the overrides of _Leasing ------------------------------------------------
    def _seeded_order_waits(self) -> bool:
        if self._slots is not None:
            return False  # the slots wait, one producer's turn at a time
        return super()._seeded_order_waits()  # type: ignore[misc]

    def _ready_to_lease(self, max_refs: int) -> list[str]:
        if self._slots is None:
            return super()._ready_to_lease(max_refs)  # type: ignore[misc]
        self._drain_stream()  # a lease ahead (ack_and_lease) never reads the stream
        take, ended, _ = self._walk_slots(max_refs)
        # All or nothing until the end: batches line up whatever the producers' timing.
        return take if ended or len(take) >= max_refs else []

    def _leases_from_ledger(self) -> bool:
        if self._slots is not None:
            return True
        return super()._leases_from_ledger()  # type: ignore[misc]

    def _stream_ended(self) -> bool:
        if self._slots is None:
            return super()._stream_ended()  # type: ignore[misc]
        self._drain_stream()
        return True  # nothing is leased off the stream: the ledger has every ref

    def _drain_stream(self) -> None:
        """Take what the stream holds and give its slots back at once: its refs only say
        that commits came, which the ledger holds."""
        stream = self.stream
        assert stream is not None
        for _ in range(64):  # bounded: a busy stream is drained again at the next lease
            try:
                received = stream.receive(1024, timeout=0)
            except StreamIdleError:
                return
            if not received:
                return
            stream.credit(len(received))

    def _seeded_stream_done(self) -> bool:
        """Every named producer closed (the ledger says so: a close follows the last
        commit) and none of this rank's slots is left."""
        state = self.state
        if not self.producers <= state.closed:
            return False
        take, ended, _ = self._walk_slots(1)  # stops at the first slot still to train
        return ended and not take

    @property
    @_locked
    def producers_done(self) -> bool:
        if self._slots is not None:
            return self.producers <= self.state.closed
        return super().producers_done  # type: ignore[misc]

    @property
    @_locked
    def drained(self) -> bool:
        if self._slots is not None:
            return not self._still_reclaimed() and self._seeded_stream_done()  # type: ignore[attr-defined]
        return super().drained  # type: ignore[misc]

    @_locked
    def remaining(self, *, refresh: bool = True) -> int | None:
        if self._slots is None:
            return super().remaining(refresh=refresh)  # type: ignore[misc]
        if refresh:
            self.refresh()  # type: ignore[attr-defined]
        else:
            self._fencing_epoch()
        if not self.producers <= self.state.closed:
            return None
        _, _, todo = self._walk_slots(None)
        return todo
