"""Compare the final lineages of two runs: what each committed, what it trained, in what order.

The final lineage of a run is what survived its resumes: the acks of its current epoch,
and of each epoch it descends from up to the checkpoint the next one resumed from (acks
after that checkpoint, in abandoned branches, are void). Each ack there is one training
of a sample, at an optimizer step, by a rank; the training order is those trainings
sorted by (step, rank, sample id), so two runs whose ranks trained the same samples into
the same steps have the same order whatever the timing of their acks.

The rank of a training is the rank of the consumer that acked it: the rank whose queue
that consumer's first lease of its epoch came from (ranks lease from their own queue, and
consumer ids change across restarts, so the id alone cannot say).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataflow.live._view import Row, RunView
from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError
from dataflow.model._events import Kind, row_samples, row_steps
from dataflow.recorder._ledger import Ledger
from dataflow.tools._time_travel import lineage

if TYPE_CHECKING:
    from dataflow.model._fold import RunState

#: One training of the final lineage: (step, rank, sample id); rank -1 when unknown.
Training = tuple[int, int, str]


@dataclass(frozen=True)
class FinalLineage:
    """What a run's final lineage holds: its committed ids and its trainings in order."""

    run_id: str
    committed: frozenset[str]
    #: (step, rank, sample id), sorted: the order of training.
    trainings: tuple[Training, ...]

    @property
    def trained(self) -> frozenset[str]:
        return frozenset(sid for _step, _rank, sid in self.trainings)


def final_lineage(ledger: Ledger, run_id: str) -> FinalLineage:
    """Fold ``run_id`` from its first event and return its final lineage's trainings.

    InvalidArgumentError when the ledger holds no event of ``run_id``.
    """
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(f"final_lineage needs a Ledger, got {type(ledger).__name__}")
    if ledger.head_seq(run_id) == 0:
        raise InvalidArgumentError(
            f"run {run_id!r} has no events in {ledger.safe_url}: nothing to compare "
            f"(known runs: {', '.join(map(repr, ledger.runs()[:20])) or 'none'})"
        )
    view = RunView(ledger, run_id, snapshots=False)
    acks: dict[int, list[tuple[int, str, str]]] = {}  # epoch -> (step, actor, sample id)
    ranks: dict[tuple[int, str], int] = {}  # (epoch, consumer id) -> its rank
    batch: list[Row] = []
    current = 0  # the consumer epoch: the fold refuses a write of any other (fencing)
    for row in view.tail():
        kind, epoch, actor = row[1], row[4], row[6]
        if kind == Kind.RESUME and isinstance(epoch, int) and epoch > current:
            current = epoch
        elif kind == Kind.ACK and epoch == current and isinstance(row[5], int):
            # A row of several steps gives each sample its own (row_steps).
            samples = row_samples(kind, row[2], row[7])
            steps = row_steps(kind, row[2], row[5], row[7])
            acks.setdefault(epoch, []).extend(
                (step, actor, sid) for sid, step in zip(samples, steps, strict=True)
            )
        batch.append(row)
        if kind == Kind.LEASE and (epoch, actor) not in ranks:
            view.apply(batch)
            batch = []
            leased = row_samples(kind, row[2], row[7])
            rank = _lease_rank(view.state, leased[0]) if leased else None
            if rank is not None:
                ranks[epoch, actor] = rank
    view.apply(batch)
    state = view.state
    trainings: list[Training] = []
    for epoch, cut in lineage(state):
        for step, actor, sid in acks.get(epoch, ()):
            if cut is None or step <= cut:
                trainings.append((step, ranks.get((epoch, actor), -1), sid))
    trainings.sort()
    return FinalLineage(run_id, frozenset(state.committed), tuple(trainings))


def _lease_rank(state: RunState, sample_id: str) -> int | None:
    """The rank whose queue the lease of ``sample_id`` just folded took it from."""
    # The fold knows it (it sends a retry back to that queue) and keeps it nowhere public.
    return state._lessee_rank.get(sample_id)


@dataclass(frozen=True)
class RunDiff:
    """How two runs' final lineages compare (``dataflow diff``)."""

    run_a: str
    run_b: str
    same_committed: bool
    same_trained: bool
    same_order: bool
    #: The first step at which the two runs trained different (rank, sample) pairs; None
    #: when the orders are the same.
    first_divergence_step: int | None
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    committed_only_in_a: tuple[str, ...]
    committed_only_in_b: tuple[str, ...]
    trained_a: int
    trained_b: int
    #: At the first divergence: what each run trained at that step, (rank, sample id).
    divergence_a: tuple[tuple[int, str], ...] = ()
    divergence_b: tuple[tuple[int, str], ...] = ()

    @property
    def identical(self) -> bool:
        """Same trained set, same order: what ``dataflow diff`` exits 0 for."""
        return self.same_trained and self.same_order

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (the keys of ``dataflow diff --json``)."""
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "same_committed": self.same_committed,
            "same_trained": self.same_trained,
            "same_order": self.same_order,
            "first_divergence_step": self.first_divergence_step,
            "only_in_a": len(self.only_in_a),
            "only_in_b": len(self.only_in_b),
            "trained_a": self.trained_a,
            "trained_b": self.trained_b,
            "committed_only_in_a": len(self.committed_only_in_a),
            "committed_only_in_b": len(self.committed_only_in_b),
            "only_in_a_samples": list(self.only_in_a),
            "only_in_b_samples": list(self.only_in_b),
            "divergence": None
            if self.first_divergence_step is None
            else {
                "step": self.first_divergence_step,
                "a": [list(t) for t in self.divergence_a],
                "b": [list(t) for t in self.divergence_b],
            },
        }


def compare_lineages(a: FinalLineage, b: FinalLineage) -> RunDiff:
    """Compare two final lineages (see :func:`diff_runs`)."""
    trained_a, trained_b = a.trained, b.trained
    step, at_a, at_b = _first_divergence(a.trainings, b.trainings)
    return RunDiff(
        run_a=a.run_id,
        run_b=b.run_id,
        same_committed=a.committed == b.committed,
        same_trained=trained_a == trained_b,
        same_order=step is None,
        first_divergence_step=step,
        only_in_a=tuple(sorted(trained_a - trained_b)),
        only_in_b=tuple(sorted(trained_b - trained_a)),
        committed_only_in_a=tuple(sorted(a.committed - b.committed)),
        committed_only_in_b=tuple(sorted(b.committed - a.committed)),
        trained_a=len(trained_a),
        trained_b=len(trained_b),
        divergence_a=at_a,
        divergence_b=at_b,
    )


def diff_runs(
    ledger: Ledger, run_a: str, run_b: str, *, other_ledger: Ledger | None = None
) -> RunDiff:
    """Compare the final lineages of ``run_a`` (in ``ledger``) and ``run_b`` (in
    ``other_ledger``, default ``ledger``): committed sets, trained sets, the order of
    training (step, rank, sample) and the first step where it differs."""
    a = final_lineage(ledger, run_a)
    b = final_lineage(ledger if other_ledger is None else other_ledger, run_b)
    return compare_lineages(a, b)


def _by_step(trainings: Iterable[Training]) -> dict[int, tuple[tuple[int, str], ...]]:
    return {
        step: tuple((rank, sid) for _s, rank, sid in group)
        for step, group in itertools.groupby(trainings, key=lambda t: t[0])
    }


def _first_divergence(
    a: tuple[Training, ...], b: tuple[Training, ...]
) -> tuple[int | None, tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]:
    """The first step at which ``a`` and ``b`` differ, with what each trained there."""
    if a == b:
        return None, (), ()
    steps_a, steps_b = _by_step(a), _by_step(b)
    for step in sorted(steps_a.keys() | steps_b.keys()):
        at_a, at_b = steps_a.get(step, ()), steps_b.get(step, ())
        if at_a != at_b:
            return step, at_a, at_b
    raise AssertionError("two different sorted orders differ at some step")
