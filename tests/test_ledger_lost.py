"""Lost features: a sample whose payload vanished is regenerated, never failed or killed.

On both ledger backends (SQLite, PostgreSQL): ``Consumer.lost`` takes the sample out of
the lease without counting an attempt, lists it in ``lost`` and ``regenerate``, and a
regeneration brings it back to the rank that found it lost.
"""

from __future__ import annotations

import pytest
import torch

from dataflow import Kind, LedgerStateError, Producer, replay


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


def test_a_lost_sample_is_regenerated_and_never_dies(
    ledger, store, emit, make_consumer, producer, run_id
):
    emit("a", "b")
    producer.close()
    cons = make_consumer(max_attempts=1)  # one failed attempt would kill a sample
    cons.resume()
    a, b = cons.lease(2)
    cons.ack([b], step=1)
    for _ in range(3):  # lost three times: more than max_attempts, and still alive
        cons.lost([a], reason="features gone: the store server restarted")
        state = replay(ledger, run_id)
        assert state.lost == {"a": "features gone: the store server restarted"}
        assert list(state.regenerate) == ["a"]
        assert state.dead == {} and state.attempts.get("a", 0) == 0
        assert state.verify() == []
        assert not store.exists(a)  # what was left of its features is deleted
        regenerated = producer.regenerate("a", _features("a"))
        assert replay(ledger, run_id).lost == {}
        [a] = cons.lease(1)
        assert a == regenerated
    cons.ack([a], step=2)
    state = replay(ledger, run_id)
    assert state.trained == {"a": 2, "b": 1} and state.lost == {} and state.dead == {}
    assert state.verify() == []
    kinds = [e.kind for e in ledger.events(run_id) if e.sample_id == "a"]
    assert kinds.count(Kind.LOST) == 3 and Kind.NACK not in kinds


def test_a_lost_sample_comes_back_to_the_rank_that_found_it(emit, make_consumer, producer):
    emit(*"abcdef")
    producer.close()
    ranks = [make_consumer(f"rank{r}", rank=r, world_size=2) for r in range(2)]
    for rank in ranks:
        rank.resume()
    mine = ranks[1].lease(3)
    assert [r.sample_id for r in mine] == ["b", "d", "f"]
    ranks[1].lost([mine[0]], reason="features corrupt: checksum mismatch")
    producer.regenerate("b", _features("b"))
    for rank in ranks:
        rank.refresh()
    assert list(ranks[0].state.pending_for(0)) == ["a", "c", "e"]
    assert list(ranks[1].state.pending_for(1)) == ["b"]  # not stranded on rank 0


def test_only_the_lessee_reports_lost_and_a_reason_is_required(emit, make_consumer, ledger):
    emit("a", "b")
    ranks = [make_consumer(f"rank{r}", rank=r, world_size=2) for r in range(2)]
    for rank in ranks:
        rank.resume()
    [ref] = ranks[1].lease(1)
    ranks[0].refresh()
    head = ledger.head_seq("run")
    with pytest.raises(LedgerStateError, match="cannot report 'b' lost: it is leased by 'rank1'"):
        ranks[0].lost([ref], reason="gone")
    with pytest.raises(LedgerStateError, match="'a' lost: it is not leased"):
        ranks[1].lost(["a"], reason="gone")
    for bad in ("", "x" * 1001, None):
        with pytest.raises(ValueError, match="reason must be a str of 1 to 1000"):
            ranks[1].lost([ref], reason=bad)  # type: ignore[arg-type]
    assert ledger.head_seq("run") == head  # nothing written


def test_regenerate_refuses_a_sample_whose_features_are_neither_released_nor_lost(
    emit, ledger, store, run_id
):
    emit("a")
    with pytest.raises(LedgerStateError, match="released or lost can be regenerated"):
        Producer(ledger, store, run_id=run_id).regenerate("a", _features("a"))
