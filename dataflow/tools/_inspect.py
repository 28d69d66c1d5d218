"""What ``dataflow replay``, ``status`` and ``export`` show, derived from a run's log.

The names of the read side in one place; each lives in the module of its concern:
:mod:`._samples` (one sample's state and history), :mod:`._times` (the times shown and
taken), :mod:`._time_travel` (the seq of a step or a time, the lineage),
:mod:`._run_fold` (the status fold, ``RunFold``), :mod:`._run_report` (what ``replay``
reports), :mod:`._status` (what ``status`` shows), :mod:`._resume_plan` (what a resume
would do) and :mod:`._timeline_plot` (the plot). Nothing here writes to the ledger.

``progress``, where a function takes it, is called with the seq reached every few
thousand events (a progress bar's hook).
"""

from __future__ import annotations

from dataflow.tools._progress import Progress
from dataflow.tools._resume_plan import PLAN_ACTOR, plan_resume
from dataflow.tools._run_fold import Marker, Outage, Point, Resume, RunFold
from dataflow.tools._run_report import (
    checkpoint_rows,
    epoch_rows,
    on_disk,
    outage_row,
    run_report,
    summary,
    throughput,
)
from dataflow.tools._samples import (
    SAMPLE_STATES,
    NotInRunError,
    sample_history,
    sample_row,
    sample_rows,
    sample_state,
)
from dataflow.tools._status import status
from dataflow.tools._time_travel import lineage, seq_at_step, seq_at_time
from dataflow.tools._timeline_plot import plot_timeline
from dataflow.tools._times import iso_time, parse_time

__all__ = [
    "PLAN_ACTOR",
    "SAMPLE_STATES",
    "Marker",
    "NotInRunError",
    "Outage",
    "Point",
    "Progress",
    "Resume",
    "RunFold",
    "checkpoint_rows",
    "epoch_rows",
    "iso_time",
    "lineage",
    "on_disk",
    "outage_row",
    "parse_time",
    "plan_resume",
    "plot_timeline",
    "run_report",
    "sample_history",
    "sample_row",
    "sample_rows",
    "sample_state",
    "seq_at_step",
    "seq_at_time",
    "status",
    "summary",
    "throughput",
]
