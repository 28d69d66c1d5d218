"""Retention and rewind: which checkpoints go, recorded in the ledger before their files."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

from dataflow import Consumer
from training._layout import TMP_PREFIX, TRASH_PREFIX, parse_dir_name

log = logging.getLogger("training")


class _Retention:
    """Removing checkpoints: retention, rewind and the sweep after a resume (a part of the
    manager)."""

    def _retain(self, just_written: Path, step: int) -> None:
        saved = self.saved()
        doomed: dict[Path, str] = {}
        consumer = self.consumer
        if consumer is not None:
            lineage = {Path(c.path).name for c in consumer.state.lineage_checkpoints()}
            for c in saved:
                # Only checkpoints of some lineage (named with their epoch) are rewound:
                # one saved without a ledger belongs to none, so retention alone decides.
                abandoned = c.epoch is not None and c.path.name not in lineage
                if c.step >= step and c.path != just_written and abandoned:
                    doomed[c.path] = "rewind"
        k = self.config.keep_latest_k
        if k:
            survivors = [c for c in saved if c.path not in doomed]
            keep = {c.path for c in survivors[-k:]} | {just_written}
            best = self._best_of(saved) if self.config.keep_best else None
            if best is not None and best.path not in doomed:
                keep.add(best.path)
            doomed.update({c.path: "retention" for c in survivors if c.path not in keep})
        if not doomed:
            return
        self._remove(doomed)
        best_path = self._best.path
        if best_path is None or best_path in doomed:
            self._best.set(self._best_of([c for c in saved if c.path not in doomed]))

    def _remove(self, doomed: dict[Path, str]) -> None:
        consumer = self.consumer
        if consumer is not None:
            recorded = {Path(c.path).name: c for c in consumer.state.checkpoints}
            for reason in sorted(set(doomed.values())):
                names = [p.name for p, why in doomed.items() if why == reason]
                known = [recorded[n] for n in names if n in recorded]
                if known:
                    # In the ledger before the files go: a crash in between leaves files
                    # nobody resumes from (swept later), never a record of missing files.
                    consumer.remove_checkpoints(known, reason=reason)
        for path in doomed:
            log.info("removing checkpoint %s (%s)", path, doomed[path])
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Renamed away first, so no reader ever sees a half-deleted checkpoint.
        trash = path.parent / f"{TRASH_PREFIX}{secrets.token_hex(4)}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self, consumer: Consumer) -> None:
        """Rank 0 after a resume: drop temporary and trash directories, and directories of
        older epochs the ledger never recorded or recorded as removed.

        Garbage collection, so it never fails the resume: the other ranks have returned
        from theirs already. What it cannot remove is logged, and the next resume tries
        again."""
        run_dir = self.run_dir
        if not run_dir.is_dir():
            return
        state = consumer.state
        recorded = {
            Path(c.path).name for c in state.checkpoints if c.seq not in state.removed_checkpoints
        }
        try:
            entries = list(run_dir.iterdir())
        except OSError as exc:
            log.warning("could not list %s (%s); the next resume sweeps it", run_dir, exc)
            return
        for path in entries:
            if path.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                continue
            parsed = parse_dir_name(path.name)
            stale = parsed is not None and parsed[1] is not None and parsed[1] < state.epoch
            if stale and path.name not in recorded:
                log.info("removing %s: no checkpoint the ledger can resume from", path)
                try:
                    self._discard(path)
                except OSError as exc:
                    log.warning("could not remove %s (%s); the next resume tries again", path, exc)
