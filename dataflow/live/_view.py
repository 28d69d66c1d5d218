"""The one place that folds a live run: its newest snapshot, then the tail, refolded when asked.

Every reader of a run's state goes through :class:`RunView`: the consumer
(which also folds its own writes inside each transaction), backpressure's
backlog, ``dataflow status`` and :func:`dataflow.replay`. A view starts from
the newest valid snapshot at or before ``upto_seq`` (or from an empty fold)
and folds the events after it; :meth:`RunView.refold` builds a new fold from
scratch and swaps it in only once it is whole, so a read that fails halfway
leaves the old fold as it was.

A view with ``forget=True`` (a live consumer's, ``Consumer.forget_finished``) keeps a
fold that forgets finished samples (``RunState.forget_finished``); at a row such a fold
cannot take exactly, the view folds the run anew, whole, takes the row, and forgets again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dataflow.model._fold import RunState, WholeFoldNeeded
from dataflow.recorder._ledger import Ledger, WriteTransaction

log = logging.getLogger("dataflow.view")

#: A row of the ``events`` table as ``Ledger.rows`` returns it.
Row = Sequence[Any]


def newest_state(ledger: Ledger, run_id: str, *, upto_seq: int | None = None) -> RunState:
    """The run's newest valid snapshot at or before ``upto_seq``; an empty fold when none."""
    restored = ledger.load_snapshot(run_id, upto_seq=upto_seq)
    return restored if restored is not None else RunState(run_id, ref_source=ledger)


class RunView:
    """A run's fold, brought up to date from the ledger on demand.

    ``snapshots=False`` never reads a snapshot (what a snapshot is checked
    against); ``upto_seq`` stops the fold at that seq. ``on_rows`` is called
    with each chunk of rows before it is folded, and ``after_rows`` once it
    is folded, for readers that keep counts of their own alongside the fold
    (the backlog, the status fold).
    """

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        *,
        upto_seq: int | None = None,
        snapshots: bool = True,
        on_rows: Callable[[list[Row]], object] | None = None,
        after_rows: Callable[[list[Row]], object] | None = None,
    ) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.upto_seq = upto_seq
        self.snapshots = snapshots
        self.on_rows = on_rows
        self.after_rows = after_rows
        self.state = RunState(run_id, ref_source=ledger)
        #: The seq of the snapshot the fold started from (0: the start of the log);
        #: -1 until the first catch-up.
        self.snapshot_seq = -1
        #: Set by a writer whose transaction folded its own events and then did not
        #: commit (or whose COMMIT failed): the fold may hold events the ledger does
        #: not, so the next catch-up refolds.
        self.stale = False
        #: Whether the fold forgets finished samples (see the module's docstring).
        self.forget = False
        #: The rank whose refs a forgetting fold keeps in memory (``forget_finished``).
        self.rank: int | None = None

    @property
    def started(self) -> bool:
        return self.snapshot_seq >= 0

    def catch_up(self) -> RunState:
        """Fold what came since the last catch-up (the first starts from the newest snapshot;
        a stale view is refolded)."""
        if self.stale:
            return self.refold()
        if not self.started:
            if self.state.head_seq == 0 and self.snapshots:
                # Started only once read: a snapshot that cannot be read is tried again.
                self.state = newest_state(self.ledger, self.run_id, upto_seq=self.upto_seq)
                self.snapshot_seq = self.state.head_seq
            else:
                self.snapshot_seq = 0
        try:
            self.apply(self._tail(self.state))
        except WholeFoldNeeded:
            return self.refold()
        return self._forgetting()

    def refold(self) -> RunState:
        """Fold the run anew (its newest snapshot, then the log); swapped in once whole."""
        self._refold()
        return self._forgetting()

    def _refold(self) -> RunState:
        """:meth:`refold`, with the new fold not forgetting yet."""
        if self.snapshots:
            state = newest_state(self.ledger, self.run_id, upto_seq=self.upto_seq)
        else:
            state = RunState(self.run_id, ref_source=self.ledger)
        snapshot_seq = state.head_seq
        self._fold(state, self._tail(state))
        self.state, self.snapshot_seq = state, snapshot_seq
        self.stale = False
        return state

    def _forgetting(self) -> RunState:
        """The fold, made to forget finished samples if the view does."""
        if self.forget and not self.state.forgetting:
            self.state.forget_finished(rank=self.rank)
        return self.state

    def catch_up_in(self, tx: WriteTransaction) -> RunState:
        """Fold the rows ``tx`` reads after the fold's head: what a write is checked against,
        and (called again after the write appends) the writer's own events.

        A view that has not caught up yet (or is stale) first does so through
        ``ledger.rows``, which pages through the log outside the transaction, so
        that the transaction, which holds what it reads in memory, reads only the
        tail. For a view without ``upto_seq``.
        """
        if self.stale or not self.started:
            self.catch_up()
        try:
            self.apply(tx.rows_after(self.state.head_seq))
        except WholeFoldNeeded:
            # The committed log, whole, outside the transaction; then what the transaction
            # reads after it (its own writes included) before the new fold forgets.
            self.apply(tx.rows_after(self._refold().head_seq))
        return self._forgetting()

    def whole_in(self, tx: WriteTransaction) -> RunState:
        """The fold, whole, for a write checked against samples a forgetting fold may have
        forgotten (an exclusion): the run folded anew, then what ``tx`` reads after it.
        It forgets again after the write's own events (the next :meth:`catch_up_in`)."""
        if self.state.forgetting:
            self.apply(tx.rows_after(self._refold().head_seq))
        return self.state

    def apply(self, rows: Iterable[Row]) -> RunState:
        """Fold ``rows`` (the events after the fold's head, in seq order) into the view."""
        return self._fold(self.state, rows)

    def tail(self) -> Iterable[Row]:
        """The rows after the fold's head (up to ``upto_seq``), read lazily.

        For a reader that folds them in steps of its own through :meth:`apply`
        (the status fold marks each resume and samples its timeline between rows);
        ``on_rows`` sees only what :meth:`catch_up` and :meth:`refold` fold.
        """
        return self._tail(self.state)

    def save_snapshot(self, every: int | None) -> bool:
        """Snapshot the fold when ``every`` events or more came since the last one.

        A snapshot is a cache: one that cannot be written costs a longer replay
        later and nothing else, so a failure is logged, not raised.
        """
        if every is None or self.state.head_seq - max(self.snapshot_seq, 0) < every:
            return False
        if self.state.forgetting:
            return False  # a snapshot must hold the whole state, which this fold does not
        try:
            saved = self.ledger.save_snapshot(self.run_id, self.state)
        except Exception as exc:
            log.warning("could not snapshot run %r: %s", self.run_id, exc)
            return False
        self.snapshot_seq = self.state.head_seq
        return saved

    def _tail(self, state: RunState) -> Iterable[Row]:
        return self.ledger.rows(self.run_id, after_seq=state.head_seq, upto_seq=self.upto_seq)

    def _fold(self, state: RunState, rows: Iterable[Row]) -> RunState:
        if self.on_rows is None and self.after_rows is None:
            return state.apply_rows(rows)
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, _CHUNK)):
            if self.on_rows is not None:
                self.on_rows(chunk)
            state.apply_rows(chunk)
            if self.after_rows is not None:
                self.after_rows(chunk)
        return state


_CHUNK = 4096
