"""replay: fold a recorded run into its RunState."""

from __future__ import annotations

from dataflow.live._view import RunView
from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError
from dataflow.model._fold import RunState
from dataflow.recorder._ledger import Ledger


def replay(
    ledger: Ledger, run_id: str, upto_seq: int | None = None, *, snapshots: bool = True
) -> RunState:
    """Fold the run's log (up to ``upto_seq``) into its RunState, in constant read memory.

    Starts from the newest valid snapshot at or before ``upto_seq`` and folds
    the events after it; ``snapshots=False`` folds the whole log (what a
    snapshot is checked against).
    """
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(f"replay needs a Ledger, got {type(ledger).__name__}")
    if upto_seq is not None and (
        not isinstance(upto_seq, int) or isinstance(upto_seq, bool) or not 0 <= upto_seq < 2**63
    ):
        raise InvalidArgumentError(
            f"upto_seq must be an int from 0 to 2**63-1 or None, got {upto_seq!r}"
        )
    if not isinstance(snapshots, bool):
        raise ArgumentTypeError(f"snapshots must be a bool, got {snapshots!r}")
    return RunView(ledger, run_id, upto_seq=upto_seq, snapshots=snapshots).catch_up()
