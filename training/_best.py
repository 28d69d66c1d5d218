"""The best checkpoint of a run: ``{root}/{run}.best_meta.json`` and the ``{run}-best`` pointer."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dataflow import InvalidArgumentError
from training._layout import SavedCheckpoint, point, unpoint, write_atomic

log = logging.getLogger(__name__)


class BestRecord:
    """Scores metrics by ``metric`` and ``mode``, and keeps the record of the best on disk.

    The record is read when made; a corrupt one, or one for another run, metric or
    mode, is ignored with a warning, and the checkpoints' manifests decide instead.
    """

    def __init__(self, *, root: Path, name: str, run_id: str, metric: str, mode: str) -> None:
        self.root = root
        self.file = root / f"{name}.best_meta.json"
        self.pointer = root / f"{name}-best"
        self.run_id, self.metric, self.mode = run_id, metric, mode
        self.meta = self._load()

    def score(self, metrics: Mapping[str, float] | None) -> float | None:
        """Higher is better; None for metrics that never count (empty, missing, non-finite)."""
        if not metrics:
            return None
        value = metrics.get(self.metric, math.nan)
        if not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return value if self.mode == "max" else -value

    def beats(
        self,
        metrics: Mapping[str, float] | None,
        *,
        scan: Callable[[], SavedCheckpoint | None],
        strict: bool,
    ) -> bool:
        """Whether ``metrics`` beat (``strict``) or match the best; ``scan`` finds the best
        from the manifests when there is no record."""
        score = self.score(metrics)
        if score is None:
            return False
        if self.meta is not None:
            current = self.score({self.metric: self.meta["score"]})
        else:
            best = scan()
            if best is None:
                return True
            current = self.score(best.metrics)
        assert current is not None
        return score > current if strict else score >= current

    def set(self, saved: SavedCheckpoint | None) -> None:
        """Record ``saved`` as the best (atomically), or drop the record (None)."""
        if saved is None:
            self.meta = None
            unpoint(self.pointer)
            self.file.unlink(missing_ok=True)
            return
        meta = {
            "run_id": self.run_id,
            "metric": self.metric,
            "mode": self.mode,
            "score": saved.metrics[self.metric],  # type: ignore[index]
            "step": saved.step,
            "path": os.path.relpath(saved.path, self.root),
        }
        write_atomic(self.file, (json.dumps(meta, indent=1) + "\n").encode())
        point(self.pointer, saved.path)
        self.meta = meta

    @property
    def path(self) -> Path | None:
        return None if self.meta is None else self.root / self.meta["path"]

    def _load(self) -> dict[str, Any] | None:
        file = self.file
        if not file.exists():
            return None
        try:
            meta = json.loads(file.read_text())
            score = float(meta["score"])
            if not math.isfinite(score) or not isinstance(meta["step"], int):
                raise InvalidArgumentError(f"score {score} / step {meta['step']!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"ignoring the corrupt best record {file}: {exc}", stacklevel=4)
            return None
        mine = (self.run_id, self.metric, self.mode)
        theirs = (meta.get("run_id"), meta.get("metric"), meta.get("mode"))
        if theirs != mine:
            warnings.warn(
                f"ignoring the best record {file}: it is for (run, metric, mode) {theirs}, "
                f"this manager tracks {mine}",
                stacklevel=4,
            )
            return None
        path = meta.get("path")
        if not isinstance(path, str):
            warnings.warn(f"ignoring the corrupt best record {file}: path {path!r}", stacklevel=4)
            return None
        if not (self.root / path).is_dir():
            # A crash between removing the best checkpoint and updating this record.
            log.warning(
                "ignoring the best record %s: its checkpoint %s is gone; the checkpoints' "
                "manifests decide the best",
                file,
                path,
            )
            return None
        return meta
