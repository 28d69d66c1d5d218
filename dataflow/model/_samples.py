"""The per-sample state of a run: refs, the pending queues of each rank, and the leases.

A base of :class:`~dataflow.model._fold.RunState`; the handlers of the fold move samples
between these structures.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

from dataflow.model._lineage import seeded_order
from dataflow.model._ref_codec import ref_from_json
from dataflow.model._refs import SampleRef


class _Refs(Mapping[str, SampleRef]):
    """Committed refs by id (commit order), decoded from their JSON on access."""

    def __init__(self, state: SampleQueues) -> None:
        self._state = state

    def __getitem__(self, sample_id: str) -> SampleRef:
        return self._state.ref(sample_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state._commits)

    def __len__(self) -> int:
        return len(self._state._commits)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._state._commits


class SampleQueues:
    """Refs by id, each rank's queue of pending ids, and the moves between the queues.

    A base of RunState, working on the attributes ``RunState.__init__`` declares.
    """

    __slots__ = ()

    @property
    def committed(self) -> Mapping[str, SampleRef]:
        return _Refs(self)

    @property
    def pending(self) -> list[str]:
        ids = [sid for queue in self._pending.values() for sid in queue]
        return sorted(ids, key=self._queue_pos.__getitem__)

    def ref(self, sample_id: str) -> SampleRef:
        """The committed ref of ``sample_id`` (its newest revision); KeyError if uncommitted."""
        return self.refs([sample_id])[sample_id]

    def refs(self, sample_ids: Iterable[str]) -> dict[str, SampleRef]:
        """The committed refs of ``sample_ids``, with one ledger read for those not in memory."""
        raw = {sid: self._json.get(sid) for sid in sample_ids}
        missing = {sid: self.revision(sid) for sid, text in raw.items() if text is None}
        if missing:
            if self._ref_source is None:
                raise KeyError(next(iter(missing)))
            raw.update(self._ref_source.commit_payloads(self.run_id, missing))
        return {sid: ref_from_json(raw[sid]) for sid in raw}  # type: ignore[arg-type]

    def revision(self, sample_id: str) -> int:
        if sample_id not in self._commits:
            raise KeyError(sample_id)
        return self._revisions.get(sample_id, 0)

    def pending_for(self, rank: int, *, requeued_only: bool = False) -> Iterator[str]:
        for sid in self._pending.get(rank, {}):
            if not requeued_only or sid in self._requeued:
                yield sid

    def pending_count(self, rank: int) -> int:
        """How many samples wait in ``rank``'s queue: ``pending_for(rank)``'s length."""
        return len(self._pending.get(rank, ()))

    def is_pending(self, sample_id: str) -> bool:
        return sample_id in self._queue_pos

    def releasable_at(self, step: int) -> list[str]:
        """Ids trained at or before ``step`` in this lineage whose features are still stored."""
        return [sid for sid, s in self._unreleased_acks.items() if s <= step]

    def _enqueue(self, sample_id: str, owner: int, *, requeued: bool) -> None:
        if sample_id in self.excluded:
            return  # a nack or a lost report of an excluded sample: it is not leased again
        self._pending.setdefault(owner, {})[sample_id] = None
        self._queue_pos[sample_id] = self._next_pos
        self._next_pos += 1
        if requeued:
            self._requeued.add(sample_id)

    def _dequeue(self, sample_id: str) -> int | None:
        """Take ``sample_id`` off its queue; the rank that owned it, None if not pending."""
        if self._queue_pos.pop(sample_id, None) is None:
            return None
        owner = None
        for rank, queue in self._pending.items():
            if queue.pop(sample_id, 0) is None:
                owner = rank
                break
        self._requeued.discard(sample_id)
        return owner

    def _round_robin_owner(self) -> int:
        owner = self._next_owner
        self._next_owner = (owner + 1) % self.world_size
        return owner

    def _retry_rank(self, nacked_by: object, queue_rank: int | None) -> int:
        """The queue a retryable nack goes back to: that of the rank that nacked the sample.

        That rank is alive (it just wrote) and is not drained while its queue holds the
        retry, so a retry is never stranded on a rank that drained and exited, as a
        round-robin owner could be. A nack records its rank when the world has more than
        one (a streamed ref may have sat in another rank's queue); without it (one rank,
        older logs) the queue the lease took the sample from. Ledger leases come from the
        lessee's own queue, so with ``order_seed`` this is the sample's seeded owner.
        """
        for rank in (nacked_by, queue_rank):
            if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self.world_size:
                return rank
        return self._round_robin_owner()

    def _end_lease(self, seq: int, kind: str, sid: str, actor: str) -> bool:
        """End ``actor``'s lease of ``sid`` (an ack, nack or lost); False if it held none."""
        if self.leased.get(sid) != actor:
            self.violations.append(
                f"seq {seq}: {kind} of {sid!r} by {actor!r}, which did not lease it"
            )
            return False
        del self.leased[sid]
        self._lessee_rank.pop(sid, None)
        return True

    def _forget_json(self, sid: str) -> None:
        """Drop a trained sample's ref JSON; it is read from the ledger if ever needed again."""
        if self._json.pop(sid, None) is not None:
            self._json_dropped += 1
            # A dict never shrinks by deleting: rebuild it once most of it is gone.
            if self._json_dropped > 4096 and self._json_dropped > 3 * len(self._json):
                self._json, self._json_dropped = dict(self._json), 0

    def _resort(self) -> None:
        """Seeded order: every pending id back at its place in the data epoch's order."""
        pending, requeued = set(self._queue_pos), self._requeued
        self._pending = {r: {} for r in range(self.world_size)}
        self._queue_pos, self._requeued = {}, set()
        for index, sid in enumerate(self._data_epoch_order(*self._order_args)):
            if sid in pending:
                self._enqueue(sid, index % self.world_size, requeued=sid in requeued)

    def _unreleased_after(self, trained: Mapping[str, int]) -> list[str]:
        """Trained ids whose features are still stored, in commit order."""
        return [
            s
            for s in self._commits
            if s in trained and s not in self.released and s not in self.lost
        ]

    def _refill(
        self, order: list[str], *, requeued: bool, untrained: set[str] | None = None
    ) -> list[str]:
        """Make every live, untrained id of ``order`` pending again; return them in order.

        ``untrained``: ids that hold every committed id not in ``self.trained`` (and maybe
        more); then only those are looked at, in C, instead of every id. Checked by count:
        when it holds fewer, every id is looked at as without it.
        """
        picked: Iterable[tuple[int, str]] = enumerate(order)
        if untrained is not None:
            trained, commits = self.trained, self._commits
            untrained = {sid for sid in untrained if sid in commits and sid not in trained}
            # A subset of the committed, untrained ids as large as that set is that set.
            if len(untrained) == len(commits) - len(trained):
                hits = itertools.compress(itertools.count(), map(untrained.__contains__, order))
                picked = ((index, order[index]) for index in hits)
        self._pending = {r: {} for r in range(self.world_size)}
        self._queue_pos = {}
        self._requeued = set()
        self.regenerate = {}
        self._unreleased_acks = {}
        queued: list[str] = []
        seeded = self.order_seed is not None
        for index, sid in picked:
            if sid in self.dead or sid in self.trained or sid in self.excluded:
                continue
            if sid in self.released or sid in self.lost:
                self.regenerate[sid] = None
                continue
            # Seeded: the owner is fixed by the place in the whole order, so a resume gives
            # each rank the rest of exactly the queue it had.
            owner = (index if seeded else len(queued)) % self.world_size
            self._enqueue(sid, owner, requeued=requeued)
            queued.append(sid)
        self._next_owner = len(queued) % self.world_size
        if self.release_policy != "never":  # nothing is ever released: nothing to track
            for sid, step in self.trained.items():
                if sid not in self.released:
                    self._unreleased_acks[sid] = step
        return queued

    def _data_epoch_order(self, data_epoch: int, seed: int | None, start_seq: int) -> list[str]:
        order_seed = self.order_seed
        if data_epoch == 0 or seed is None:
            commit_order = list(self._commits)
            return commit_order if order_seed is None else seeded_order(commit_order, order_seed)
        firsts = tuple(zip(self._commits, self._first_seqs, strict=True))
        before = [s for s, first in firsts if first < start_seq]
        after = [s for s, first in firsts if first > start_seq]
        if order_seed is not None:
            after = seeded_order(after, order_seed)
        return seeded_order(before, seed) + after
