"""The lineage of a run: its checkpoints, and the tree of consumer epochs they branch.

Each consumer epoch starts from a checkpoint (or from scratch), so epochs form a tree
of :class:`LineageBranch` nodes. The trained set of a checkpoint C is what its lineage
acked up to it: the inherited set of C's branch plus the acks of that branch with
step <= C.step. Resuming from C makes the trained set exactly that; acks after C in
abandoned branches are void.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass, field

RELEASE_POLICIES = ("on_checkpoint", "on_ack", "never")
#: One link of a lineage walk: a branch with its cut (None: no cut).
Link = tuple["LineageBranch", int | None, int | None]


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

    def recompute_with(self, compute: Callable[[], Iterable[str]]) -> None:
        """Compute the set with ``compute`` instead, if it was not read yet (the fold it
        was to be computed from forgets the acks it needs: see ``RunState.forget_finished``)."""
        if self._value is None:
            self._compute = compute

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

    def drop(self, sample_ids: Set[str]) -> None:
        """Forget the acks of ``sample_ids`` (samples a forgetting fold no longer keeps)."""
        keep = [sid not in sample_ids for sid in self.sids]
        if all(keep):
            return
        self.sids = list(itertools.compress(self.sids, keep))
        self.steps = array("q", itertools.compress(self.steps, keep))
        self.data_epochs = array("l", itertools.compress(self.data_epochs, keep))


class WholeFoldNeeded(Exception):
    """Raised by a fold that forgets finished samples (``RunState.forget_finished``) at a
    row it cannot fold exactly without them: a resume, a new data epoch, an exclusion, or
    a commit or release of an id it may have forgotten. The fold is left unusable (a batch
    row may be half applied); its reader folds the run anew, whole (``RunView``)."""


class IdHashes:
    """A set of 64-bit hashes of sample ids, 8 bytes a slot (open addressing, linear
    probing, at most 2/3 full): what a forgetting fold keeps of each finished sample.

    A hit is exact for a committed id (every committed id the fold no longer keeps is in
    it); for another id it is a 64-bit hash collision, which the fold never trusts for a
    write (it folds the run anew instead). ``hash()`` of a str is fixed within a process,
    and the table never leaves it.
    """

    __slots__ = ("_count", "_slots")

    def __init__(self) -> None:
        self._slots = array("Q", bytes(8 * 1024))
        self._count = 0

    @staticmethod
    def _key(sample_id: str) -> int:
        return (hash(sample_id) & 0xFFFF_FFFF_FFFF_FFFF) or 1  # 0 marks an empty slot

    def add(self, sample_id: str) -> None:
        if 3 * (self._count + 1) > 2 * len(self._slots):
            self._grow()
        if self._put(self._key(sample_id)):
            self._count += 1

    def __contains__(self, sample_id: object) -> bool:
        if not self._count or not isinstance(sample_id, str):
            return False
        key, slots = self._key(sample_id), self._slots
        mask = len(slots) - 1
        i = key & mask
        while (found := slots[i]) != 0:
            if found == key:
                return True
            i = (i + 1) & mask
        return False

    def __len__(self) -> int:
        return self._count

    def _put(self, key: int) -> bool:
        slots = self._slots
        mask = len(slots) - 1
        i = key & mask
        while (found := slots[i]) != 0:
            if found == key:
                return False
            i = (i + 1) & mask
        slots[i] = key
        return True

    def _grow(self) -> None:
        old, self._slots = self._slots, array("Q", bytes(16 * len(self._slots)))
        for key in old:
            if key:
                self._put(key)


@dataclass
class LineageBranch:
    """A branch of the lineage tree: one consumer epoch, cut from its parent's checkpoint
    (``cut_step``, ``cut_seq``) and holding the acks, data epochs and checkpoint step made
    in it."""

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


class LineageQueries:
    """The lineage reads of a :class:`~dataflow.model._fold.RunState` (a base of it): the
    current branch's settings, which checkpoints it can resume, and trained sets at a cut.
    It works on the attributes ``RunState.__init__`` declares (``_epochs``: number -> branch).
    """

    __slots__ = ()

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

    def _chain(self, epoch: int, cut_step: int | None, cut_seq: int | None) -> list[Link]:
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
        chain: list[Link],
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
        untrained.update(self.dead, self.excluded)
        return trained, untrained

    def _trained_in(self, chain: list[Link], data_epoch: int) -> dict[str, int]:
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

    def _trained_at(self, ckpt: Checkpoint | None) -> Set[str]:
        """The trained set of ``ckpt`` (empty from scratch), computed when first read."""
        if ckpt is None:
            return frozenset()
        return _TrainedAt(lambda: self._trained_at_checkpoint(ckpt))
