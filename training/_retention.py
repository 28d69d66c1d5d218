"""Retention and rewind: which checkpoints go, recorded in the ledger before their files."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from dataflow import Consumer
from training._layout import TMP_PREFIX, TRASH_PREFIX, parse_dir_name

log = logging.getLogger("training")


class _Retention:
    """Removing checkpoints: retention, rewind and the sweep after a resume (a part of the
    manager)."""

    #: The checkpoint directories the newest save removed, each with why (``retention``
    #: or ``rewind``); empty before the first save. See :attr:`removed_by_last_save`.
    _removed_by_last_save: Mapping[Path, str] = MappingProxyType({})

    @property
    def removed_by_last_save(self) -> dict[Path, str]:
        """The checkpoint directories the newest save removed (rank 0), each with why:
        ``"retention"`` (``keep_latest_k``) or ``"rewind"`` (a later step of a lineage the
        run went back from, whether its files were intact or not)."""
        return dict(self._removed_by_last_save)

    def _rewound(self, just_written: Path, step: int) -> dict[Path, str]:
        """Every directory of the run that the save of ``step`` rewinds, intact or not.

        With a consumer: the checkpoints of abandoned lineages (named with their epoch)
        at ``step`` and later; one saved without a ledger belongs to no lineage, so
        retention alone decides. Without one: every checkpoint at a later step (saving
        an earlier step than a saved one is going back). Directories are read by name,
        not by manifest, so one whose files are corrupt goes too: it is no checkpoint
        anyone can resume from, and left behind it would pass for the newest.
        """
        consumer = self.consumer
        lineage = (
            None
            if consumer is None
            else {Path(c.path).name for c in consumer.state.lineage_checkpoints()}
        )
        doomed: dict[Path, str] = {}
        try:
            entries = sorted(self.run_dir.iterdir())
        except OSError:
            return doomed
        for path in entries:
            parsed = parse_dir_name(path.name)
            if parsed is None or path == just_written or not path.is_dir():
                continue
            at, epoch = parsed
            if lineage is None:
                later = epoch is None and at > step
            else:
                later = epoch is not None and path.name not in lineage and at >= step
            if later:
                doomed[path] = "rewind"
        return doomed

    def _retain(self, just_written: Path, step: int) -> None:
        self._removed_by_last_save = MappingProxyType({})
        saved = self.saved()
        doomed = self._rewound(just_written, step)
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
        self._removed_by_last_save = MappingProxyType(dict(doomed))
        log.info(
            "the save of step %d removed %s",
            step,
            ", ".join(f"{p.name} ({why})" for p, why in doomed.items()),
        )
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
