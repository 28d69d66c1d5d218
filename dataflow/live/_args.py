"""The live layer's shared argument checks: the roles', an emit's wait, a timeout.

Every write happens in one ledger transaction that holds the run's lock:
the role (:class:`dataflow.Producer`, :class:`dataflow.Consumer`) first
folds the events it has not seen yet into its live RunState, validates the
write against that exact state, appends, and folds its own events back in.
A bad write raises before anything is appended; a bad argument, before
anything is read.
"""

from __future__ import annotations

from dataflow.interfaces._store import FeatureStore
from dataflow.model._checks import check_seconds
from dataflow.model._errors import ArgumentTypeError
from dataflow.recorder._ledger import Ledger, _check_run_id


def _check_roles_args(ledger: object, store: object, run_id: object) -> None:
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(f"ledger must be a dataflow.Ledger, got {type(ledger).__name__}")
    if not isinstance(store, FeatureStore):
        raise ArgumentTypeError(f"store must be a stores.FeatureStore, got {type(store).__name__}")
    _check_run_id(run_id)


def check_wait(block: object, timeout: object) -> None:
    """Refuse bad ``block`` / ``timeout`` arguments of an emit, naming them."""
    if not isinstance(block, bool):
        raise ArgumentTypeError(f"block must be a bool, got {type(block).__name__} {block!r}")
    check_timeout(timeout, none_means="wait as long as it takes")


def check_timeout(timeout: object, *, none_means: str) -> None:
    """Refuse a ``timeout`` that is not None or a finite number of seconds >= 0."""
    check_seconds(
        "timeout",
        timeout,
        allow_none=True,
        expected=f"a non-negative number of seconds or None ({none_means})",
    )
