"""The process that lends a Mooncake store its memory (``dataflow mooncake-keeper``).

Mooncake keeps every object in memory that some client lends the cluster (its
segment, ``segment_size``), and a process that dies takes its segment, and every
feature stored there, with it. So producers and ranks, which crash and get killed,
open their stores with ``segment_size=0``, and one long-lived process lends the
memory: this one, until SIGTERM or SIGINT.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

from dataflow import InvalidRefError
from stores._mooncake import MooncakeFeatureStore

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def lend_memory(
    uri: str,
    *,
    ready: Callable[[MooncakeFeatureStore], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Open the Mooncake store at ``uri``, which lends its ``segment_size`` to the
    cluster, and hold it until SIGTERM or SIGINT (or ``stop`` is set); then close it.

    ``ready(store)`` is called once the memory is lent. Signal handlers are set only
    when called from the main thread (the only thread Python delivers signals to).
    """
    store = MooncakeFeatureStore.from_uri(uri)
    try:
        if store.segment_size <= 0:
            raise InvalidRefError(
                f"{uri!r} lends no memory (segment_size=0): give the keeper a "
                "segment_size, e.g. segment_size=4G"
            )
        stop = stop or threading.Event()
        restore = _on_stop_signals(stop)
        try:
            if ready is not None:
                ready(store)
            while not stop.wait(1.0):
                pass
        finally:
            restore()
    finally:
        store.close()


def _on_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Make SIGTERM and SIGINT set ``stop``; the function that puts the old handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {sig: signal.signal(sig, handle) for sig in _STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore
