"""What each restart of a run cost: the checkpoint it went back to, the work kept, requeued,
regenerated and redone, and how long the ranks stood still.

A restart is a resume that fences off an earlier consumer epoch (the run's first resume
starts it and is none). For a resume of epoch E from checkpoint C (None: from scratch),
whose predecessor epoch P ended when E began:

* ``kept``: the samples C's lineage had trained up to C (the plan's trained set); they
  are not trained again;
* the *abandoned work*: the acks of P's lineage that C's lineage does not hold (those
  after C, in the branch E leaves behind), and the samples P still held leased;
* ``redone``: the sample-steps of that work, its acks: training lost, done again;
* ``requeued``: the samples of that work the resume made pending again;
* ``regenerated``: the samples of that work the resume sent to be regenerated (their
  features had been released, so a producer commits them again);
* ``seconds``: from the last event of P (its ranks' last write, or its resume when they
  wrote nothing) to the first lease of E; None while E has leased nothing.

A :class:`RestartTracker` reads what only the log's order shows (the leases held at each
resume, the last event of each epoch, the first lease after it) from the rows it is
given, in seq order, from the run's first; the rest comes from the fold's lineage, which
keeps every epoch's acks. ``replay`` reports it (``resumes``), and
:class:`~dataflow.live._metrics.RunMetrics` exports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataflow.model._events import Kind, row_samples

if TYPE_CHECKING:
    from dataflow.model._fold import RunState
    from dataflow.model._lineage import Checkpoint, LineageBranch
    from dataflow.recorder._ledger import Ledger

_ENDS_LEASE = frozenset({Kind.ACK, Kind.NACK, Kind.LOST})


@dataclass(frozen=True)
class ResumeCost:
    """One restart and what it cost (see the module's docstring for each count)."""

    epoch: int
    seq: int
    ts: float
    previous_epoch: int
    checkpoint_seq: int | None
    checkpoint_step: int | None
    kept: int
    requeued: int
    regenerated: int
    redone: int
    #: The last event of the previous epoch, and the first lease of this one (None: none yet).
    last_event_seq: int
    last_event_ts: float
    first_lease_seq: int | None
    first_lease_ts: float | None

    @property
    def seconds(self) -> float | None:
        """From the previous epoch's last event to this epoch's first lease."""
        return None if self.first_lease_ts is None else self.first_lease_ts - self.last_event_ts

    def as_dict(self) -> dict[str, Any]:
        """As ``replay --json`` lists it under ``resumes``."""
        seconds = self.seconds
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "ts": self.ts,
            "previous_epoch": self.previous_epoch,
            "checkpoint": None
            if self.checkpoint_seq is None
            else {"seq": self.checkpoint_seq, "step": self.checkpoint_step},
            "kept": self.kept,
            "requeued": self.requeued,
            "regenerated": self.regenerated,
            "redone_sample_steps": self.redone,
            "last_event_seq": self.last_event_seq,
            "last_event_ts": self.last_event_ts,
            "first_lease_seq": self.first_lease_seq,
            "first_lease_ts": self.first_lease_ts,
            "seconds": None if seconds is None else round(seconds, 6),
        }


@dataclass(frozen=True)
class _Restart:
    """What the log's order says of a restart: read when its resume row goes by."""

    epoch: int
    seq: int
    ts: float
    previous_epoch: int
    last_event: tuple[int, float]
    leased: frozenset[str]


@dataclass(frozen=True)
class _Work:
    """The lineage's part of a restart's cost (fixed once the restart happened)."""

    kept: int
    requeued: int
    regenerated: int
    redone: int


class RestartTracker:
    """Follows a run's rows (from its first, in seq order) and tells each restart's cost.

    Memory: a few numbers per epoch, and the leases the current epoch holds.
    """

    def __init__(self) -> None:
        self.head_seq = 0
        self._epoch: int | None = None
        self._last: tuple[int, float] = (0, 0.0)  # the current epoch's last event
        self._leased: set[str] = set()  # the current epoch's leases
        self._restarts: list[_Restart] = []
        self._first_lease: dict[int, tuple[int, float]] = {}  # epoch -> its first lease
        self._work: dict[int, _Work] = {}

    def observe(self, rows: Iterable[Any]) -> None:
        """Follow ``rows`` (seq, kind, sample_id, revision, epoch, step, actor, payload, ts)."""
        fenced = Kind.FENCED
        for seq, kind, sid, _rev, epoch, _step, _actor, payload, ts in rows:
            if seq <= self.head_seq:
                continue
            self.head_seq = seq
            if kind == Kind.RESUME:
                self._resume(seq, epoch, ts)
            elif kind in fenced and epoch == self._epoch:
                self._last = (seq, ts)
                if kind == Kind.LEASE:
                    self._leased.update(row_samples(kind, sid, payload))
                    if epoch not in self._first_lease:
                        self._first_lease[epoch] = (seq, ts)
                elif kind in _ENDS_LEASE:
                    self._leased.difference_update(row_samples(kind, sid, payload))

    def update(self, ledger: Ledger, run_id: str, *, upto_seq: int | None = None) -> None:
        """Follow the rows of ``run_id`` after the last one followed (up to ``upto_seq``)."""
        self.observe(ledger.rows(run_id, after_seq=self.head_seq, upto_seq=upto_seq))

    def _resume(self, seq: int, epoch: object, ts: float) -> None:
        if not isinstance(epoch, int) or (self._epoch is not None and epoch <= self._epoch):
            return  # the fold refuses it (a violation): no epoch starts
        if self._epoch is not None:
            restart = _Restart(epoch, seq, ts, self._epoch, self._last, frozenset(self._leased))
            self._restarts.append(restart)
        self._epoch, self._last, self._leased = epoch, (seq, ts), set()

    def costs(self, state: RunState) -> list[ResumeCost]:
        """Each restart followed so far, oldest first, with its cost; ``state`` is the
        run's fold at least up to the last row followed."""
        out = []
        for r in self._restarts:
            plan = state.plans.get(r.epoch)
            if plan is None:
                continue
            work = self._work.get(r.epoch)
            if work is None:
                work = self._work[r.epoch] = _lost_work(state, r, plan.checkpoint)
            ckpt = plan.checkpoint
            lease = self._first_lease.get(r.epoch)
            out.append(
                ResumeCost(
                    epoch=r.epoch,
                    seq=r.seq,
                    ts=r.ts,
                    previous_epoch=r.previous_epoch,
                    checkpoint_seq=None if ckpt is None else ckpt.seq,
                    checkpoint_step=None if ckpt is None else ckpt.step,
                    kept=work.kept,
                    requeued=work.requeued,
                    regenerated=work.regenerated,
                    redone=work.redone,
                    last_event_seq=r.last_event[0],
                    last_event_ts=r.last_event[1],
                    first_lease_seq=None if lease is None else lease[0],
                    first_lease_ts=None if lease is None else lease[1],
                )
            )
        return out


def restart_costs(ledger: Ledger, state: RunState) -> list[ResumeCost]:
    """The cost of each restart of ``state``'s run, up to ``state.head_seq``."""
    tracker = RestartTracker()
    tracker.update(ledger, state.run_id, upto_seq=state.head_seq)
    return tracker.costs(state)


def _chain(state: RunState, epoch: int, cut: float) -> list[tuple[LineageBranch, float]]:
    """The lineage branches from ``epoch`` to the root, each with the last step it holds."""
    # The fold's lineage tree (``RunState._epochs``) holds every epoch's acks; it has no
    # public face, and copying the acks here would double a run's largest structure.
    branches = state._epochs
    chain = []
    number: int | None = epoch
    while number is not None and number in branches and len(chain) <= len(branches):
        node = branches[number]
        chain.append((node, cut))
        cut, number = node.cut_step, node.parent
    return chain


def _lost_work(state: RunState, restart: _Restart, ckpt: Checkpoint | None) -> _Work:
    """The acks of the previous lineage that ``ckpt``'s lineage does not hold, and what
    the resume did with their samples and with the leases the previous epoch held."""
    plan = state.plans[restart.epoch]
    kept = [] if ckpt is None else _chain(state, ckpt.epoch, ckpt.step)
    kept_cuts = {node.number: cut for node, cut in kept}
    redone = 0
    abandoned: set[str] = set(restart.leased)
    for node, upper in _chain(state, restart.previous_epoch, math.inf):
        lower = kept_cuts.get(node.number, -math.inf)
        if upper <= lower:
            continue
        for sid, step in zip(node.acks.sids, node.acks.steps, strict=True):
            if lower < step <= upper:
                redone += 1
                abandoned.add(sid)
    requeued = sum(1 for sid in plan.requeued if sid in abandoned)
    regenerated = sum(1 for sid in plan.regenerate if sid in abandoned)
    return _Work(len(plan.trained), requeued, regenerated, redone)


def restart_families(run_id: str, costs: list[ResumeCost] | None) -> Iterator[Any]:
    """The Prometheus families of a run's restarts (without values when ``costs`` is None):
    counters summed over the restarts, gauges of the newest one."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    read = costs is not None
    costs = costs or []
    waits = [c.seconds for c in costs if c.seconds is not None]
    counters = (
        (
            "resumes",
            "Restarts of the run: resumes that fenced off an earlier epoch",
            len(costs),
        ),
        (
            "resume_requeued_samples",
            "Samples restarts made pending again (leased or trained after the checkpoint "
            "in the abandoned branch)",
            sum(c.requeued for c in costs),
        ),
        (
            "resume_regenerated_samples",
            "Samples restarts sent to be regenerated (their features had been released)",
            sum(c.regenerated for c in costs),
        ),
        (
            "resume_redone_sample_steps",
            "Sample-steps restarts threw away (trained after the checkpoint in the "
            "abandoned branch): work done again",
            sum(c.redone for c in costs),
        ),
        (
            "resume_seconds",
            "Seconds from the last event before each restart to the first lease after it",
            sum(waits),
        ),
    )
    for name, doc, value in counters:
        family = CounterMetricFamily(f"dataflow_{name}", doc, labels=["run"])
        if read:
            family.add_metric([run_id], value)
        yield family
    last = costs[-1] if costs else None
    gauges = (
        (
            "last_resume_kept_samples",
            "Samples the newest restart kept trained (its checkpoint's trained set)",
            None if last is None else last.kept,
        ),
        (
            "last_resume_checkpoint_step",
            "The step of the checkpoint the newest restart went back to (-1: from scratch)",
            None if last is None else -1 if last.checkpoint_step is None else last.checkpoint_step,
        ),
        (
            "last_resume_seconds",
            "Seconds from the last event before the newest restart to the first lease after it",
            None if last is None else last.seconds,
        ),
    )
    for name, doc, gauge in gauges:
        family = GaugeMetricFamily(f"dataflow_{name}", doc, labels=["run"])
        if gauge is not None:
            family.add_metric([run_id], gauge)
        yield family
