"""The fold: every state of a run, derived from its log.

``RunState.apply(row)`` consumes one event; :func:`replay` folds a whole run.
Producers and consumers keep a live RunState that they bring up to date
inside each append transaction, so what they validate against is exactly
what a replay of the log gives.

RunState's concerns live in its bases: the handlers of each kind
(:mod:`dataflow.model._handlers`), the per-sample state (:mod:`dataflow.model._samples`)
and the lineage (:mod:`dataflow.model._lineage`). Bases, not members: the fold reads and
writes the same few dicts on every row, and one attribute hop more per access is a
measurable share of a replay.
"""

from __future__ import annotations

import itertools
import warnings
from array import array
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from dataflow.model._errors import InvalidArgumentError
from dataflow.model._events import Kind
from dataflow.model._exclusions import ExclusionHandlers
from dataflow.model._handlers import HANDLERS, EventHandlers
from dataflow.model._lineage import (
    RELEASE_POLICIES,
    Checkpoint,
    IdHashes,
    LineageBranch,
    LineageQueries,
    ReconcilePlan,
    WholeFoldNeeded,
    _TrainedAt,
    seeded_order,
)
from dataflow.model._samples import SampleQueues

__all__ = [
    "RELEASE_POLICIES",
    "Checkpoint",
    "ReconcilePlan",
    "RefSource",
    "RunState",
    "WholeFoldNeeded",
    "seeded_order",
]


class RefSource(Protocol):
    """Where a RunState reads what it does not keep: the log's store (a ``Ledger``)."""

    def commit_payloads(self, run_id: str, revisions: Mapping[str, int]) -> Mapping[str, str]:
        """The ref JSON of each ``sample_id: revision`` committed in ``run_id``."""
        ...

    def unseen_rows(self, run_id: str) -> Iterable[tuple[int, str, str | None]]:
        """(seq, kind, sample id) of the run's rows no fold reads (a seq below 1)."""
        ...

    def rows(
        self, run_id: str, *, after_seq: int = 0, upto_seq: int | None = None
    ) -> Iterable[Any]:
        """The run's raw event rows in seq order (what a forgetting fold refolds from)."""
        ...


class RunState(EventHandlers, ExclusionHandlers, SampleQueues, LineageQueries):
    """The state of one run after folding its log up to ``head_seq``.

    Attributes (all derived): ``committed`` (id -> SampleRef, commit order),
    ``pending`` (ids waiting to be leased, queue order), ``leased`` (id ->
    consumer id), ``trained`` (id -> step, in the current lineage and data
    epoch), ``released`` (ids whose features were freed), ``dead`` (id ->
    reason), ``lost`` (id -> reason: features found missing or corrupt on a load, waiting
    for regeneration; never counted as a failed attempt), ``regenerate`` (ids to train
    again whose features are gone: released, or lost), ``excluded`` (id -> reason: taken
    out of the run by ``Consumer.exclude``; never leased again, whatever the lineage;
    ``excluded_total`` counts every exclusion, those an inclusion undid too),
    ``checkpoints``, ``removed_checkpoints`` (seq -> reason), ``epoch``,
    ``data_epoch``, ``head_seq``.

    ``ref_source``: the ledger the log came from. With it, the state keeps the ref
    JSON of live samples only (not yet trained) and reads the others' from the
    ledger when asked, which is most of a long run's memory; without it, every
    ref stays in memory. With it, :meth:`forget_finished` makes the state forget each
    finished sample as a whole (a live consumer's fold: see there).
    """

    def __init__(self, run_id: str, *, ref_source: RefSource | None = None) -> None:
        self.run_id = run_id
        self.head_seq = 0
        self.epoch = 0
        self.data_epoch = 0
        self._ref_source = ref_source
        # Insertion order is first-commit order; `_first_seqs` is aligned with it.
        # id -> the same id: the one str object every structure of the state shares, so
        # the copies each event row brings are freed (ids are most of a run's memory).
        self._commits: dict[str, str] = {}
        self._revisions: dict[str, int] = {}  # id -> newest revision, where it is not 0
        self._first_seqs = array("q")
        self._json: dict[str, str] = {}  # id -> ref JSON of its newest revision (see ref_source)
        self._json_dropped = 0
        self._steps: dict[int, int] = {}  # one int object per step, shared by its acks
        self.leased: dict[str, str] = {}
        self.trained: dict[str, int] = {}
        self.released: set[str] = set()
        self.dead: dict[str, str] = {}
        self.lost: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.regenerate: dict[str, None] = {}
        #: id -> why it was excluded; outside the lineage (see model/_exclusions.py).
        self.excluded: dict[str, str] = {}
        self.excluded_total = 0
        self.checkpoints: list[Checkpoint] = []
        #: seq of a checkpoint whose files were removed -> why (retention, rewind).
        self.removed_checkpoints: dict[int, str] = {}
        self.producers: set[str] = set()
        #: producer id -> the ids of its first commits, in commit order: its k-th sample is
        #: the k-th (what fixes a seeded streaming run's order, live/_seeded_stream.py).
        self.producer_commits: dict[str, list[str]] = {}
        self.closed: set[str] = set()
        #: producer id -> the producer epoch holding it (its newest CLAIM); an id never
        #: claimed (written before producer epochs) writes with epoch 0.
        self.producer_epochs: dict[str, int] = {}
        #: Every store a producer of the run claimed to write to (``FeatureStore.open_uri``),
        #: in the order first claimed: what ``dataflow gc`` collects.
        self.store_uris: dict[str, None] = {}
        #: Producers whose last close says they streamed no refs (``Producer(stream=None)``,
        #: e.g. a Trainer's regeneration): a consumer's stream does not wait for them.
        self.unstreamed: set[str] = set()
        self.plans: dict[int, ReconcilePlan] = {}
        self.violations: list[str] = []
        # Pending work: per owner rank, an insertion-ordered dict; `_requeued`
        # marks the entries that came back through a resume, a nack or a new
        # data epoch (a streaming consumer takes those from the ledger).
        self._pending: dict[int, dict[str, None]] = {0: {}}
        self._requeued: set[str] = set()
        self._queue_pos: dict[str, int] = {}
        self._lessee_rank: dict[str, int] = {}  # leased id -> the rank whose queue it left
        self._lost_rank: dict[str, int] = {}  # lost id -> that rank, which regenerates it
        self._next_pos = 0
        self._next_owner = 0
        self._unreleased_acks: dict[str, int] = {}
        self._epochs: dict[int, LineageBranch] = {}
        self._world_size = 1  # of the current epoch; read on every commit
        self._resumes: list[int] = []
        self._order_args: tuple[int, int | None, int] = (0, None, 0)  # the data epoch's order
        # Forgetting (forget_finished): the hashes of the finished ids no longer kept, the
        # ids that may have finished since the last compaction, and how many were forgotten.
        self._forgetting = False
        self._forgotten = IdHashes()
        self._forgotten_count = 0
        self._finishing: list[str] = []
        # Forgetting: the rank whose new samples' ref JSON is kept (None: every sample's).
        self._json_rank: int | None = None

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def producers_done(self) -> bool:
        """True when at least one producer closed and every producer that claimed or
        committed closed (a close counts from the id's current holder only)."""
        return bool(self.closed) and self.producers <= self.closed

    def observable(self) -> dict[str, Any]:
        """Everything observable, as plain data (for comparing a live state with a replay)."""
        return {
            "head_seq": self.head_seq,
            "epoch": self.epoch,
            "data_epoch": self.data_epoch,
            "committed": {sid: self._revisions.get(sid, 0) for sid in self._commits},
            "pending": self.pending,
            "requeued": sorted(self._requeued),
            "leased": dict(self.leased),
            "trained": dict(self.trained),
            "released": sorted(self.released),
            "dead": dict(self.dead),
            "lost": dict(self.lost),
            "regenerate": list(self.regenerate),
            "excluded": dict(self.excluded),
            "checkpoints": list(self.checkpoints),
            "removed_checkpoints": dict(self.removed_checkpoints),
            "closed": sorted(self.closed),
            "plans": dict(self.plans),
        }

    def snapshot(self) -> dict[str, Any]:
        """Deprecated alias of :meth:`observable` (it has nothing to do with snapshots)."""
        warnings.warn(
            "RunState.snapshot() is deprecated: use RunState.observable()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.observable()

    def apply_rows(self, rows: Iterable[Any]) -> RunState:
        """Fold raw rows: (seq, kind, sample_id, revision, epoch, step, actor, payload, ts).

        A forgetting state (:meth:`forget_finished`) raises :class:`WholeFoldNeeded` at a
        row it cannot fold exactly, with ``head_seq`` left before that row.
        """
        # One loop with local names rather than a call per row: this is the
        # replay hot path (about a million rows a second on one core).
        handlers, fenced = HANDLERS, Kind.FENCED
        for seq, kind, sample_id, revision, epoch, step, actor, payload, _ts in rows:
            before = self.head_seq
            if seq <= before:
                continue
            self.head_seq = seq
            if kind in fenced and (epoch != self.epoch or self.epoch == 0):
                self._fencing_violation(seq, kind, epoch, actor)
                continue
            handler = handlers.get(kind)
            if handler is None:
                self.violations.append(f"seq {seq}: unknown event kind {kind!r}")
                continue
            try:
                handler(self, seq, sample_id, revision, epoch, step, actor, payload)
            except WholeFoldNeeded:
                self.head_seq = before
                raise
            except (
                ValueError,
                TypeError,
                AttributeError,
                KeyError,
                ZeroDivisionError,
                OverflowError,
            ) as exc:
                # A damaged or hand-edited row (a payload that is not the JSON its kind
                # needs): report it, with its seq, instead of failing the whole replay.
                why = f"{type(exc).__name__}: {exc}"[:200]
                self.violations.append(f"seq {seq}: unreadable {kind} event ({why})")
        return self

    def apply(self, row: Any) -> None:
        """Fold one raw row."""
        self.apply_rows((row,))

    @property
    def forgetting(self) -> bool:
        """Whether this state forgets finished samples (:meth:`forget_finished`)."""
        return self._forgetting

    @property
    def forgotten_count(self) -> int:
        """How many finished samples this state forgot (0 unless :meth:`forget_finished`)."""
        return self._forgotten_count

    def forget_finished(self, *, rank: int | None = None) -> None:
        """From now on, forget each finished sample: committed, trained in the current
        lineage and data epoch, its features released (or the policy 'never'), and
        neither leased, pending, dead, excluded, lost nor to regenerate.

        What a live consumer keeps of one is a 64-bit hash of its id, 12 to 24 bytes
        instead of about 250: ``committed``, ``trained``, ``released``, the lineage's acks
        and ``producer_commits`` hold the samples it keeps only, and :meth:`is_trained`
        answers for the others. Everything the consumer does with the fold stays exact:
        a row the state cannot fold exactly without what it forgot (a resume, a new data
        epoch, an exclusion, a commit or release of a forgotten id) raises
        :class:`WholeFoldNeeded`, and its ``RunView`` folds the run anew, whole, then
        forgets again. A forgetting state is never snapshotted, and a seeded run (whose
        streams place samples by their rank among a producer's commits) forgets nothing.
        Needs the ``ref_source`` the log came from. ``rank``: the rank whose samples the
        state's reader leases; the ref JSON of samples committed to another rank's queue
        from now on is not kept either (read from the ledger if that rank's queue ever
        passes one on), so what a rank keeps of the samples in flight is mostly its own.
        """
        if self._ref_source is None:
            raise InvalidArgumentError(
                f"the fold of run {self.run_id!r} has no ref_source, so it cannot forget: "
                "build it with RunState(run_id, ref_source=ledger), the ledger it folds"
            )
        self._forgetting = True
        self._json_rank = rank
        self._finishing = list(self.trained)
        self._compact()

    def is_trained(self, sample_id: str) -> bool:
        """Whether ``sample_id`` is trained in the current lineage and data epoch, forgotten
        finished samples included (for an id never committed, a 64-bit hash collision with
        a forgotten one answers True: about one in 10^13 for a million forgotten ids)."""
        if sample_id in self.trained:
            return True
        return sample_id not in self._commits and sample_id in self._forgotten

    def _may_have_finished(self, sid: str) -> None:
        self._finishing.append(sid)
        if len(self._finishing) >= max(_COMPACT_AT, len(self._commits) // _COMPACT_SHARE):
            self._compact()

    def _is_finished(self, sid: str) -> bool:
        return (
            sid in self.trained
            and (sid in self.released or self.release_policy == "never")
            and sid not in self.leased
            and sid not in self._queue_pos
            and sid not in self.dead
            and sid not in self.excluded
            and sid not in self.lost
            and sid not in self.regenerate
            and sid not in self._unreleased_acks
        )

    def _compact(self) -> None:
        """Forget the finished ids of ``_finishing``: their hashes go into ``_forgotten``,
        and every structure keyed by sample id is rebuilt without them (a dict never
        shrinks by deleting)."""
        finishing, self._finishing = self._finishing, []
        if self.order_seed is not None:
            return
        gone = {sid for sid in finishing if sid in self._commits and self._is_finished(sid)}
        if not gone:
            return
        for sid in gone:
            self._forgotten.add(sid)
        self._forgotten_count += len(gone)
        keep = [sid not in gone for sid in self._commits]
        self._commits = {sid: sid for sid in itertools.compress(self._commits, keep)}
        self._first_seqs = array("q", itertools.compress(self._first_seqs, keep))
        self._revisions = {s: r for s, r in self._revisions.items() if s not in gone}
        self._json = {s: j for s, j in self._json.items() if s not in gone}
        self._json_dropped = 0
        self.trained = {s: step for s, step in self.trained.items() if s not in gone}
        self.released = self.released - gone
        self.attempts = {s: n for s, n in self.attempts.items() if s not in gone}
        self.producer_commits = {
            p: [s for s in ids if s not in gone] for p, ids in self.producer_commits.items()
        }
        for node in self._epochs.values():
            node.acks.drop(gone)
        self._keep_plans_exact()

    def _keep_plans_exact(self) -> None:
        """A plan's ``trained`` not read yet is computed, when read, from a whole fold of
        the log up to this state's head then, not from this state's acks, which no longer
        hold every sample."""
        source, run_id = self._ref_source, self.run_id
        assert source is not None
        for plan in self.plans.values():
            ckpt = plan.checkpoint
            if isinstance(plan.trained, _TrainedAt) and ckpt is not None:

                def whole(ckpt: Checkpoint = ckpt) -> dict[str, int]:
                    rows = source.rows(run_id, upto_seq=self.head_seq)
                    return RunState(run_id).apply_rows(rows)._trained_at_checkpoint(ckpt)

                plan.trained.recompute_with(whole)

    def _fencing_violation(self, seq: int, kind: str, epoch: int, actor: str) -> None:
        if self.epoch == 0:
            self.violations.append(f"seq {seq}: {kind} before any resume (by {actor!r})")
        else:
            self.violations.append(
                f"seq {seq}: {kind} by {actor!r} with stale epoch {epoch} (run at {self.epoch})"
            )

    def verify(self) -> list[str]:
        """Every broken invariant of the run, as sentences; [] when the log is clean.

        Checks: each committed, non-dead, non-excluded sample is in exactly one of
        pending, leased, trained or regenerate (an excluded one in at most one of leased
        or trained: its lease ends, and what the lineage trained stays trained); no
        sample was trained twice in a data epoch of the lineage; acks and nacks came
        from the consumer holding the lease; no write came from a fenced-off epoch;
        releases respected the release policy; with the ledger it came from, no event
        has a seq the fold cannot read (below 1).
        """
        problems = list(self.violations)
        places: dict[str, list[str]] = {}
        for name, ids in (
            ("pending", self._queue_pos),
            ("leased", self.leased),
            ("trained", self.trained),
            ("regenerate", self.regenerate),
        ):
            for sid in ids:
                places.setdefault(sid, []).append(name)
        for sid in self._commits:
            where = places.get(sid, [])
            if sid in self.dead:
                if where and where != ["trained"]:
                    problems.append(f"{sid!r} is dead but also {where}")
            elif sid in self.excluded:
                if where not in ([], ["trained"], ["leased"]):
                    problems.append(f"{sid!r} is excluded but also {where}")
            elif len(where) != 1:
                problems.append(
                    f"{sid!r} is committed but in {where or 'no state'} "
                    "(expected exactly one of pending, leased, trained, regenerate)"
                )
        for sid in places:
            if sid not in self._commits:
                problems.append(f"{sid!r} appears in {places[sid]} but was never committed")
        if self._ref_source is not None:
            for seq, kind, sid in self._ref_source.unseen_rows(self.run_id):
                problems.append(
                    f"seq {seq}: {kind} event"
                    + (f" of {sid!r}" if sid is not None else "")
                    + " has a seq below 1, which no replay reads (a hand-edited or damaged "
                    "row; a commit there blocks the sample's commit): delete it or restore "
                    "the ledger"
                )
        return problems


#: A forgetting state compacts once this many ids (or half as many as it keeps) may have
#: finished: each compaction rebuilds what it keeps, so its cost is spread over as many.
_COMPACT_AT = 4096
_COMPACT_SHARE = 2
