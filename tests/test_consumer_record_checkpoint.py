"""Consumer.record_checkpoint (and its deprecated alias checkpoint), and the Consumer's fold
through RunView."""

from __future__ import annotations

import pytest

from dataflow import replay
from dataflow.live import RunView
from tests._paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture


def test_record_checkpoint_records_and_checkpoint_is_its_deprecated_alias(emit, make_consumer):
    emit("a", "b")
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(1), step=1)
    recorded = cons.record_checkpoint(1, ckpt(1))
    assert recorded is not None and recorded.step == 1 and recorded.path == ckpt(1)
    cons.ack(cons.lease(1), step=2)
    with pytest.warns(DeprecationWarning, match=r"record_checkpoint\(\)") as got:
        old = cons.checkpoint(2, ckpt(2), digest="d")
    assert got[0].filename == __file__  # it points at the call
    assert old is not None and (old.step, old.digest) == (2, "d")
    assert cons.state.checkpoints == [recorded, old]


def test_the_consumer_state_is_its_view_of_the_run(ledger, run_id, emit, make_consumer):
    emit("a")
    cons = make_consumer()
    cons.resume()
    other = make_consumer("other")
    emit("b")  # not yet folded by cons
    cons.refresh()
    assert cons.state.snapshot() == replay(ledger, run_id).snapshot()
    assert other.state.head_seq == 0  # a consumer folds only when it reads


def test_a_stale_view_refolds_on_its_next_catch_up(ledger, run_id, emit):
    emit("a")
    view = RunView(ledger, run_id)
    state = view.catch_up()
    assert list(state.committed) == ["a"]
    view.stale = True
    assert view.catch_up() is not state  # folded anew, then swapped in
    assert not view.stale and list(view.state.committed) == ["a"]
