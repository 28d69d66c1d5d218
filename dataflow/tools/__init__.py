"""Read-side tools over a recorded run: inspect, export, garbage collection."""

from dataflow.tools._gc import GcReport, collect_garbage

__all__ = [
    "GcReport",
    "collect_garbage",
]
