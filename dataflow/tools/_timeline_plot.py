"""The run's timeline drawn to an image (``replay --plot``); matplotlib is imported on use."""

from __future__ import annotations

from dataflow.tools._run_fold import RunFold
from dataflow.tools._times import iso_time


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
