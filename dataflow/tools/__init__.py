"""Read-side tools over a recorded run: inspect, reports (as data and as text), export, gc."""

from dataflow.tools._gc import GcReport, collect_garbage

__all__ = [
    "GcReport",
    "collect_garbage",
]
