"""What ``dataflow replay``, ``status`` and ``export`` show, derived from a run's log.

Functions over the ledger and the fold; the CLI only parses arguments and prints.
Nothing here writes to the ledger: :func:`plan_resume` folds its synthetic resume
event into a state of its own.

``progress``, where a function takes it, is called with the seq reached every few
thousand events (a progress bar's hook).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dataflow.live._replay import replay
from dataflow.model._errors import (
    ArgumentTypeError,
    DataflowError,
    InvalidArgumentError,
    UnknownCheckpointError,
)
from dataflow.model._events import Kind, dump_payload, load_payload
from dataflow.model._fold import Checkpoint, RunState

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

Progress = Callable[[int], None]

#: The state of one committed sample (exactly one each; ``released`` is a separate flag:
#: a trained sample's features may be freed or not).
SAMPLE_STATES = ("pending", "leased", "trained", "lost", "regenerate", "dead")
#: The actor of the resume event :func:`plan_resume` folds (it is never written).
PLAN_ACTOR = "dataflow-plan-resume"
_PROGRESS_EVERY = 4096


class NotInRunError(DataflowError, LookupError):
    """A sample the run never mentions (the CLI exits 1)."""


# -- one sample ---------------------------------------------------------------------


def sample_state(state: RunState, sample_id: str) -> str:
    """The one state of a committed sample: one of SAMPLE_STATES ("unaccounted" if none).

    "lost": its features were found missing or corrupt on a load; "regenerate": they were
    released but it must train again; both wait for ``Producer.regenerate``. Only a log
    that fails verification leaves a sample "unaccounted".
    """
    if sample_id in state.dead:
        return "dead"
    if sample_id in state.trained:
        return "trained"
    if sample_id in state.leased:
        return "leased"
    if sample_id in state.lost:
        return "lost"
    if sample_id in state.regenerate:
        return "regenerate"
    if state.is_pending(sample_id):
        return "pending"
    return "unaccounted"


def sample_row(state: RunState, sample_id: str) -> dict[str, Any]:
    """A committed sample as one flat row (what ``export`` writes per sample)."""
    return {
        "sample_id": sample_id,
        "state": sample_state(state, sample_id),
        "revision": state.revision(sample_id),
        "attempts": state.attempts.get(sample_id, 0),
        "trained_step": state.trained.get(sample_id),
        "leased_by": state.leased.get(sample_id),
        "released": sample_id in state.released,
        "reason": state.dead.get(sample_id) or state.lost.get(sample_id),
    }


def sample_rows(state: RunState) -> Iterator[dict[str, Any]]:
    """Every committed sample of ``state`` as :func:`sample_row`, in commit order."""
    for sample_id in state.committed:
        yield sample_row(state, sample_id)


def sample_history(
    ledger: Ledger,
    run_id: str,
    sample_id: str,
    *,
    upto_seq: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every event of ``sample_id`` (across producers, ranks and epochs) and its state.

    The resumes after its first commit are listed too, each with what it did to the
    sample (requeued, stays trained, to regenerate ...). NotInRunError when no event
    of the run names it.
    """
    own: list[tuple[Any, ...]] = []
    resumes: list[tuple[Any, ...]] = []
    for n, row in enumerate(ledger.rows(run_id, upto_seq=upto_seq), 1):
        if row[2] == sample_id:
            own.append(row)
        elif row[1] == Kind.RESUME:
            resumes.append(row)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(row[0])
    state = replay(ledger, run_id, upto_seq=upto_seq)
    if not own:
        examples = ", ".join(repr(s) for s, _ in zip(state.committed, range(3), strict=False))
        raise NotInRunError(
            f"no event of run {run_id!r} names sample {sample_id!r}"
            + (f" up to seq {upto_seq}" if upto_seq is not None else "")
            + f"; {len(state.committed)} samples are committed"
            + (f", e.g. {examples}" if examples else "")
            + " (check --sample)"
        )
    first = own[0][0]
    rows = sorted(own + [r for r in resumes if r[0] > first], key=lambda r: r[0])
    events = [_history_event(state, sample_id, row) for row in rows]
    current = sample_row(state, sample_id) if sample_id in state.committed else None
    return {"run_id": run_id, "sample_id": sample_id, "events": events, "current": current}


def _history_event(state: RunState, sample_id: str, row: tuple[Any, ...]) -> dict[str, Any]:
    seq, kind, _sid, revision, epoch, step, actor, payload, ts = row
    try:  # a damaged or hand-written row is shown, as --verify lists it
        p = load_payload(payload)
        why = None if isinstance(p, dict) else "not a JSON object"
    except ValueError as exc:
        p, why = {}, str(exc)[:200]
    if why is not None:
        detail = f"unreadable payload ({why}; see --verify)"
    elif kind == Kind.COMMIT:
        detail = f"revision {revision or 0} in {p.get('store')} (generation {p.get('generation')})"
    elif kind == Kind.NACK:
        detail = f"retryable={p.get('retryable', True)}: {p.get('reason') or 'nacked'}"
    elif kind == Kind.LOST:
        detail = f"revision {p.get('revision', 0)}: {p.get('reason') or 'lost'}"
    elif kind == Kind.RELEASE:
        detail = f"revision {p.get('revision', 0)}"
    elif kind == Kind.ACK:
        detail = f"trained into step {step}"
    elif kind == Kind.RESUME:
        detail = _resume_effect(state, sample_id, epoch)
    else:
        detail = ""
    return {
        "seq": seq,
        "time": iso_time(ts),
        "ts": ts,
        "kind": kind,
        "epoch": epoch,
        "step": step,
        "actor": actor,
        "revision": revision,
        "detail": detail,
    }


def _resume_effect(state: RunState, sample_id: str, epoch: int) -> str:
    plan = state.plans.get(epoch)
    if plan is None:
        return "refused by the fold (see --verify)"
    where = (
        f"from the checkpoint at step {plan.checkpoint_step}"
        if plan.checkpoint is not None
        else "from scratch"
    )
    if sample_id in plan.regenerate:
        return f"resume {where}: to regenerate (its features are gone)"
    if sample_id in plan.requeued:
        return f"resume {where}: requeued"
    if sample_id in plan.trained:
        freed = ", features released" if sample_id in plan.released else ""
        return f"resume {where}: stays trained{freed}"
    return f"resume {where}: left as it was (dead)"


# -- time travel --------------------------------------------------------------------


def parse_time(text: str) -> float:
    """Unix seconds from ``text``: a number, or an ISO 8601 time (naive: local time)."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = datetime.fromisoformat(text.strip()).timestamp()
        except ValueError:
            raise InvalidArgumentError(
                f"expected an ISO 8601 time (2025-05-01T12:00:00, 2025-05-01T12:00:00+00:00) "
                f"or unix seconds, got {text!r}"
            ) from None
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(f"expected a time after 1970 (unix seconds >= 0), got {text!r}")
    return value


def iso_time(ts: float) -> str:
    """``ts`` as local ISO 8601 with its offset (what ``--at`` reads back); ``repr(ts)``
    for what is no time (a damaged row)."""
    try:
        return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError, TypeError):
        return repr(ts)


#: Unix times a row may carry: years 1 to 9999, what datetime reads.
_TIMES = (-62_135_596_800.0, 253_402_300_800.0)


def _is_time(ts: object) -> bool:
    return (
        isinstance(ts, int | float)
        and not isinstance(ts, bool)
        and math.isfinite(ts)
        and _TIMES[0] < ts < _TIMES[1]
    )


def lineage(state: RunState) -> list[tuple[int, int | None]]:
    """The current lineage, oldest epoch first: (epoch, step its child resumed from).

    The current epoch's step is None (nothing cut it yet).
    """
    chain: list[tuple[int, int | None]] = []
    epoch: int | None = state.epoch
    cut: int | None = None
    while epoch is not None and epoch in state.plans and len(chain) <= len(state.plans):
        chain.append((epoch, cut))
        checkpoint = state.plans[epoch].checkpoint
        if checkpoint is None:
            break
        cut, epoch = checkpoint.step, checkpoint.epoch
    return chain[::-1]


def seq_at_step(ledger: Ledger, run_id: str, step: int, *, progress: Progress | None = None) -> int:
    """The seq of the state at optimizer step ``step`` of the current lineage.

    The lineage's checkpoint at ``step`` if it has one, else its last ack at a step
    <= ``step``. ValueError (with the lineage's range of steps) when the lineage has no
    such event or never reached ``step``.
    """
    state = replay(ledger, run_id)
    chain = dict(lineage(state))
    checkpoints = {c.step: c.seq for c in state.lineage_checkpoints()}
    best_ack, low, high = 0, math.inf, -1
    for n, (seq, kind, _s, _r, epoch, ack_step, _a, _p, _t) in enumerate(ledger.rows(run_id), 1):
        if kind == Kind.ACK and epoch in chain and isinstance(ack_step, int):
            cut = chain[epoch]
            if cut is None or ack_step <= cut:
                low, high = min(low, ack_step), max(high, ack_step)
                if ack_step <= step:
                    best_ack = max(best_ack, seq)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(seq)
    low, high = min([low, *checkpoints]), max([high, *checkpoints])
    if high < 0:
        raise InvalidArgumentError(
            f"the current lineage of run {run_id!r} has no acks or checkpoints yet: "
            "no step to go to (use --upto SEQ)"
        )
    if not low <= step <= high:
        raise InvalidArgumentError(
            f"the current lineage of run {run_id!r} goes from step {low} to step {high}; "
            f"step {step} is outside it"
        )
    if step in checkpoints:
        return checkpoints[step]
    return best_ack or max(seq for s, seq in checkpoints.items() if s <= step)


def seq_at_time(ledger: Ledger, run_id: str, ts: float, *, progress: Progress | None = None) -> int:
    """The seq of the run's last event with a timestamp <= ``ts``.

    ValueError when the run's first event is later than ``ts``.
    """
    best, first = 0, None
    for n, (seq, *_, event_ts) in enumerate(ledger.rows(run_id), 1):
        first = event_ts if first is None else min(first, event_ts)
        if event_ts <= ts:
            best = max(best, seq)
        if progress is not None and n % _PROGRESS_EVERY == 0:
            progress(seq)
    if not best:
        raise InvalidArgumentError(
            f"run {run_id!r} starts at {iso_time(first or 0)}, after {iso_time(ts)}; "
            "pass a later time"
        )
    return best


# -- the report fold ----------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """The run after the event ``seq``: counts of the fold, and running totals of events."""

    seq: int
    ts: float
    committed: int
    leased: int
    trained: int
    commits: int
    acks: int


@dataclass(frozen=True)
class Marker:
    """A crash (an epoch that ended with samples leased) or a resume, on the timeline."""

    kind: str
    seq: int
    ts: float
    epoch: int
    text: str


@dataclass(frozen=True)
class Outage:
    """From a crash (the last write of the crashed epoch's ranks) to the first lease after
    the resume that followed it; ``lease_seq`` and ``lease_ts`` are None until there is one."""

    epoch: int
    crash_seq: int
    crash_ts: float
    lease_seq: int | None = None
    lease_ts: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.lease_ts is None else self.lease_ts - self.crash_ts


@dataclass(frozen=True)
class Resume:
    """When and by whom an epoch started."""

    epoch: int
    seq: int
    ts: float
    actor: str


class RunFold:
    """A run folded from its first event, with what a report shows beside the state.

    :meth:`update` folds the events not folded yet (up to ``upto_seq``), so a live
    view folds each event once. Beside ``state`` it keeps event counts per (kind, actor,
    epoch), each epoch's resume, crash and resume markers, the outages (each crash to
    the first lease after it), a timeline of points (at most about 2000: thinned evenly
    as the run grows), and, with ``window``, the events of the last ``window`` seconds
    (for rates).

    A crash is dated by the last write of the crashed epoch's ranks (its last event of
    a kind in ``Kind.FENCED``): the events between it and the resume are other writers'
    (producers commit on through a trainer outage), so the resume's predecessor would
    date the crash as late as the whole outage.
    """

    _MAX_POINTS = 2048

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        *,
        upto_seq: int | None = None,
        window: float | None = None,
    ) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.upto_seq = upto_seq
        self.window = window
        self.state = RunState(run_id, ref_source=ledger)
        self.counts: Counter[tuple[str, str, int]] = Counter()
        self.resumes: dict[int, Resume] = {}
        self.markers: list[Marker] = []
        self.outages: list[Outage] = []
        self._last_write: dict[int, tuple[int, float]] = {}  # epoch -> its ranks' last write
        self.points: list[Point] = []
        self.recent: deque[tuple[float, str, str]] = deque()
        self.events = 0
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self._stride = 1
        self._commits = 0
        self._acks = 0
        self._seq = 0

    def update(self, progress: Progress | None = None) -> int:
        """Fold the events after the last one folded; return how many there were."""
        cutoff = -math.inf if self.window is None else time.time() - self.window
        batch: list[tuple[Any, ...]] = []
        count = 0
        for row in self.ledger.rows(self.run_id, after_seq=self._seq, upto_seq=self.upto_seq):
            seq, kind, _sid, _rev, epoch, _step, actor, _payload, ts = row
            count += 1
            if not _is_time(ts):  # a damaged or hand-edited row: reported, not fatal
                self.state.violations.append(f"seq {seq}: {kind} event has no time ({ts!r:.40})")
                ts = self.last_ts if self.last_ts is not None else 0.0
                row = (*row[:8], ts)
            if self.first_ts is None:
                self.first_ts = ts
            previous_ts = self.last_ts if self.last_ts is not None else ts
            self.last_ts = max(previous_ts, ts)
            self.counts[kind, actor, epoch] += 1
            if kind in Kind.FENCED:
                self._last_write[epoch] = (seq, ts)
                if kind == Kind.LEASE:
                    self._end_outage(seq, epoch, ts)
            if self.window is not None and ts >= cutoff:
                self.recent.append((ts, kind, actor))
            if kind == Kind.RESUME:
                self._flush(batch)
                batch = []
                self._resume(tuple(row), previous_ts)
            else:
                batch.append(row)
                if kind == Kind.COMMIT:
                    self._commits += 1
                elif kind == Kind.ACK:
                    self._acks += 1
                if len(batch) >= self._stride:
                    self._flush(batch)
                    batch = []
            if progress is not None and count % _PROGRESS_EVERY == 0:
                progress(seq)
        self._flush(batch)
        self.events += count
        return count

    def _flush(self, batch: list[tuple[Any, ...]]) -> None:
        if not batch:
            return
        self.state.apply_rows(batch)
        self._seq = self.state.head_seq
        self._point()

    def _point(self) -> None:
        state = self.state
        assert self.last_ts is not None
        self.points.append(
            Point(
                state.head_seq,
                self.last_ts,
                len(state.committed),
                len(state.leased),
                len(state.trained),
                self._commits,
                self._acks,
            )
        )
        if len(self.points) > self._MAX_POINTS:
            self.points = self.points[-1::-2][::-1]  # every other one, the newest kept
            self._stride *= 2

    def _resume(self, row: tuple[Any, ...], previous_ts: float) -> None:
        state = self.state
        seq, epoch, actor, ts = row[0], row[4], row[6], row[8]
        if state.leased:
            crash_seq, crash_ts = self._last_write.get(state.epoch, (state.head_seq, previous_ts))
            self.markers.append(
                Marker(
                    "crash",
                    crash_seq,
                    crash_ts,
                    state.epoch,
                    f"epoch {state.epoch} ended with {len(state.leased)} samples leased "
                    "(the last write of its ranks)",
                )
            )
            self.outages.append(Outage(state.epoch, crash_seq, crash_ts))
        state.apply_rows((row,))
        self._seq = state.head_seq
        plan = state.plans.get(epoch)
        if state.epoch == epoch and plan is not None:
            self.resumes[epoch] = Resume(epoch, seq, ts, actor)
            where = (
                "from scratch"
                if plan.checkpoint is None
                else f"from step {plan.checkpoint.step} (epoch {plan.checkpoint.epoch})"
            )
            self.markers.append(Marker("resume", seq, ts, epoch, f"epoch {epoch} {where}"))
        self._point()

    def _end_outage(self, seq: int, epoch: int, ts: float) -> None:
        """A lease of an epoch after the crash of the open outage ends it."""
        if self.outages and self.outages[-1].lease_seq is None and epoch > self.outages[-1].epoch:
            self.outages[-1] = dataclasses.replace(self.outages[-1], lease_seq=seq, lease_ts=ts)

    def rates(self, now: float) -> Counter[tuple[str, str]]:
        """Events per (kind, actor) in the ``window`` seconds before ``now``."""
        if self.window is None:
            raise InvalidArgumentError("rates need a RunFold made with a window")
        while self.recent and self.recent[0][0] < now - self.window:
            self.recent.popleft()
        return Counter((kind, actor) for _ts, kind, actor in self.recent)


def summary(state: RunState) -> dict[str, Any]:
    """The run's counts and checkpoints (the keys of ``replay --json`` since its first)."""
    return {
        "run_id": state.run_id,
        "head_seq": state.head_seq,
        "epoch": state.epoch,
        "data_epoch": state.data_epoch,
        "committed": len(state.committed),
        "pending": len(state.pending),
        "leased": len(state.leased),
        "trained": len(state.trained),
        "released": len(state.released),
        "dead": len(state.dead),
        "lost": len(state.lost),
        "regenerate": len(state.regenerate),
        "checkpoints": checkpoint_rows(state),
        "producers_done": state.producers_done,
        "stores": list(state.store_uris),
    }


def on_disk(checkpoint: Checkpoint) -> bool | None:
    """Whether the checkpoint's files exist here; None for a URI (remote storage)."""
    if "://" in checkpoint.path:
        return None
    return os.path.exists(checkpoint.path)


def checkpoint_rows(state: RunState) -> list[dict[str, Any]]:
    in_lineage = {c.seq for c in state.lineage_checkpoints()}
    return [
        {
            "step": c.step,
            "epoch": c.epoch,
            "path": c.path,
            "seq": c.seq,
            "digest": c.digest,
            "removed": state.removed_checkpoints.get(c.seq),
            "on_disk": on_disk(c),
            "in_lineage": c.seq in in_lineage,
        }
        for c in state.checkpoints
    ]


def epoch_rows(state: RunState, resumes: dict[int, Resume]) -> list[dict[str, Any]]:
    """Each epoch: the checkpoint it resumed from, what its resume did, whether it is live."""
    current = {epoch for epoch, _cut in lineage(state)}
    rows = []
    for epoch, plan in sorted(state.plans.items()):
        started = resumes.get(epoch)
        ckpt = plan.checkpoint
        rows.append(
            {
                "epoch": epoch,
                "parent": ckpt.epoch if ckpt else None,
                "checkpoint_step": ckpt.step if ckpt else None,
                "checkpoint_seq": ckpt.seq if ckpt else None,
                "checkpoint_on_disk": on_disk(ckpt) if ckpt else None,
                "seq": started.seq if started else None,
                "time": iso_time(started.ts) if started else None,
                "by": started.actor if started else None,
                "world_size": plan.world_size,
                "requeued": len(plan.requeued),
                "released": len(plan.released),
                "regenerate": len(plan.regenerate),
                "in_lineage": epoch in current,
            }
        )
    return rows


def throughput(fold: RunFold, buckets: int = 8) -> list[dict[str, Any]]:
    """The run's timeline cut into ``buckets`` equal spans of time: rates and counts.

    Each span: its start, length, commits and acks (and per second), and the committed,
    in-flight (leased) and trained counts at its end.
    """
    points = fold.points
    if not points or fold.first_ts is None:
        return []
    start, end = fold.first_ts, points[-1].ts
    n = buckets if end > start else 1
    width = (end - start) / n
    times = [p.ts for p in points]
    rows, commits, acks, t0 = [], 0, 0, start
    for i in range(n):
        edge = end if i == n - 1 else start + width * (i + 1)
        k = bisect.bisect_right(times, edge) - 1
        p = points[k] if k >= 0 else Point(0, start, 0, 0, 0, 0, 0)
        seconds = edge - t0
        rows.append(
            {
                "start": iso_time(t0),
                "seconds": round(seconds, 3),
                "commits": p.commits - commits,
                "acks": p.acks - acks,
                "commits_per_s": round((p.commits - commits) / seconds, 3) if seconds else None,
                "acks_per_s": round((p.acks - acks) / seconds, 3) if seconds else None,
                "committed": p.committed,
                "in_flight": p.leased,
                "trained": p.trained,
            }
        )
        commits, acks, t0 = p.commits, p.acks, edge
    return rows


def run_report(fold: RunFold) -> dict[str, Any]:
    """Everything ``replay`` prints: counts, checkpoints, epochs, throughput, violations."""
    state = fold.state
    return summary(state) | {
        "violations": state.verify(),
        "events": fold.events,
        "first_time": iso_time(fold.first_ts) if fold.first_ts is not None else None,
        "last_time": iso_time(fold.last_ts) if fold.last_ts is not None else None,
        "lineage": [epoch for epoch, _cut in lineage(state)],
        "epochs": epoch_rows(state, fold.resumes),
        "throughput": throughput(fold),
        "markers": [
            {"kind": m.kind, "seq": m.seq, "time": iso_time(m.ts), "epoch": m.epoch, "text": m.text}
            | {"ts": m.ts}
            for m in fold.markers
        ],
        "outages": [outage_row(o) for o in fold.outages],
    }


def outage_row(outage: Outage) -> dict[str, Any]:
    """An outage as ``replay --json`` shows it (the lease and seconds null while it lasts)."""
    seconds = outage.seconds
    return {
        "epoch": outage.epoch,
        "crash_seq": outage.crash_seq,
        "crash_time": iso_time(outage.crash_ts),
        "crash_ts": outage.crash_ts,
        "first_lease_seq": outage.lease_seq,
        "first_lease_time": None if outage.lease_ts is None else iso_time(outage.lease_ts),
        "first_lease_ts": outage.lease_ts,
        "seconds": None if seconds is None else round(seconds, 3),
    }


# -- what a resume would do ---------------------------------------------------------


def plan_resume(
    ledger: Ledger, run_id: str, checkpoint: object, *, upto_seq: int | None = None
) -> dict[str, Any]:
    """What ``Consumer.resume(checkpoint)`` would do now, without writing anything.

    ``checkpoint``: a step, ``"latest"`` or None (from scratch), as ``resume`` takes it.
    The run is folded, then one resume event, exactly as rank 0 would append it with
    the current epoch's settings (world size, release policy, attempts, order seed), is
    folded into that state alone. UnknownCheckpointError names the recorded steps.
    """
    if (
        checkpoint is not None
        and checkpoint != "latest"
        and (not isinstance(checkpoint, int) or isinstance(checkpoint, bool))
    ):  # as resume refuses them: True and 1.0 are no step 1
        raise ArgumentTypeError(
            'checkpoint must be a step (an int), "latest" or None, got '
            f"{type(checkpoint).__name__} {checkpoint!r:.100}"
        )
    state = replay(ledger, run_id, upto_seq=upto_seq)
    ckpt = None if checkpoint is None else state.checkpoint_for(checkpoint)
    if ckpt is None and checkpoint not in (None, "latest"):
        usable = sorted({c.step for c in state.checkpoints} - _removed_steps(state))
        removed = sorted(_removed_steps(state))
        raise UnknownCheckpointError(
            f"run {run_id!r} has no checkpoint at step {checkpoint} to resume from; "
            f"recorded steps: {usable[-20:] or 'none'}"
            + (f" (removed: {removed[-20:]})" if removed else "")
            + " (check --plan-resume; `latest` or `none` also work)"
        )
    trained_before, leased_before = dict(state.trained), dict(state.leased)
    epoch = state.epoch + 1
    node = state._epochs.get(state.epoch)  # the settings of the epoch a resume replaces
    payload: dict[str, Any] = {
        "checkpoint_seq": ckpt.seq if ckpt else None,
        "checkpoint_step": ckpt.step if ckpt else None,
        "world_size": state.world_size,
        "release_policy": state.release_policy,
        "max_attempts": node.max_attempts if node else 3,
    }
    if state.order_seed is not None:
        payload["order_seed"] = state.order_seed
    row = (
        state.head_seq + 1,
        Kind.RESUME,
        None,
        None,
        epoch,
        ckpt.step if ckpt else None,
        PLAN_ACTOR,
        dump_payload(payload),
        time.time(),
    )
    state.apply_rows((row,))
    plan = state.plans[epoch]
    untrained = [s for s in trained_before if s not in plan.trained]
    return {
        "run_id": run_id,
        "head_seq": row[0] - 1,
        "epoch": epoch,
        "checkpoint": None
        if ckpt is None
        else {"step": ckpt.step, "epoch": ckpt.epoch, "seq": ckpt.seq, "path": ckpt.path}
        | {"on_disk": on_disk(ckpt)},
        "world_size": plan.world_size,
        "release_policy": payload["release_policy"],
        "trained": len(plan.trained),
        "requeued": list(plan.requeued),
        "requeued_per_rank": [
            len(plan.requeued[rank :: plan.world_size]) for rank in range(plan.world_size)
        ],
        "released": list(plan.released),
        "regenerate": list(plan.regenerate),
        "untrained": untrained,
        "leases_voided": sorted(leased_before),
    }


def _removed_steps(state: RunState) -> set[int]:
    return {c.step for c in state.checkpoints if c.seq in state.removed_checkpoints}


# -- live status --------------------------------------------------------------------


def status(fold: RunFold, now: float) -> dict[str, Any]:
    """In-flight work per consumer and producer, lag and rates, from a RunFold with a window."""
    state = fold.state
    window = fold.window or 0.0
    recent = fold.rates(now)

    def per_s(kind: str, actor: str | None = None) -> float:
        hits = sum(n for (k, a), n in recent.items() if k == kind and actor in (None, a))
        return round(hits / window, 3) if window else 0.0

    leased_by = Counter(state.leased.values())
    consumers = sorted(
        {a for (k, a, e) in fold.counts if e == state.epoch and k in Kind.FENCED} | set(leased_by)
    )
    committed = len(state.committed)
    return {
        "run_id": state.run_id,
        "events": fold.events,
        "head_seq": state.head_seq,
        "epoch": state.epoch,
        "world_size": state.world_size,
        "last_event": iso_time(fold.last_ts) if fold.last_ts is not None else None,
        "idle_s": round(now - fold.last_ts, 3) if fold.last_ts is not None else None,
        "committed": committed,
        "pending": len(state.pending),
        "leased": len(state.leased),
        "trained": len(state.trained),
        "regenerate": len(state.regenerate),
        "lost": len(state.lost),
        "dead": len(state.dead),
        "released": len(state.released),
        "lag": committed - len(state.trained) - len(state.dead),
        "producers_done": state.producers_done,
        "stores": list(state.store_uris),
        "window_s": window,
        "rates": {
            "commits_per_s": per_s(Kind.COMMIT),
            "leases_per_s": per_s(Kind.LEASE),
            "acks_per_s": per_s(Kind.ACK),
        },
        "pending_per_rank": [state.pending_count(rank) for rank in range(state.world_size)],
        "producers": {
            pid: {
                "committed": sum(
                    n for (k, a, _e), n in fold.counts.items() if k == Kind.COMMIT and a == pid
                ),
                "closed": pid in state.closed,
                "epoch": state.producer_epochs.get(pid, 0),
                "commits_per_s": per_s(Kind.COMMIT, pid),
            }
            for pid in sorted(state.producers | state.closed)
        },
        "consumers": {
            cid: {
                "leased": leased_by[cid],
                "acked": fold.counts[Kind.ACK, cid, state.epoch],
                "last_step": state.last_ack_step(cid),
                "acks_per_s": per_s(Kind.ACK, cid),
            }
            for cid in consumers
        },
    }


# -- the plot -------------------------------------------------------------------------


def plot_timeline(fold: RunFold, path: str) -> None:
    """Draw committed, in flight and trained over time, crashes, resumes and outages
    marked, to PNG.

    ImportError when matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    start = fold.first_ts or 0.0
    xs = [p.ts - start for p in fold.points]
    figure = Figure(figsize=(10, 5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, values in (
        ("committed", [p.committed for p in fold.points]),
        ("in flight", [p.leased for p in fold.points]),
        ("trained", [p.trained for p in fold.points]),
    ):
        axes.step(xs, values, where="post", label=name)
    styles = {"crash": ("tab:red", ":"), "resume": ("tab:gray", "--")}
    labelled: set[str] = set()
    for marker in fold.markers:
        color, style = styles[marker.kind]
        axes.axvline(
            marker.ts - start,
            color=color,
            linestyle=style,
            label=marker.kind if marker.kind not in labelled else None,
        )
        labelled.add(marker.kind)
        axes.annotate(
            marker.text,
            (marker.ts - start, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=color,
        )
    end = fold.last_ts or start
    for n, outage in enumerate(fold.outages):
        until = outage.lease_ts if outage.lease_ts is not None else end
        axes.axvspan(
            outage.crash_ts - start,
            until - start,
            color="tab:red",
            alpha=0.1,
            label="outage (crash to first lease)" if n == 0 else None,
        )
    axes.set_xlabel(f"seconds since the first event ({iso_time(start)})")
    axes.set_ylabel("samples")
    axes.set_title(f"run {fold.run_id!r}")
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
