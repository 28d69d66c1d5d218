"""RunView's hooks for readers that keep counts of their own, and a snapshot read that fails."""

from __future__ import annotations

import pytest

from dataflow import replay
from dataflow.live import RunView


def test_on_rows_and_after_rows_see_each_chunk_before_and_after_its_fold(ledger, run_id, emit):
    emit("a", "b")
    emit("c")
    seen = []
    view = RunView(
        ledger,
        run_id,
        on_rows=lambda chunk: seen.append(("before", view.state.head_seq, chunk[-1][0])),
        after_rows=lambda chunk: seen.append(("after", view.state.head_seq, chunk[-1][0])),
    )
    state = view.catch_up()
    last = state.head_seq
    assert seen == [("before", 0, last), ("after", last, last)]
    emit("d")
    view.catch_up()
    assert seen[2:] == [
        ("before", last, view.state.head_seq),
        ("after",) + (view.state.head_seq,) * 2,
    ]


def test_a_snapshot_that_cannot_be_read_is_tried_again(ledger, run_id, emit, monkeypatch):
    emit("a", "b")
    ledger.save_snapshot(run_id, replay(ledger, run_id))
    emit("c")
    read = ledger.load_snapshot
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError("the disk hiccups")
        return read(*args, **kwargs)

    monkeypatch.setattr(ledger, "load_snapshot", flaky)
    view = RunView(ledger, run_id)
    with pytest.raises(OSError, match="hiccups"):
        view.catch_up()
    assert not view.started
    state = view.catch_up()
    assert len(calls) == 2
    assert 0 < view.snapshot_seq < state.head_seq
    assert set(state.committed) == {"a", "b", "c"}
    assert state.committed == replay(ledger, run_id, snapshots=False).committed
