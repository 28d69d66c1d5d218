"""Observers of appends: callbacks told of every append transaction that committed.

The recorder knows nothing of who listens (metrics, a tracer, a test). An observer
is called as ``callback(ledger_url, run_id, what, seconds)`` in the appending
thread, right after the commit: ``what`` names the operation (``"commit"``,
``"lease"``, ``"ack"`` ...) and ``seconds`` is how long the transaction took
from its start, lock wait included. It must be quick and must not raise: the
append has committed, and an exception would reach the writer as if it had not.

With no observer an append pays one attribute read and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

AppendObserver = Callable[[str, str, str, float], None]

#: The subscribed observers. Copy-on-write (a new tuple per change), so that
#: ``Ledger.write`` reads it without a lock from any thread.
observers: tuple[AppendObserver, ...] = ()
_lock = threading.Lock()


def subscribe(callback: AppendObserver) -> None:
    """Call ``callback`` after every committed append of this process (once, however
    often it is subscribed)."""
    global observers
    with _lock:
        if callback not in observers:
            observers = (*observers, callback)


def unsubscribe(callback: AppendObserver) -> None:
    """Stop calling ``callback``; nothing happens if it was not subscribed."""
    global observers
    with _lock:
        observers = tuple(c for c in observers if c != callback)


def notify(ledger_url: str, run_id: str, what: str, seconds: float) -> None:
    """Tell every observer of one committed append."""
    for callback in observers:
        callback(ledger_url, run_id, what, seconds)
