"""The fold: every state of a run, derived from its log.

``RunState.apply(row)`` consumes one event; :func:`replay` folds a whole run.
Producers and consumers keep a live RunState that they bring up to date
inside each append transaction, so what they validate against is exactly
what a replay of the log gives.

Lineage. Each consumer epoch starts from a checkpoint (or from scratch), so
epochs form a tree. The trained set of a checkpoint C is what its lineage
acked up to it: the inherited set of C's epoch plus the acks of that epoch
with step <= C.step. Resuming from C makes the trained set exactly that;
acks after C in abandoned branches are void.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataflow.model._events import Kind, load_payload
from dataflow.model._refs import SampleRef, ref_from_ledger

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

RELEASE_POLICIES = ("on_checkpoint", "on_ack", "never")


@dataclass(frozen=True)
class Checkpoint:
    """A durable checkpoint recorded in the ledger."""

    seq: int
    epoch: int
    step: int
    path: str
    data_epoch: int
    #: The sha256 of the checkpoint's manifest, when its writer recorded one.
    digest: str | None = None


@dataclass(frozen=True)
class ReconcilePlan:
    """What a resume decided, derived from the log alone (so replay reaches the same plan).

    ``requeued``: samples to train again, in order (this rank's share when the
    plan comes from ``Consumer.resume``); ``trained``: the checkpoint's trained
    set, which stays trained; ``released``: features freed by this resume under
    the release policy; ``regenerate``: samples that must be trained again
    but whose features were already released, so a producer must emit them
    again (``Producer.regenerate``).
    """

    epoch: int
    checkpoint_step: int | None
    requeued: tuple[str, ...]
    released: tuple[str, ...]
    regenerate: tuple[str, ...]
    trained: Set[str]
    data_epoch: int = 0
    world_size: int = 1
    rank: int | None = None
    #: The checkpoint resumed from (load its ``path``), None from scratch.
    checkpoint: Checkpoint | None = None

    def for_rank(self, rank: int) -> ReconcilePlan:
        """This plan with ``requeued`` narrowed to ``rank``'s share."""
        return dataclasses.replace(
            self, requeued=tuple(self.requeued[rank :: self.world_size]), rank=rank
        )


class _TrainedAt(Set[str]):
    """A plan's ``trained``: its checkpoint's trained set, computed when first read.

    Held eagerly, each resume's plan would keep a set of every sample trained so far
    (30 bytes each); the lineage it is computed from never changes once the plan's
    epoch has started, so reading it later gives the same set.
    """

    __slots__ = ("_compute", "_value")

    def __init__(self, compute: Callable[[], Iterable[str]]) -> None:
        self._compute: Callable[[], Iterable[str]] | None = compute
        self._value: frozenset[str] | None = None

    def _get(self) -> frozenset[str]:
        if self._value is None:
            assert self._compute is not None
            self._value, self._compute = frozenset(self._compute()), None
        return self._value

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._get()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} samples)"


#: The step stored for an ack whose step is not an int (a damaged row, already a
#: violation): it never counts as trained at any checkpoint.
_BAD_STEP = 2**63 - 1


class _Acks:
    """One epoch's acks as columns, (sample id, step, data epoch) per ack.

    A run's longest list: arrays keep an ack at 20 bytes instead of a tuple's 100.
    """

    __slots__ = ("data_epochs", "sids", "steps")

    def __init__(self) -> None:
        self.sids: list[str] = []
        self.steps = array("q")
        self.data_epochs = array("l")

    def append(self, sid: str, step: object, data_epoch: int) -> None:
        self.sids.append(sid)
        good = isinstance(step, int) and not isinstance(step, bool) and 0 <= step < _BAD_STEP
        self.steps.append(step if good else _BAD_STEP)  # type: ignore[arg-type]
        self.data_epochs.append(data_epoch)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        return zip(self.sids, self.steps, self.data_epochs, strict=True)

    def __len__(self) -> int:
        return len(self.sids)


@dataclass
class _Epoch:
    """A node of the lineage tree: one consumer epoch."""

    number: int
    parent: int | None
    cut_step: int  # the step of the checkpoint it resumed from; -1 from scratch
    cut_seq: int  # that checkpoint's seq; 0 from scratch
    base_data_epoch: int
    policy: str
    world_size: int
    max_attempts: int
    order_seed: int | None = None
    acks: _Acks = field(default_factory=_Acks)
    data_epochs: list[tuple[int, int, int]] = field(default_factory=list)  # seq, number, seed
    last_checkpoint_step: int = -1
    ack_steps: dict[str, int] = field(default_factory=dict)  # consumer id -> its newest ack step


def seeded_order(sample_ids: Iterable[str], seed: int) -> list[str]:
    """The order of a data epoch: ids sorted by a keyed hash (stable across machines)."""
    key = str(seed).encode()
    return sorted(
        sample_ids, key=lambda s: hashlib.blake2b(s.encode(), key=key[:64], digest_size=8).digest()
    )


class _Refs(Mapping[str, SampleRef]):
    """Committed refs by id (commit order), decoded from their JSON on access."""

    def __init__(self, state: RunState) -> None:
        self._state = state

    def __getitem__(self, sample_id: str) -> SampleRef:
        return self._state.ref(sample_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state._commits)

    def __len__(self) -> int:
        return len(self._state._commits)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._state._commits


class RunState:
    """The state of one run after folding its log up to ``head_seq``.

    Attributes (all derived): ``committed`` (id -> SampleRef, commit order),
    ``pending`` (ids waiting to be leased, queue order), ``leased`` (id ->
    consumer id), ``trained`` (id -> step, in the current lineage and data
    epoch), ``released`` (ids whose features were freed), ``dead`` (id ->
    reason), ``lost`` (id -> reason: features found missing or corrupt on a load, waiting
    for regeneration; never counted as a failed attempt), ``regenerate`` (ids to train
    again whose features are gone: released, or lost),
    ``checkpoints``, ``removed_checkpoints`` (seq -> reason), ``epoch``,
    ``data_epoch``, ``head_seq``.

    ``ref_source``: the ledger the log came from. With it, the state keeps the ref
    JSON of live samples only (not yet trained) and reads the others' from the
    ledger when asked, which is most of a long run's memory; without it, every
    ref stays in memory.
    """

    def __init__(self, run_id: str, *, ref_source: Ledger | None = None) -> None:
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
        self.checkpoints: list[Checkpoint] = []
        #: seq of a checkpoint whose files were removed -> why (retention, rewind).
        self.removed_checkpoints: dict[int, str] = {}
        self.producers: set[str] = set()
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
        self._epochs: dict[int, _Epoch] = {}
        self._world_size = 1  # of the current epoch; read on every commit
        self._resumes: list[int] = []
        self._order_args: tuple[int, int | None, int] = (0, None, 0)  # the data epoch's order

    # -- derived views -----------------------------------------------------
    @property
    def committed(self) -> Mapping[str, SampleRef]:
        return _Refs(self)

    @property
    def pending(self) -> list[str]:
        ids = [sid for queue in self._pending.values() for sid in queue]
        return sorted(ids, key=self._queue_pos.__getitem__)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def release_policy(self) -> str:
        node = self._epochs.get(self.epoch)
        return node.policy if node else "on_checkpoint"

    @property
    def last_checkpoint_step(self) -> int:
        """Newest checkpoint step of the current lineage (-1 when none)."""
        node = self._epochs.get(self.epoch)
        if node is None:
            return -1
        return max(node.last_checkpoint_step, node.cut_step)

    def last_ack_step(self, consumer_id: str) -> int:
        """Newest step ``consumer_id`` acked in the current epoch (0 when none)."""
        node = self._epochs.get(self.epoch)
        return node.ack_steps.get(consumer_id, 0) if node else 0

    @property
    def order_seed(self) -> int | None:
        """The seed of the lease order (``Consumer(order_seed=...)``); None: commit order."""
        node = self._epochs.get(self.epoch)
        return node.order_seed if node else None

    @property
    def producers_done(self) -> bool:
        """True when at least one producer closed and every producer that claimed or
        committed closed (a close counts from the id's current holder only)."""
        return bool(self.closed) and self.producers <= self.closed

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
        return {sid: ref_from_ledger(raw[sid]) for sid in raw}  # type: ignore[arg-type]

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

    def checkpoint_for(self, which: object) -> Checkpoint | None:
        """Resolve ``"latest"`` or a step to a checkpoint, preferring the current lineage.

        Checkpoints whose files were removed (``removed_checkpoints``) are never chosen.
        """
        lineage = [c for c in self.lineage_checkpoints() if c.seq not in self.removed_checkpoints]
        if which == "latest":
            return lineage[-1] if lineage else None
        matches = [c for c in lineage if c.step == which] or [
            c for c in self.checkpoints if c.step == which and c.seq not in self.removed_checkpoints
        ]
        return matches[-1] if matches else None

    def lineage_checkpoints(self) -> list[Checkpoint]:
        """The checkpoints of the current lineage (removed ones included), oldest first."""
        chain = self._chain(self.epoch, None, None)
        cuts = {node.number: cut_seq for node, _, cut_seq in chain}
        return [
            c
            for c in self.checkpoints
            if c.epoch in cuts and (cuts[c.epoch] is None or c.seq <= cuts[c.epoch])
        ]

    def snapshot(self) -> dict[str, Any]:
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
            "checkpoints": list(self.checkpoints),
            "removed_checkpoints": dict(self.removed_checkpoints),
            "closed": sorted(self.closed),
            "plans": dict(self.plans),
        }

    # -- the fold ------------------------------------------------------------
    def apply_rows(self, rows: Iterable[Any]) -> RunState:
        """Fold raw rows: (seq, kind, sample_id, revision, epoch, step, actor, payload, ts)."""
        # One loop with local names rather than a call per row: this is the
        # replay hot path (about a million rows a second on one core).
        handlers, fenced = _HANDLERS, Kind.FENCED
        for seq, kind, sample_id, revision, epoch, step, actor, payload, _ts in rows:
            if seq <= self.head_seq:
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

    def _fencing_violation(self, seq: int, kind: str, epoch: int, actor: str) -> None:
        if self.epoch == 0:
            self.violations.append(f"seq {seq}: {kind} before any resume (by {actor!r})")
        else:
            self.violations.append(
                f"seq {seq}: {kind} by {actor!r} with stale epoch {epoch} (run at {self.epoch})"
            )

    def _enqueue(self, sample_id: str, owner: int, *, requeued: bool) -> None:
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

    def _on_commit(
        self,
        seq: int,
        sid: str,
        revision: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str,
    ) -> None:
        if not isinstance(payload, str) or f'"sample_id":"{sid}"' not in payload:
            # Refs are stored as compact, key-sorted JSON: the row's own id must be in it.
            self.violations.append(f"seq {seq}: the commit of {sid!r} carries no ref of {sid!r}")
            return
        if self._stale_producer(seq, f"commit of {sid!r}", actor, epoch):
            pass  # committed all the same: the sample is the run's, and must be trained
        elif actor in self.closed and not revision:  # a regeneration is waited for
            self.violations.append(
                f"seq {seq}: commit of {sid!r} by producer {actor!r} after its close, with no "
                "claim between: a consumer may have taken the run as finished without it"
            )
        self.producers.add(actor)
        self.closed.discard(actor)
        revision = revision or 0
        if sid in self._commits and revision <= self._revisions.get(sid, 0):
            self.violations.append(f"seq {seq}: duplicate commit of {sid!r} revision {revision}")
            return
        first = sid not in self._commits
        if first:
            self._commits[sid] = sid
            if revision:
                self._revisions[sid] = revision
        else:
            sid = self._commits[sid]
            self._revisions[sid] = revision
        self._json[sid] = payload
        if first:
            self._first_seqs.append(seq)
            self._enqueue(sid, self._round_robin_owner(), requeued=False)
            return
        # A regeneration: the features are back. A lost sample goes back to the rank that
        # found it lost (it regenerates it, and may be the only rank still leasing).
        self.released.discard(sid)
        self.lost.pop(sid, None)
        owner = self._lost_rank.pop(sid, None)
        if sid in self.regenerate:
            del self.regenerate[sid]
            if owner is None or owner >= self.world_size:
                owner = self._round_robin_owner()
            self._enqueue(sid, owner, requeued=True)

    def _on_close(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if self._stale_producer(seq, "close", actor, epoch):
            return  # only the id's holder can end it
        self.closed.add(actor)
        data = load_payload(payload) if isinstance(payload, str) else {}
        if isinstance(data, dict) and data.get("streamed") is False:
            self.unstreamed.add(actor)
        else:
            self.unstreamed.discard(actor)
        if self.order_seed is not None and self.producers_done:
            self._resort()

    def _stale_producer(self, seq: int, what: str, actor: str, epoch: int) -> bool:
        """Whether a producer's write comes from an epoch that does not hold its id (a
        violation: the ledger refuses those)."""
        held = self.producer_epochs.get(actor, 0)
        if epoch == held:
            return False
        self.violations.append(
            f"seq {seq}: {what} by producer {actor!r} with producer epoch {epoch}, but "
            f"epoch {held} holds the id (a fenced producer wrote)"
        )
        return True

    def _on_claim(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        held = self.producer_epochs.get(actor, 0)
        if not isinstance(epoch, int) or epoch <= held:
            self.violations.append(
                f"seq {seq}: claim of producer {actor!r} with epoch {epoch!r}, not above "
                f"the epoch {held} holding it"
            )
            return
        self.producer_epochs[actor] = epoch
        self.producers.add(actor)
        self.closed.discard(actor)
        store = load_payload(payload).get("store") if isinstance(payload, str) else None
        if isinstance(store, str):
            self.store_uris[store] = None

    def _resort(self) -> None:
        """Seeded order: every pending id back at its place in the data epoch's order."""
        pending, requeued = set(self._queue_pos), self._requeued
        self._pending = {r: {} for r in range(self.world_size)}
        self._queue_pos, self._requeued = {}, set()
        for index, sid in enumerate(self._data_epoch_order(*self._order_args)):
            if sid in pending:
                self._enqueue(sid, index % self.world_size, requeued=sid in requeued)

    def _on_resume(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str,
    ) -> None:
        p = load_payload(payload)
        if epoch <= self.epoch:
            self.violations.append(f"seq {seq}: resume to epoch {epoch} after epoch {self.epoch}")
            return
        ckpt = next((c for c in self.checkpoints if c.seq == p.get("checkpoint_seq")), None)
        if p.get("checkpoint_seq") is not None and ckpt is None:
            self.violations.append(
                f"seq {seq}: resume from unknown checkpoint seq {p.get('checkpoint_seq')}"
            )
        elif ckpt is not None and ckpt.seq in self.removed_checkpoints:
            self.violations.append(
                f"seq {seq}: resume from checkpoint seq {ckpt.seq} (step {ckpt.step}), whose "
                f"files were removed ({self.removed_checkpoints[ckpt.seq]})"
            )
            return
        untrained: set[str] | None = None
        if ckpt is None:
            trained, data_epoch, seed, start_seq = {}, 0, None, 0
        else:
            chain = self._chain(ckpt.epoch, ckpt.step, ckpt.seq)
            data_epoch, seed, start_seq = self._data_epoch_at(chain)
            rewound = self._rewound(ckpt, data_epoch)
            if rewound is None:
                trained = self._trained_in(chain, data_epoch)
            else:
                trained, untrained = rewound
        node = _Epoch(
            number=epoch,
            parent=ckpt.epoch if ckpt else None,
            cut_step=ckpt.step if ckpt else -1,
            cut_seq=ckpt.seq if ckpt else 0,
            base_data_epoch=data_epoch,
            policy=p.get("release_policy", "on_checkpoint"),
            world_size=p.get("world_size", 1),
            max_attempts=p.get("max_attempts", 3),
            order_seed=p.get("order_seed"),
        )
        self._epochs[epoch] = node
        self._world_size = node.world_size
        self._resumes.append(epoch)
        self.epoch = epoch
        if data_epoch != self.data_epoch:
            self.attempts = {}
        self.data_epoch = data_epoch
        self.trained = trained
        self.leased = {}
        self._lessee_rank = {}
        self._order_args = (data_epoch, seed, start_seq)
        order = self._data_epoch_order(data_epoch, seed, start_seq)
        requeued = self._refill(order, requeued=True, untrained=untrained)
        released = [s for s in self._unreleased_after(trained)] if node.policy != "never" else []
        self.plans[epoch] = ReconcilePlan(
            epoch=epoch,
            checkpoint_step=ckpt.step if ckpt else None,
            requeued=tuple(requeued),
            released=tuple(released),
            regenerate=tuple(self.regenerate),
            trained=self._trained_at(ckpt),
            data_epoch=data_epoch,
            world_size=node.world_size,
            checkpoint=ckpt,
        )

    def _trained_at(self, ckpt: Checkpoint | None) -> Set[str]:
        """The trained set of ``ckpt`` (empty from scratch), computed when first read."""
        if ckpt is None:
            return frozenset()
        return _TrainedAt(lambda: self._trained_at_checkpoint(ckpt))

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
            if sid in self.dead or sid in self.trained:
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

    def _chain(
        self, epoch: int, cut_step: int | None, cut_seq: int | None
    ) -> list[tuple[_Epoch, int | None, int | None]]:
        """Epoch nodes from ``epoch`` up to the root, each with its cut (None: no cut)."""
        chain = []
        number: int | None = epoch
        while number is not None and number in self._epochs:
            node = self._epochs[number]
            chain.append((node, cut_step, cut_seq))
            cut_step, cut_seq, number = node.cut_step, node.cut_seq, node.parent
        return chain

    @staticmethod
    def _data_epoch_at(
        chain: list[tuple[_Epoch, int | None, int | None]],
    ) -> tuple[int, int | None, int]:
        """(data epoch, its seed, its start seq) at the cut that ``chain`` starts from."""
        for node, _cut_step, cut_seq in chain:
            starts = [d for d in node.data_epochs if cut_seq is None or d[0] < cut_seq]
            if starts:
                start_seq, data_epoch, seed = starts[-1]
                return data_epoch, seed, start_seq
        return 0, None, 0

    def _rewound(self, ckpt: Checkpoint, data_epoch: int) -> tuple[dict[str, int], set[str]] | None:
        """The trained set at ``ckpt``, made from the current one in place, with a superset
        of the ids it leaves untrained; None (nothing changed) where the lineage's acks
        must be folded instead.

        A restart from the newest checkpoint, of this epoch or the one it resumed from,
        with the data epoch unchanged since: the trained set is the current one less what
        this epoch acked after that checkpoint. Without a violation in the log, those
        acks named each sample once, and never one the lineage had trained.
        """
        node = self._epochs.get(self.epoch)
        if node is None or self.violations or data_epoch != self.data_epoch:
            return None
        if ckpt.epoch == self.epoch:
            floor = ckpt.step
        elif ckpt.seq == node.cut_seq:
            floor = -1  # every ack of this epoch came after it
        else:
            return None
        acks, trained = node.acks, self.trained
        after = itertools.compress(itertools.count(), map(floor.__lt__, acks.steps))
        undone = [acks.sids[i] for i in after if acks.data_epochs[i] == data_epoch]
        untrained = set(undone)
        if len(untrained) < len(undone) or not all(map(trained.__contains__, untrained)):
            return None  # not the trained set this epoch built: fold the lineage
        for sid in undone:  # in place: a copy would cost a dict entry per trained sample
            del trained[sid]
        untrained.update(*self._pending.values(), self.leased, self.lost, self.regenerate)
        untrained.update(self.dead)
        return trained, untrained

    def _trained_in(
        self, chain: list[tuple[_Epoch, int | None, int | None]], data_epoch: int
    ) -> dict[str, int]:
        """The trained set at the cut ``chain`` starts from: its acks of ``data_epoch``."""
        trained: dict[str, int] = {}
        for node, cut_step, _cut_seq in reversed(chain):
            for sid, ack_step, ack_data_epoch in node.acks:
                if (cut_step is None or ack_step <= cut_step) and ack_data_epoch == data_epoch:
                    trained[sid] = ack_step
        return trained

    def _trained_at_checkpoint(self, ckpt: Checkpoint) -> dict[str, int]:
        chain = self._chain(ckpt.epoch, ckpt.step, ckpt.seq)
        return self._trained_in(chain, self._data_epoch_at(chain)[0])

    def _on_lease(
        self,
        seq: int,
        sid: str,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        _p: str | None,
    ) -> None:
        owner = self._dequeue(sid)
        if owner is None:
            self.violations.append(
                f"seq {seq}: lease of {sid!r} by {actor!r}, which was not pending"
            )
            return
        self.leased[sid] = actor
        self._lessee_rank[sid] = owner

    def _on_ack(
        self, seq: int, sid: str, _r: int | None, _e: int, step: int, actor: str, _p: str | None
    ) -> None:
        if not self._end_lease(seq, "ack", sid, actor):
            return
        node = self._epochs[self.epoch]
        floor, newest = max(node.last_checkpoint_step, node.cut_step), node.ack_steps.get(actor, 0)
        if not isinstance(step, int) or step < 1 or step <= floor or step < newest:
            self.violations.append(
                f"seq {seq}: ack of {sid!r} at step {step!r} by {actor!r}: steps start at 1, "
                f"come after the lineage's checkpoint (step {floor}) and never go back "
                f"(this consumer acked step {newest})"
            )
        if sid in self.trained:
            self.violations.append(
                f"seq {seq}: {sid!r} trained twice in data epoch {self.data_epoch} of the lineage"
            )
        sid = self._commits.get(sid, sid)
        if isinstance(step, int):
            step = self._steps.setdefault(step, step)
        self.trained[sid] = step
        if node.policy != "never":
            self._unreleased_acks[sid] = step
        if self._ref_source is not None:
            self._forget_json(sid)
        node.acks.append(sid, step, self.data_epoch)
        if isinstance(step, int) and step > newest:
            node.ack_steps[actor] = step

    def _forget_json(self, sid: str) -> None:
        """Drop a trained sample's ref JSON; it is read from the ledger if ever needed again."""
        if self._json.pop(sid, None) is not None:
            self._json_dropped += 1
            # A dict never shrinks by deleting: rebuild it once most of it is gone.
            if self._json_dropped > 4096 and self._json_dropped > 3 * len(self._json):
                self._json, self._json_dropped = dict(self._json), 0

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

    def _on_nack(
        self,
        seq: int,
        sid: str,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        queue_rank = self._lessee_rank.get(sid)
        if not self._end_lease(seq, "nack", sid, actor):
            return
        p = load_payload(payload)
        attempts = self.attempts.get(sid, 0) + 1
        self.attempts[sid] = attempts
        node = self._epochs[self.epoch]
        if not p.get("retryable", True) or attempts >= node.max_attempts:
            why = p.get("reason") or "nacked"
            self.dead[sid] = f"{why} (attempt {attempts}, retryable={p.get('retryable', True)})"
        else:
            self._enqueue(sid, self._retry_rank(p.get("rank"), queue_rank), requeued=True)

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

    def _on_lost(
        self,
        seq: int,
        sid: str,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        rank = self._lessee_rank.get(sid)
        if not self._end_lease(seq, "lost", sid, actor):
            return
        p = load_payload(payload)
        if sid not in self._commits or p.get("revision", 0) != self._revisions.get(sid, 0):
            # An older revision's features went missing; the newest ones are stored: back to
            # the rank that found it (alive; a round-robin owner may have drained).
            self._enqueue(sid, self._retry_rank(None, rank), requeued=True)
            return
        self.lost[sid] = str(p.get("reason") or "lost")
        if rank is not None:
            self._lost_rank[sid] = rank
        self.regenerate[sid] = None

    def _on_checkpoint(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        step: int,
        _a: str,
        payload: str | None,
    ) -> None:
        node = self._epochs.get(epoch)
        if node is None:
            self.violations.append(f"seq {seq}: checkpoint before any resume")
            return
        floor = max(node.last_checkpoint_step, node.cut_step)
        if not isinstance(step, int) or step < 0 or step <= floor:
            self.violations.append(
                f"seq {seq}: checkpoint at step {step!r} after the lineage's checkpoint at "
                f"step {floor}: checkpoint steps must increase"
            )
            return
        node.last_checkpoint_step = step
        p = load_payload(payload)
        self.checkpoints.append(
            Checkpoint(seq, epoch, step, p.get("path", ""), self.data_epoch, p.get("digest"))
        )

    def _on_checkpoint_removed(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        _e: int,
        _s: int | None,
        _a: str,
        payload: str | None,
    ) -> None:
        p = load_payload(payload)
        target = p.get("checkpoint_seq")
        if not any(c.seq == target for c in self.checkpoints):
            self.violations.append(f"seq {seq}: removal of unknown checkpoint seq {target}")
            return
        self.removed_checkpoints[target] = str(p.get("reason") or "removed")

    def _on_release(
        self,
        seq: int,
        sid: str,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        revision = load_payload(payload).get("revision", 0)
        if sid not in self._commits or revision != self._revisions.get(sid, 0):
            return  # an older revision's features: the current ones stay
        reason = self._release_forbidden(sid)
        if reason:
            self.violations.append(f"seq {seq}: release of {sid!r} by {actor!r}: {reason}")
        self.released.add(self._commits[sid])
        self._unreleased_acks.pop(sid, None)

    def _release_forbidden(self, sid: str) -> str | None:
        policy = self.release_policy
        if policy == "never":
            return "the release policy is 'never'"
        if sid in self.dead:
            return None  # a dead sample's features may always go
        if sid not in self.trained:
            return "the sample is not trained in this lineage"
        if policy == "on_checkpoint" and self.trained[sid] > self.last_checkpoint_step:
            return "the sample is not yet trained into a durable checkpoint"
        return None

    def _on_data_epoch(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        _a: str,
        payload: str | None,
    ) -> None:
        p = load_payload(payload)
        number = p.get("data_epoch", self.data_epoch + 1)
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**63:
            raise ValueError(f"data_epoch {number!r:.40} is no int from 0 to 2**63-1")
        seed = p.get("seed", number)
        self._epochs[epoch].data_epochs.append((seq, number, seed))
        self.data_epoch = number
        self.trained = {}
        self.attempts = {}
        self._order_args = (number, seed, seq)
        order = self._data_epoch_order(number, seed, seq)
        if self.leased:  # start_data_epoch refuses this: a damaged or hand-made log
            self.violations.append(
                f"seq {seq}: data epoch {number} starts while {len(self.leased)} samples are "
                f"leased (e.g. {next(iter(self.leased))!r}); they stay leased"
            )
            order = [sid for sid in order if sid not in self.leased]
        self._refill(order, requeued=True)

    def releasable_at(self, step: int) -> list[str]:
        """Ids trained at or before ``step`` in this lineage whose features are still stored."""
        return [sid for sid, s in self._unreleased_acks.items() if s <= step]

    # -- checks --------------------------------------------------------------
    def verify(self) -> list[str]:
        """Every broken invariant of the run, as sentences; [] when the log is clean.

        Checks: each committed, non-dead sample is in exactly one of pending,
        leased, trained or regenerate; no sample was trained twice in a data
        epoch of the lineage; acks and nacks came from the consumer holding
        the lease; no write came from a fenced-off epoch; releases respected
        the release policy; with the ledger it came from, no event has a seq
        the fold cannot read (below 1).
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


_HANDLERS = {
    Kind.COMMIT: RunState._on_commit,
    Kind.CLOSE: RunState._on_close,
    Kind.RESUME: RunState._on_resume,
    Kind.LEASE: RunState._on_lease,
    Kind.ACK: RunState._on_ack,
    Kind.NACK: RunState._on_nack,
    Kind.CHECKPOINT: RunState._on_checkpoint,
    Kind.RELEASE: RunState._on_release,
    Kind.DATA_EPOCH: RunState._on_data_epoch,
    Kind.CHECKPOINT_REMOVED: RunState._on_checkpoint_removed,
    Kind.LOST: RunState._on_lost,
    Kind.CLAIM: RunState._on_claim,
}
