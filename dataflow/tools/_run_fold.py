"""The status fold: a run folded from its first event, with the timeline a report draws."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataflow.live._restarts import RestartTracker
from dataflow.live._view import Row, RunView
from dataflow.model._errors import InvalidArgumentError
from dataflow.model._events import Kind, row_samples
from dataflow.model._fold import RunState
from dataflow.tools._progress import PROGRESS_EVERY, Progress
from dataflow.tools._times import is_time

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger


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
    epoch) (by sample: a batch row counts once for each sample it names), each epoch's
    resume, crash and resume markers, the outages (each crash to the first lease after it),
    a timeline of points (at most about 2000: thinned evenly as the run grows), and, with
    ``window``, the events of the last ``window`` seconds (for rates).

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
        #: Folds from the first event (no snapshot): the counts and the timeline need them all.
        self.view = RunView(ledger, run_id, upto_seq=upto_seq, snapshots=False)
        self.counts: Counter[tuple[str, str, int]] = Counter()
        self.resumes: dict[int, Resume] = {}
        self.markers: list[Marker] = []
        self.outages: list[Outage] = []
        self._last_write: dict[int, tuple[int, float]] = {}  # epoch -> its ranks' last write
        self.points: list[Point] = []
        self.recent: deque[tuple[float, str, str, int]] = deque()
        self.events = 0
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self._stride = 1
        #: Each restart's cost, followed in the same pass (``live/_restarts.py``).
        self.restarts = RestartTracker()
        self._commits = 0
        self._acks = 0

    @property
    def state(self) -> RunState:
        """The run's fold, up to the last event :meth:`update` read."""
        return self.view.state

    def update(self, progress: Progress | None = None) -> int:
        """Fold the events after the last one folded; return how many there were."""
        # The ledger's clock, which stamped the rows (another host's time.time() may be off).
        cutoff = -math.inf if self.window is None else self.ledger.clock() - self.window
        batch: list[Row] = []
        count = 0
        for row in self.view.tail():
            count += 1
            row, previous_ts = self._note(row, cutoff)
            if row[1] == Kind.RESUME:
                self._flush(batch)
                batch = []
                self._resume(tuple(row), previous_ts)
            else:
                batch.append(row)
                if len(batch) >= self._stride:
                    self._flush(batch)
                    batch = []
            if progress is not None and count % PROGRESS_EVERY == 0:
                progress(row[0])
        self._flush(batch)
        self.events += count
        return count

    def _note(self, row: Row, cutoff: float) -> tuple[Row, float]:
        """Count one event, before it is folded; return it (its time mended when it has
        none) and the time of the event before it."""
        seq, kind, sid, _rev, epoch, _step, actor, payload, ts = row
        if not is_time(ts):  # a damaged or hand-edited row: reported, not fatal
            self.state.violations.append(f"seq {seq}: {kind} event has no time ({ts!r:.40})")
            ts = self.last_ts if self.last_ts is not None else 0.0
            row = (*row[:8], ts)
        if self.first_ts is None:
            self.first_ts = ts
        previous_ts = self.last_ts if self.last_ts is not None else ts
        self.last_ts = max(previous_ts, ts)
        # By sample: a batch row counts once for each sample it names.
        n = max(len(row_samples(kind, None, payload)), 1) if sid is None else 1
        self.counts[kind, actor, epoch] += n
        if kind in Kind.FENCED:
            self._last_write[epoch] = (seq, ts)
            if kind == Kind.LEASE:
                self._end_outage(seq, epoch, ts)
        if self.window is not None and ts >= cutoff:
            self.recent.append((ts, kind, actor, n))
        if kind == Kind.COMMIT:
            self._commits += 1
        elif kind == Kind.ACK:
            self._acks += n
        return row, previous_ts

    def _flush(self, batch: list[Row]) -> None:
        if not batch:
            return
        self.restarts.observe(batch)
        self.view.apply(batch)
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

    def _resume(self, row: Row, previous_ts: float) -> None:
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
        self.restarts.observe((row,))
        self.view.apply((row,))
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
        """Events per (kind, actor) in the ``window`` seconds before ``now`` (a batch row
        counts once for each sample it names)."""
        if self.window is None:
            raise InvalidArgumentError("rates need a RunFold made with a window")
        while self.recent and self.recent[0][0] < now - self.window:
            self.recent.popleft()
        rates: Counter[tuple[str, str]] = Counter()
        for _ts, kind, actor, n in self.recent:
            rates[kind, actor] += n
        return rates
