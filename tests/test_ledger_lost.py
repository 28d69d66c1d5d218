"""Lost features: a sample whose payload vanished is regenerated, never failed or killed.

On both ledger backends (SQLite, PostgreSQL): ``Consumer.lost`` takes the sample out of
the lease without counting an attempt, lists it in ``lost`` and ``regenerate``, and a
regeneration brings it back to the rank that found it lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dataflow import Consumer, Kind, LedgerStateError, Producer, replay
from stores import SharedDirFeatureStore


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
    kinds = [e.kind for e in ledger.events(run_id) if "a" in e.sample_ids]
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
    with pytest.raises(LedgerStateError, match="cannot report lost 'b': it is leased by 'rank1'"):
        ranks[0].lost([ref], reason="gone")
    with pytest.raises(LedgerStateError, match="cannot report lost 'a': it is not leased"):
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


def test_a_sample_lost_after_the_checkpoint_that_trained_it_waits_for_the_next_data_epoch(
    ledger, emit, make_consumer, producer, run_id, tmp_path
):
    emit("a", "b")
    producer.close()
    cons = make_consumer(release_policy="never")
    cons.resume()
    cons.ack(cons.lease(2), step=1)
    cons.checkpoint(1, tmp_path)
    cons.resume(None)  # a branch from scratch, in which "a" is found lost
    a, b = cons.lease(2)
    cons.lost([a], reason="features gone")
    cons.nack([b])
    plan = cons.resume(1)  # back to the lineage that trained both
    state = replay(ledger, run_id)
    assert set(state.trained) == {"a", "b"} and "a" in state.lost
    assert plan.regenerate == () and list(state.regenerate) == []  # not needed this pass
    assert state.verify() == []
    cons.start_data_epoch(seed=0)
    state = replay(ledger, run_id)
    assert list(state.regenerate) == ["a"] and list(state.pending_for(0)) == ["b"]
    assert state.verify() == []


class _RacingStore(SharedDirFeatureStore):
    """A real shared-directory store that runs ``race()`` once, at the start of a put."""

    race: Callable[[], object] | None = None

    def _put(self, *args: Any, **kwargs: Any) -> Any:
        race, self.race = self.race, None
        if race is not None:
            race()  # another producer's whole regenerate, between our check and our put
        return super()._put(*args, **kwargs)


@pytest.mark.parametrize("ours_supersede_theirs", [True, False])
def test_two_producers_regenerating_one_sample_leave_its_features_committed(
    ledger, tmp_path, run_id, ours_supersede_theirs
) -> None:
    store = _RacingStore(tmp_path / "features")
    first = Producer(ledger, store, run_id=run_id, producer_id="p0")
    first.emit("a", _features("a"))
    first.close()
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer")
    cons.resume()
    cons.lost(cons.lease(1), reason="features gone")
    ours, theirs = (Producer(ledger, store, run_id=run_id, producer_id=f"r{i}") for i in (1, 2))
    if ours_supersede_theirs:
        # Theirs is committed first, then our put replaces its file: ours must be committed.
        store.race = lambda: theirs.regenerate("a", _features("a"))
        ref = ours.regenerate("a", _features("a"))
        assert ledger.commits(run_id, ["a"])["a"][0] == 2  # ours, after theirs
    else:
        # Theirs is committed and live before we start: ours is refused, nothing put stays.
        ref = theirs.regenerate("a", _features("a"))
        with pytest.raises(LedgerStateError, match="still stored"):
            ours.regenerate("a", _features("a"))
    assert store.exists(ref)  # the committed revision's features are stored
    [leased] = cons.lease(1)
    assert leased == ref and cons.load(leased)["x"].tolist() == list(b"a")
    assert replay(ledger, run_id).verify() == []
