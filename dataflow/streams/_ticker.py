"""A daemon thread that keeps a stream end's heartbeats going while its owner is busy."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("dataflow.streams")


class Ticker:
    """Calls ``pump`` every ``interval`` seconds, under ``lock``, until stopped.

    A tick is skipped while another thread holds the lock: the holder is inside
    send or receive, which pump themselves. Without the thread a producer busy
    computing features (or a trainer busy in a step) would look dead to its peers.
    """

    def __init__(
        self, name: str, interval: float, lock: threading.Lock, pump: Callable[[], None]
    ) -> None:
        self._interval = interval
        self._lock = lock
        self._pump = pump
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                self._pump()
            except Exception:  # a dying ticker would silently stop the heartbeats
                log.exception("%s: heartbeat tick failed", self._thread.name)
            finally:
                self._lock.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
