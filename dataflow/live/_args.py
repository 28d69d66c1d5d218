"""What the two roles that write a run's log share: their argument checks.

Every write happens in one ledger transaction that holds the run's lock:
the role (:class:`dataflow.Producer`, :class:`dataflow.Consumer`) first
folds the events it has not seen yet into its live RunState, validates the
write against that exact state, appends, and folds its own events back in.
A bad write raises before anything is appended.
"""

from __future__ import annotations

from dataflow.interfaces._store import FeatureStore
from dataflow.model._errors import ArgumentTypeError
from dataflow.recorder._ledger import Ledger, _check_run_id


def _check_roles_args(ledger: object, store: object, run_id: object) -> None:
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(f"ledger must be a dataflow.Ledger, got {type(ledger).__name__}")
    if not isinstance(store, FeatureStore):
        raise ArgumentTypeError(f"store must be a stores.FeatureStore, got {type(store).__name__}")
    _check_run_id(run_id)
