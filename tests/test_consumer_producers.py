"""Consumer(producers=[...]): a run waits for the producers it names, even before they commit.

Without it a run knows only the producers that committed: one that starts late (a
model still loading) is unknown to the ledger, and if every producer that did commit
has closed by then, the ranks drain and end without its samples. Real SQLite files
and a real PostgreSQL server (the ``ledger`` fixture); the late producer of the
process test is a real process.
"""

from __future__ import annotations

import tempfile
import threading
import warnings
from pathlib import Path

import pytest
import torch
from _gloo import forkserver_context
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import (
    ArgumentTypeError,
    Consumer,
    InvalidIdError,
    Ledger,
    Producer,
    replay,
    seeded_order,
)
from dataflow.live import _consumer
from dataflow.streams import MemoryStream
from stores import LocalFeatureStore, SharedDirFeatureStore
from training import CheckpointConfig, CheckpointManager, FeatureLoader, LoaderConfig, Trainer

WAIT = 60.0  # only ever waited out when something is broken


def features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((2,), float(i))}


def produce(ledger, store, run_id: str, producer_id: str, ids: list[str]) -> None:
    prod = Producer(ledger, store, run_id=run_id, producer_id=producer_id)
    prod.emit_many([(s, features(i)) for i, s in enumerate(ids)])
    prod.close()


def train_all(consumer: Consumer) -> list[str]:
    """Lease and ack what is ready now; the ids, in lease order."""
    trained, step = [], 0
    while refs := consumer.lease(4):
        step += 1
        consumer.ack(refs, step=step)
        trained += [r.sample_id for r in refs]
    return trained


def test_without_producers_a_late_producer_is_missed(ledger, store, run_id) -> None:
    # What the option is for: "b" starts after "a" closed, and the rank is already drained.
    produce(ledger, store, run_id, "a", ["a0", "a1"])
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer")
    cons.resume()
    assert train_all(cons) == ["a0", "a1"]
    assert cons.drained and cons.finished and cons.remaining() == 0


def test_a_rank_waits_for_a_named_producer_that_has_not_committed(ledger, store, run_id) -> None:
    produce(ledger, store, run_id, "a", ["a0", "a1"])
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", producers=["a", "b"])
    assert cons.producers == {"a", "b"}
    cons.resume()
    assert train_all(cons) == ["a0", "a1"]
    assert not cons.drained and not cons.finished and cons.remaining() is None
    assert cons.lease(4, timeout=0.2) == []  # waits for "b", which has not come yet
    produce(ledger, store, run_id, "b", ["b0", "b1", "b2"])
    assert train_all(cons) == ["b0", "b1", "b2"]
    assert cons.drained and cons.finished and cons.remaining() == 0
    state = replay(ledger, run_id)
    assert state.verify() == [] and set(state.trained) == {"a0", "a1", "b0", "b1", "b2"}


def test_a_named_producer_that_committed_and_has_not_closed_is_waited_for(
    ledger, store, run_id
) -> None:
    produce(ledger, store, run_id, "a", ["a0"])
    late = Producer(ledger, store, run_id=run_id, producer_id="b")
    late.emit("b0", features(0))
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", producers=("b",))
    cons.resume()
    assert sorted(train_all(cons)) == ["a0", "b0"]
    assert not cons.drained  # "b" committed but has not closed (as without the option)
    late.close()
    cons.refresh()  # drained reads the fold as of the last call
    assert cons.drained


def test_a_run_waits_for_every_producer_that_committed_named_or_not(ledger, store, run_id) -> None:
    # The names add to the producers the ledger knows; they never take one away.
    produce(ledger, store, run_id, "a", ["a0"])
    unnamed = Producer(ledger, store, run_id=run_id, producer_id="c")
    unnamed.emit("c0", features(0))
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", producers={"a"})
    cons.resume()
    assert sorted(train_all(cons)) == ["a0", "c0"]
    assert not cons.drained
    unnamed.close()
    cons.refresh()
    assert cons.drained


def test_a_named_producer_that_closed_without_committing_counts_as_closed(
    ledger, store, run_id
) -> None:
    produce(ledger, store, run_id, "a", ["a0"])
    Producer(ledger, store, run_id=run_id, producer_id="b").close()  # it had nothing to produce
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="trainer", producers=["a", "b"])
    cons.resume()
    assert train_all(cons) == ["a0"] and cons.drained


def test_every_rank_waits_for_the_named_producers(ledger, store, run_id) -> None:
    produce(ledger, store, run_id, "a", [f"a{i}" for i in range(4)])
    ranks = [
        Consumer(
            ledger,
            store,
            run_id=run_id,
            consumer_id=f"rank{r}",
            rank=r,
            world_size=2,
            producers=["a", "b"],
        )
        for r in range(2)
    ]
    for cons in ranks:
        cons.resume()
    trained = [train_all(cons) for cons in ranks]
    assert all(not cons.drained for cons in ranks)
    produce(ledger, store, run_id, "b", [f"b{i}" for i in range(4)])
    trained = [t + train_all(cons) for t, cons in zip(trained, ranks, strict=True)]
    assert all(cons.drained for cons in ranks)
    assert sorted(trained[0] + trained[1]) == [
        *(f"a{i}" for i in range(4)),
        *(f"b{i}" for i in range(4)),
    ]
    assert replay(ledger, run_id).verify() == []


def test_a_seeded_order_starts_only_once_the_named_producers_closed(ledger, store, run_id) -> None:
    produce(ledger, store, run_id, "a", ["s0", "s1", "s2"])
    cons = Consumer(
        ledger, store, run_id=run_id, consumer_id="trainer", order_seed=7, producers=["a", "b"]
    )
    cons.resume()
    assert cons.lease(4, timeout=0.2) == []  # the dataset is not complete: "b" is to come
    produce(ledger, store, run_id, "b", ["s3", "s4", "s5"])
    trained = train_all(cons)
    everything = list(replay(ledger, run_id).committed)
    assert trained == seeded_order(everything, 7)
    assert cons.drained


def test_a_streaming_rank_also_waits_for_the_named_producers_close(store) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger.open(f"sqlite:///{tmp}/ledger.db")
        stream = MemoryStream(window=8, expected_producers=1)
        streamed = Producer(ledger, store, run_id="r", producer_id="a", stream=stream.sender("a"))
        cons = Consumer(
            ledger,
            store,
            run_id="r",
            consumer_id="t",
            stream=stream.receiver(),
            producers=["a", "b"],
        )
        cons.resume()
        streamed.emit("a0", features(0))
        streamed.close()
        assert train_all(cons) == ["a0"]
        assert cons.stream.exhausted and not cons.drained  # "b" has not closed in the ledger
        produce(ledger, store, "r", "b", ["b0"])  # a ledger-only producer: no stream
        assert train_all(cons) == ["b0"] and cons.drained
        ledger.close()


def _late_producer(url: str, store_dir: str, run_id: str, started: object) -> None:
    started.wait(WAIT)  # type: ignore[attr-defined]
    with Ledger.open(url) as led:
        produce(led, SharedDirFeatureStore(store_dir), run_id, "b", ["b0", "b1", "b2"])


def test_a_lease_that_waits_is_answered_by_a_producer_process_that_starts_late(
    ledger_url, tmp_path
) -> None:
    store_dir = str(tmp_path / "features")
    with Ledger.open(ledger_url) as led:
        store = SharedDirFeatureStore(store_dir)
        produce(led, store, "r", "a", ["a0"])
        cons = Consumer(led, store, run_id="r", consumer_id="t", producers=["a", "b"])
        cons.resume()
        assert train_all(cons) == ["a0"]
        context = forkserver_context(__name__)
        started = context.Event()
        late = context.Process(target=_late_producer, args=(ledger_url, store_dir, "r", started))
        late.start()
        got: list[list[str]] = []
        waiter = threading.Thread(
            target=lambda: got.append([r.sample_id for r in cons.lease(8, timeout=None)])
        )
        try:
            waiter.start()  # waits until "b" commits: without producers= it returned []
            started.set()
            waiter.join(WAIT)
            late.join(WAIT)
        finally:
            if late.is_alive():
                late.kill()
        assert not waiter.is_alive() and late.exitcode == 0
        assert got and sorted(got[0]) == ["b0", "b1", "b2"]
        cons.ack([*cons.state.leased], step=2)
        assert cons.drained and cons.finished
        assert replay(led, "r").verify() == []


def _misspelt(ledger, store, run_id, monkeypatch, *, warn_after: float) -> Consumer:
    """A resumed consumer waiting for "rolout-1" (sic) beside "rollout-0", which committed
    "a0" and closed; the wait warns after ``warn_after`` seconds."""
    monkeypatch.setattr(_consumer, "NO_PRODUCER_WARNING_S", warn_after)
    produce(ledger, store, run_id, "rollout-0", ["a0"])
    cons = Consumer(
        ledger, store, run_id=run_id, consumer_id="t", producers=["rollout-0", "rolout-1"]
    )
    cons.resume()
    return cons


def test_a_long_wait_for_a_named_producer_that_never_showed_up_warns(
    ledger, store, run_id, monkeypatch
) -> None:
    # A misspelt name would keep the ranks waiting for good: after a while, say which.
    cons = _misspelt(ledger, store, run_id, monkeypatch, warn_after=0.2)
    assert train_all(cons) == ["a0"]
    late = threading.Timer(1.0, produce, (ledger, store, run_id, "rolout-1", ["b0"]))
    late.start()
    with pytest.warns(
        UserWarning,
        match=r"for the producers \['rolout-1'\] named in producers=, which never committed "
        r"to or closed this run; .* run's producers: 'rollout-0'",
    ) as got:
        refs = cons.lease(4, timeout=None)
    late.join()
    assert got[0].filename == __file__  # it points at the lease() call
    assert [r.sample_id for r in refs] == ["b0"]


def test_a_wait_for_a_named_producer_that_committed_does_not_warn(
    ledger, store, run_id, monkeypatch
) -> None:
    monkeypatch.setattr(_consumer, "NO_PRODUCER_WARNING_S", 0.1)
    slow = Producer(ledger, store, run_id=run_id, producer_id="b")
    slow.emit("b0", features(0))  # known to the ledger, still open
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="t", producers=["b"])
    cons.resume()
    assert train_all(cons) == ["b0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cons.lease(4, timeout=0.5) == []
    slow.close()


# -- through the training loop ----------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_feature_loader_waits_for_a_named_producer(ledger, store, run_id, prefetch) -> None:
    produce(ledger, store, run_id, "a", ["a0", "a1", "a2"])
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="t", producers=["a", "b"])
    cons.resume()
    late = threading.Timer(0.5, produce, (ledger, store, run_id, "b", ["b0", "b1"]))
    late.start()
    loader = FeatureLoader(cons, config=LoaderConfig(batch_size=2, prefetch=prefetch))
    trained = []
    for step, batch in enumerate(loader, start=1):  # ends once the rank is drained
        trained += [r.sample_id for r in batch.refs]
        loader.ack(batch.refs, step=step)
    loader.close()
    late.join()
    assert sorted(trained) == ["a0", "a1", "a2", "b0", "b1"]
    assert cons.finished


def test_a_trainer_trains_a_named_producer_that_starts_late(tmp_path, ledger, store, run_id):
    produce(ledger, store, run_id, "a", ["a0", "a1"])
    trained: list[str] = []
    trainer = Trainer(
        Consumer(ledger, store, run_id=run_id, consumer_id="t", producers=["a", "b"]),
        step_fn=lambda batch: trained.extend(r.sample_id for r in batch.refs),
        checkpoints=CheckpointManager(CheckpointConfig(root=tmp_path / "ckpt")),
        state_fn=lambda: {"w": torch.zeros(1)},
        loader_config=LoaderConfig(batch_size=2),
    )
    late = threading.Timer(0.5, produce, (ledger, store, run_id, "b", ["b0", "b1"]))
    late.start()
    assert trainer.run() == 2
    late.join()
    assert trained == ["a0", "a1", "b0", "b1"]
    state = replay(ledger, run_id)
    assert state.verify() == [] and set(state.trained) == {"a0", "a1", "b0", "b1"}


def test_a_loader_waiting_for_a_named_producer_that_never_showed_up_warns(
    ledger, store, run_id, monkeypatch
) -> None:
    # The loader leases in short waits: the consumer counts the wait across them.
    cons = _misspelt(ledger, store, run_id, monkeypatch, warn_after=0.5)
    # batch_size=1: a batch of 2 would wait for a second sample (batch_wait_s) instead.
    loader = FeatureLoader(cons, config=LoaderConfig(batch_size=1, lease_timeout=2.0))
    assert [r.sample_id for r in loader.next_batch().refs] == ["a0"]
    with pytest.warns(UserWarning) as got:
        assert loader.next_batch() is None  # lease_timeout: it stops early, and says so too
    said = [str(w.message) for w in got]
    assert any("for the producers ['rolout-1'] named in producers=" in m for m in said), said
    assert any("no refs came within lease_timeout=2.0s" in m for m in said), said
    loader.close()


# -- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["a", b"a", 5, 1.5, object()])
def test_producers_that_are_no_list_of_ids_are_refused(ledger, store, run_id, bad) -> None:
    with pytest.raises(ArgumentTypeError, match="producers takes a list of producer ids"):
        Consumer(ledger, store, run_id=run_id, consumer_id="t", producers=bad)


@pytest.mark.parametrize("bad", ["", " a", "a\n", "x" * 300, None, 3])
def test_a_bad_producer_id_in_producers_is_refused(ledger, store, run_id, bad) -> None:
    with pytest.raises(InvalidIdError, match="a producer id in producers"):
        Consumer(ledger, store, run_id=run_id, consumer_id="t", producers=["a", bad])


def test_no_producers_and_an_empty_list_wait_for_the_committers_only(ledger, store, run_id) -> None:
    produce(ledger, store, run_id, "a", ["a0"])
    for i, producers in enumerate((None, [])):
        cons = Consumer(ledger, store, run_id=run_id, consumer_id=f"t{i}", producers=producers)
        assert cons.producers == frozenset()


# -- the invariant ------------------------------------------------------------------------
_IDS = ("p0", "p1", "p2")
_step = st.tuples(st.sampled_from(("commit", "close")), st.sampled_from(_IDS))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(named=st.sets(st.sampled_from(_IDS)), steps=st.lists(_step, max_size=10))
def test_a_rank_is_drained_exactly_when_the_named_and_claiming_producers_closed(
    named: set[str], steps: list[tuple[str, str]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalFeatureStore() as store:
        ledger = Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}", durability="normal")
        cons = Consumer(ledger, store, run_id="r", consumer_id="t", producers=named)
        cons.resume()
        producers = {p: Producer(ledger, store, run_id="r", producer_id=p) for p in _IDS}
        closed: set[str] = set()
        for n, (what, pid) in enumerate(steps):
            if what == "commit":
                if pid in closed:  # a closed producer started again: its claim reopens it
                    producers[pid] = Producer(ledger, store, run_id="r", producer_id=pid)
                    closed.discard(pid)
                producers[pid].emit(f"{pid}-{n}", features(n))
            else:
                producers[pid].close()
                closed.add(pid)
            train_all(cons)
            # Every producer claimed its id when it started: the run waits for all of them.
            done = set(_IDS) <= closed
            assert cons.drained == done, (named, steps[: n + 1])
        state = replay(ledger, "r")
        assert state.verify() == [] and set(state.trained) == set(state.committed)
        ledger.close()
