"""Threads that start a call at the same moment, for the concurrency tests."""

from __future__ import annotations

import threading
from collections.abc import Callable

JOIN_TIMEOUT_S = 120


def errors_of_threads(target: Callable[[], object], count: int) -> list[BaseException]:
    """Run ``target`` in ``count`` threads released together by a barrier; what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run() -> None:
        try:
            barrier.wait(timeout=60)
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    return errors
