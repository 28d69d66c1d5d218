"""Read-side tools over a recorded run: inspect, reports (as data and as text), export, gc."""

from dataflow.live._restarts import ResumeCost, restart_costs
from dataflow.tools._diff import FinalLineage, RunDiff, diff_runs, final_lineage
from dataflow.tools._doctor import DoctorLimits, DoctorReport, Finding, doctor
from dataflow.tools._gc import GcReport, collect_garbage

__all__ = [
    "DoctorLimits",
    "DoctorReport",
    "FinalLineage",
    "Finding",
    "GcReport",
    "ResumeCost",
    "RunDiff",
    "collect_garbage",
    "diff_runs",
    "doctor",
    "final_lineage",
    "restart_costs",
]
