"""Removals of Mooncake keys that wait for read leases, retried in the background."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from stores._mooncake_codes import NOT_FOUND, OK


class _Removals:
    """Removes generations (their tensors, then their record) and plain keys; what a read
    lease holds is retried in the background.

    Mooncake refuses to remove an object for a lease time after any read
    (OBJECT_HAS_LEASE); waiting for it in ``delete`` would stall every consumer
    that deletes what it just read. We never probe before removing (a probe is
    a read and renews the lease), and the keys that must wait are retried with
    backoff by a daemon thread; ``close`` tries once more and leaves the rest.

    A generation's record goes only once all its tensors are gone, so that a
    process that dies at any moment of a removal leaves the record behind,
    which ``scan`` lists and a collector frees (``dataflow gc``). The record
    is removed by force: only ``scan`` and ``delete_stored`` read records, and
    both read a record that does not decode once more (then finding none); a
    lease would otherwise make a collector that just read it wait. Tensors are
    never forced: a get racing the removal could read torn bytes. While the
    master does not answer (``reachable``), keys are queued without a try: a
    Mooncake call to a master that is down takes seconds to fail.
    """

    _BATCH = 1024

    def __init__(self, raw: Any, reachable: Callable[[], bool] = lambda: True) -> None:
        self._raw = raw
        self._reachable = reachable
        self._cond = threading.Condition()
        # record key ("" for plain keys) -> the tensor keys of it still stored
        self._groups: dict[str, set[str]] = {}
        self._objects: set[str] = set()  # every key in a group's set
        self._thread: threading.Thread | None = None
        self._delay = 0.05
        self._stopped = False

    def remove(self, keys: list[str]) -> None:
        """Remove plain keys (no record to keep until they are gone)."""
        self.remove_generations([["", *keys]])

    def remove_generations(self, generations: list[list[str]]) -> None:
        """Remove generations, each given as ``[record, *tensor keys]``."""
        groups: dict[str, set[str]] = {}
        for record, *tensors in generations:
            groups.setdefault(record, set()).update(tensors)
        left = self._try(groups)
        if left:
            with self._cond:
                for record, tensors in left.items():
                    self._groups.setdefault(record, set()).update(tensors)
                    self._objects.update(tensors)
                self._delay = 0.05
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="mooncake-removals", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()

    def is_pending(self, key: str) -> bool:
        with self._cond:
            return key in self._groups or key in self._objects

    def pending(self, prefix: str = "") -> list[str]:
        with self._cond:
            records = [k for k in self._groups if k and k.startswith(prefix)]
            return records + [k for k in self._objects if k.startswith(prefix)]

    def drain(self, prefix: str, timeout: float) -> list[str]:
        """Retry the pending keys under ``prefix`` until none is left or ``timeout`` passes
        (at least once); the keys left."""
        deadline = time.monotonic() + timeout
        while True:
            self._retry(prefix)
            keys = self.pending(prefix)
            if not keys or time.monotonic() >= deadline:
                return keys
            time.sleep(0.05)

    def _try(self, groups: dict[str, set[str]]) -> dict[str, set[str]]:
        """Remove what ``groups`` name, tensors first; what is left of them."""
        if not self._reachable():
            return groups
        kept = self._batch_remove([k for tensors in groups.values() for k in tensors], False)
        emptied = [record for record, tensors in groups.items() if record and not tensors & kept]
        kept_records = self._batch_remove(emptied, True)
        left = {record: tensors & kept for record, tensors in groups.items()}
        return {r: tensors for r, tensors in left.items() if tensors or r in kept_records}

    def _batch_remove(self, keys: list[str], force: bool) -> set[str]:
        """The keys that ``batch_remove`` left (under a read lease, or the master away)."""
        left: set[str] = set()
        for i in range(0, len(keys), self._BATCH):
            batch = keys[i : i + self._BATCH]
            codes = self._raw.batch_remove(batch, force)
            left.update(k for k, c in zip(batch, codes, strict=True) if c not in (OK, NOT_FOUND))
        return left

    def _retry(self, prefix: str = "") -> None:
        with self._cond:
            groups = {
                record: set(tensors)
                for record, tensors in self._groups.items()
                if record.startswith(prefix) or any(k.startswith(prefix) for k in tensors)
            }
        if not groups:
            return
        left = self._try(groups)
        with self._cond:
            for record, tensors in groups.items():
                gone = tensors - left.get(record, set())
                self._objects -= gone
                now = self._groups.get(record)
                if now is None:
                    continue
                now -= gone
                if not now and record not in left:
                    del self._groups[record]

    def stop(self) -> None:
        """End the retries (before the client closes); what is pending stays stored."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._groups or self._stopped:
                    self._thread = None
                    return
                self._cond.wait(self._delay)
                self._delay = min(self._delay * 2, 1.0)
                stopped = self._stopped
            if not stopped:
                self._retry()
