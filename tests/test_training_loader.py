"""FeatureLoader on a real SQLite ledger and LocalFeatureStore."""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import torch

import training._loader
from dataflow import (
    Consumer,
    InvalidRefError,
    Ledger,
    LedgerStateError,
    Producer,
    StoreUnavailableError,
    replay,
)
from stores import LocalFeatureStore
from stores.testing import assert_same_tensor
from tests._writes import record_writes
from training import Batch, FeatureLoader, LoaderConfig, collate

RUN = "run"


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:  # conftest has the store fixture
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


def _emit(led: Ledger, store: LocalFeatureStore, n: int, *, close: bool = True, ragged=False):
    producer = Producer(led, store, run_id=RUN)
    for i in range(n):
        length = 2 + i % 3 if ragged else 3
        producer.emit(
            f"s{i:02d}",
            {"x": torch.full((length,), float(i)), "y": torch.tensor(i), "mask": torch.ones(2)},
        )
    if close:
        producer.close()
    return producer


def _consumer(led: Ledger, store: LocalFeatureStore, name: str = "trainer") -> Consumer:
    consumer = Consumer(led, store, run_id=RUN, consumer_id=name)
    consumer.resume()
    return consumer


def _train_all(loader: FeatureLoader, consumer: Consumer) -> list[Batch]:
    batches = []
    for step, batch in enumerate(loader, start=1):
        batches.append(batch)
        consumer.ack(batch.refs, step=step)
    return batches


@pytest.mark.parametrize("prefetch", [0, 1])
def test_batches_stack_and_cover_every_sample_once(led, store, prefetch: int) -> None:
    _emit(led, store, 10)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=4, prefetch=prefetch))
    batches = _train_all(loader, consumer)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [sid for b in batches for sid in b.sample_ids] == [f"s{i:02d}" for i in range(10)]
    first = batches[0].features
    assert set(first) == {"x", "y", "mask"}
    assert first["x"].shape == (4, 3)
    assert torch.equal(first["y"], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(first["x"][:, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert consumer.finished
    assert replay(led, RUN).verify() == []
    assert len(replay(led, RUN).trained) == 10


def test_ragged_features_become_lists_and_names_restrict(led, store) -> None:
    _emit(led, store, 3, ragged=True)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=3, names=["x", "y"]))
    batch = loader.next_batch()
    assert set(batch.features) == {"x", "y"}
    assert [t.shape[0] for t in batch.features["x"]] == [2, 3, 4]
    assert batch.features["y"].shape == (3,)


def test_a_collate_fn_replaces_the_default(led, store) -> None:
    _emit(led, store, 3, ragged=True)
    consumer = _consumer(led, store)

    def pad(samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence([s["x"] for s in samples], batch_first=True)

    batch = FeatureLoader(consumer, config=LoaderConfig(batch_size=3), collate_fn=pad).next_batch()
    assert batch.features.shape == (3, 4)


def test_collate_refuses_samples_with_different_features() -> None:
    with pytest.raises(ValueError, match="different features"):
        collate([{"x": torch.ones(1)}, {"y": torch.ones(1)}])
    mixed = collate([{"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.int64)}])
    assert isinstance(mixed["x"], list)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_ref_whose_features_are_gone_is_reported_lost_and_skipped(led, store, prefetch) -> None:
    _emit(led, store, 6)
    consumer = _consumer(led, store)
    store.delete(consumer.state.ref("s01"))
    store.delete(consumer.state.ref("s05"))
    told: list[list[str]] = []
    loader = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=3, prefetch=prefetch), on_lost=told.append
    )
    with pytest.warns(UserWarning, match=r"features gone: .*'s0[15]'.* reported lost") as caught:
        first = loader.next_batch()
        consumer.ack(first.refs, step=1)
        second = loader.next_batch()
    assert first.sample_ids == ["s00", "s02"]
    assert second.sample_ids == ["s03", "s04"]
    # The rows of the samples that loaded, stacked in order.
    assert first.features["y"].tolist() == [0, 2] and second.features["y"].tolist() == [3, 4]
    assert torch.equal(first.features["x"], torch.tensor([[0.0] * 3, [2.0] * 3]))
    assert ["'s01'" in str(w.message) for w in caught] == [True, False]
    assert told == [["s01"], ["s05"]]
    events = [e for e in led.events(RUN) if e.kind in ("nack", "lost")]
    assert [(e.kind, e.sample_id) for e in events] == [("lost", "s01"), ("lost", "s05")]
    assert "features gone" in events[0].payload["reason"]
    state = replay(led, RUN)
    assert state.verify() == [] and set(state.lost) == {"s01", "s05"} and state.attempts == {}


def test_the_last_batch_comes_while_earlier_refs_are_still_unacked(led, store) -> None:
    """Gradient accumulation: refs are acked after the last micro-batch, not before."""
    _emit(led, store, 5)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2))
    held = [loader.next_batch() for _ in range(3)]
    assert loader.next_batch() is None  # does not wait for this consumer's own leases
    consumer.ack([ref for batch in held for ref in batch.refs], step=1)
    assert consumer.finished


def test_lease_timeout_stops_an_unfinished_run_with_a_warning(led, store) -> None:
    producer = _emit(led, store, 2, close=False)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=4, lease_timeout=0.1))
    with pytest.warns(UserWarning, match="short batch, 2 of batch_size=4 .* lease_timeout=0.1 "):
        batch = loader.next_batch()  # short: the producer is still open
    assert len(batch) == 2
    with pytest.warns(UserWarning, match="lease_timeout=0.1s .* not finished"):
        assert loader.next_batch() is None
    # Called again after None, the loader picks up what came meanwhile.
    producer.emit("late", {"x": torch.ones(3), "y": torch.tensor(9), "mask": torch.ones(2)})
    assert loader.next_batch().sample_ids == ["late"]


def test_next_batch_needs_a_resumed_consumer(led, store) -> None:
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    with pytest.raises(ValueError, match="has not resumed"):
        FeatureLoader(consumer).next_batch()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"batch_size": 2.0}, "batch_size must be an int"),
        ({"lease_timeout": -1}, "lease_timeout must be a number >= 0 or None, got -1"),
        ({"lease_timeout": "1"}, "lease_timeout must be a number"),
        ({"lease_timeout": float("nan")}, "lease_timeout must be a number >= 0 or None, got nan"),
        ({"names": 5}, "names must be a collection of names, got int 5"),
        ({"names": "x"}, "got the str 'x'"),
        ({"names": []}, "names must hold non-empty strs"),
        ({"names": ["x", ""]}, "names must hold non-empty strs"),
        ({"prefetch": -1}, "prefetch must be >= 0, got -1"),
        ({"prefetch": True}, "prefetch must be an int, got bool"),
        ({"pin_memory": 1}, "pin_memory must be a bool, got 1"),
        ({"unavailable_timeout": -1}, "unavailable_timeout must be a number of seconds >= 0"),
        ({"unavailable_timeout": float("nan")}, "unavailable_timeout must be a number"),
        ({"unavailable_timeout": "60"}, "got '60'"),
        ({"unavailable_timeout": True}, "got True"),
    ],
)
def test_loader_config_rejects_bad_values(config, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoaderConfig(**config)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_pin_memory_without_an_accelerator_warns_once_and_loads_as_usual(
    led, store, monkeypatch, prefetch: int
) -> None:
    monkeypatch.setattr(training._loader, "current_accelerator", lambda: None)
    _emit(led, store, 5)
    consumer = _consumer(led, store)
    config = LoaderConfig(batch_size=2, prefetch=prefetch, pin_memory=True)
    with pytest.warns(UserWarning, match=r"pin_memory=True\), but this machine has no acc"):
        loader = FeatureLoader(consumer, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not per batch
        batches = _train_all(loader, consumer)
    assert [b.sample_ids for b in batches] == [["s00", "s01"], ["s02", "s03"], ["s04"]]
    assert torch.equal(batches[1].features["y"], torch.tensor([2, 3]))
    assert replay(led, RUN).verify() == []


def test_pinning_leaves_tensors_on_a_device_where_they_are() -> None:
    on_device = torch.empty(2, device="meta")  # pin_memory() of a non-CPU tensor raises
    got = training._loader.pinned({"a": [on_device], "b": (on_device, 3), "c": "text"})
    assert got["a"][0] is on_device and got["b"][0] is on_device
    assert type(got["b"]) is tuple and got["b"][1] == 3 and got["c"] == "text"


class _Flaky(LocalFeatureStore):
    """A store whose server cannot serve ``failures`` reads (as while it restarts)."""

    def __init__(self, name: str, failures: int) -> None:
        super().__init__(name)
        self.failures = failures

    def _unavailable(self) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError(f"{self.uri} is restarting")

    def _get(self, ref, names):
        self._unavailable()
        return super()._get(ref, names)

    def _get_into(self, ref, out):
        self._unavailable()
        super()._get_into(ref, out)


class _Counting(LocalFeatureStore):
    """A store that counts its batch reads and its single reads."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.batches: list[int] = []
        self.singles = 0

    def _get_many_into(self, items):
        self.batches.append(len(items))
        super()._get_many_into(items)

    def _get_into(self, ref, out):
        self.singles += 1
        super()._get_into(ref, out)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stacked_batch_is_read_in_one_call_of_the_store(led, tmp_path, prefetch) -> None:
    counting = _Counting(f"counting-{tmp_path.name}")
    _emit(led, counting, 10)
    consumer = _consumer(led, counting)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=4, prefetch=prefetch))
    got = []
    while (batch := loader.next_batch()) is not None:
        got += batch.features["y"].tolist()
        consumer.ack(batch.refs, step=len(got))
    assert got == list(range(10))
    assert counting.batches == [4, 4, 2]  # one store call a batch (Mooncake: one round trip)
    assert counting.singles == 10  # the default _get_many_into reads each item
    loader.close()


@pytest.mark.parametrize("names", [None, ("x", "y")])
def test_ragged_samples_for_a_collate_fn_are_read_in_one_call_of_the_store(
    led, tmp_path, names
) -> None:
    counting = _Counting(f"counting-{tmp_path.name}")
    _emit(led, counting, 7, ragged=True)
    consumer = _consumer(led, counting)
    config = LoaderConfig(batch_size=3, names=names)
    loader = FeatureLoader(consumer, config=config, collate_fn=lambda samples: samples)
    seen = []
    while (batch := loader.next_batch()) is not None:
        for sample_id, sample in zip(batch.sample_ids, batch.features, strict=True):
            i = int(sample_id[1:])
            assert sorted(sample) == sorted(names or ("x", "y", "mask"))
            assert_same_tensor(sample["x"], torch.full((2 + i % 3,), float(i)))
            assert_same_tensor(sample["y"], torch.tensor(i))
            seen.append(sample_id)
        consumer.ack(batch.refs, step=len(seen))
    assert seen == [f"s{i:02d}" for i in range(7)]
    assert counting.batches == [3, 3, 1]  # one store call a batch, ragged or not
    loader.close()


def test_a_collate_fn_loader_names_the_feature_a_sample_lacks(led, tmp_path) -> None:
    store = LocalFeatureStore(f"lacking-{tmp_path.name}")
    _emit(led, store, 2)
    config = LoaderConfig(batch_size=2, names=("x", "nope"))
    loader = FeatureLoader(_consumer(led, store), config=config, collate_fn=lambda s: s)
    with pytest.raises(InvalidRefError, match="'nope'"):
        loader.next_batch()
    loader.close()


@pytest.mark.parametrize("collate_fn", [None, lambda samples: samples], ids=["stacked", "custom"])
def test_a_read_the_store_cannot_serve_now_is_tried_again(
    led, tmp_path, caplog, collate_fn
) -> None:
    flaky = _Flaky(f"flaky-{tmp_path.name}", failures=3)
    _emit(led, flaky, 4)
    consumer = _consumer(led, flaky)
    loader = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=4, unavailable_timeout=60), collate_fn=collate_fn
    )
    with caplog.at_level("WARNING", logger="training"):
        batch = loader.next_batch()
    assert batch.sample_ids == ["s00", "s01", "s02", "s03"] and flaky.failures == 0
    ys = batch.features["y"] if collate_fn is None else [s["y"] for s in batch.features]
    assert [int(y) for y in ys] == [0, 1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if "reading it again" in r.getMessage()]
    assert len(warned) == 1 and "'s00'" in warned[0] and "is restarting" in warned[0]
    consumer.ack(batch.refs, step=1)
    assert replay(led, RUN).verify() == [] and replay(led, RUN).lost == {}


@pytest.mark.parametrize("patience", [0, 0.3])
def test_a_store_that_stays_unavailable_raises_once_the_patience_ran_out(
    led, tmp_path, patience: float
) -> None:
    down = _Flaky(f"down-{tmp_path.name}", failures=10**9)
    _emit(led, down, 2)
    consumer = _consumer(led, down)
    loader = FeatureLoader(consumer, config=LoaderConfig(unavailable_timeout=patience))
    with pytest.raises(StoreUnavailableError, match="is restarting") as raised:
        loader.next_batch()
    notes = getattr(raised.value, "__notes__", [])
    assert notes == ([] if patience == 0 else [
        "the loader read samples 's00', 's01' again for 0.3s (LoaderConfig.unavailable_timeout) "
        "and its store could not serve it"
    ])  # fmt: skip
    assert not any(e.kind in ("lost", "nack") for e in led.events(RUN))  # nothing counted


def test_loader_rejects_bad_arguments(led, store) -> None:
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    with pytest.raises(ValueError, match=r"consumer must be a dataflow\.Consumer"):
        FeatureLoader(store)
    with pytest.raises(ValueError, match="config must be a LoaderConfig"):
        FeatureLoader(consumer, config={"batch_size": 2})
    with pytest.raises(ValueError, match="collate_fn must be callable"):
        FeatureLoader(consumer, collate_fn="stack")


@pytest.mark.parametrize("prefetch", [0, 1])
def test_loader_acks_reach_the_ledger_by_flush_and_count_what_is_left(
    led, store, prefetch: int
) -> None:
    _emit(led, store, 10)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=4, prefetch=prefetch))
    seen = []
    with loader:
        step = 0
        while (batch := loader.next_batch()) is not None:
            left = loader.remaining_batches()
            step += 1
            seen.append((len(batch), left))
            loader.ack(batch.refs, step=step)
        loader.flush()
        assert set(replay(led, RUN).trained) == {f"s{i:02d}" for i in range(10)}
    assert seen == [(4, 2), (4, 1), (2, 0)]  # every count made by a lease ahead is exact
    assert consumer.finished and replay(led, RUN).verify() == []


def test_a_failed_background_ack_is_raised_by_flush_and_writes_nothing(led, store) -> None:
    _emit(led, store, 6)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=1))
    with loader:
        first = loader.next_batch()
        assert first is not None
        loader.ack(first.refs, step=2)
        loader.flush()
        loader.ack(first.refs, step=3)  # acked already: refused in the background thread
        with pytest.raises(LedgerStateError, match=r"cannot ack 's00': it is not leased"):
            loader.flush()
        loader.flush()  # raised once; nothing left to wait for
    state = replay(led, RUN)
    assert {sid: state.trained[sid] for sid in first.sample_ids} == {"s00": 2, "s01": 2}
    assert state.verify() == []


def test_a_failed_background_ack_is_raised_by_the_next_batch(led, store) -> None:
    _emit(led, store, 6)
    consumer = _consumer(led, store)
    with FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=1)) as loader:
        first = loader.next_batch()
        assert first is not None
        loader.ack(first.refs, step=0)  # not a step: refused in the background thread
        with pytest.raises(ValueError, match="step"):
            while loader.next_batch() is not None:
                pass
        loader.flush()  # raised once, by the batch: not again


def test_consumer_remaining_is_none_until_every_producer_closed(led, store) -> None:
    producer = _emit(led, store, 5, close=False)
    consumer = _consumer(led, store)
    assert consumer.remaining() is None
    producer.close()
    assert consumer.remaining() == 5
    consumer.lease(2)
    assert consumer.remaining() == 3


def test_remaining_without_refresh_counts_what_the_last_read_folded(led, store) -> None:
    producer = _emit(led, store, 5, close=False)
    consumer = _consumer(led, store)
    consumer.lease(2)
    producer.close()  # this consumer has not folded it yet
    assert consumer.remaining(refresh=False) is None
    assert consumer.remaining() == 3
    consumer.lease(1)
    assert consumer.remaining(refresh=False) == 2
    with pytest.raises(LedgerStateError, match="resume"):
        Consumer(led, store, run_id=RUN, consumer_id="idle").remaining(refresh=False)


def test_a_consumer_serves_threads_leasing_and_acking_at_once(led, store) -> None:
    import threading

    _emit(led, store, 60)
    consumer = _consumer(led, store)
    leased: list = []
    errors: list[BaseException] = []

    def lease_all() -> None:
        try:
            while refs := consumer.lease(3):
                leased.append(refs)
        except BaseException as exc:  # asserted empty below
            errors.append(exc)

    thread = threading.Thread(target=lease_all)
    thread.start()
    step = 0
    while thread.is_alive() or leased:
        if leased:
            step += 1
            consumer.ack(leased.pop(0), step=step)
    thread.join()
    assert errors == []
    state = replay(led, RUN)
    assert len(state.trained) == 60 and state.verify() == []
    assert consumer.state.snapshot() == state.snapshot()


@pytest.mark.parametrize("prefetch", [2, 3])
def test_a_lease_ahead_of_several_batches_hands_them_out_in_order_with_exact_counts(
    led, store, prefetch: int
) -> None:
    _emit(led, store, 11)
    consumer = _consumer(led, store)
    leases: list[int] = []
    acks: list[list[int]] = []
    lease, ack_many, ack_and_lease = consumer.lease, consumer.ack_many, consumer.ack_and_lease
    consumer.lease = lambda n, **kw: leases.append(n) or lease(n, **kw)  # type: ignore[method-assign]
    consumer.ack_many = lambda a: acks.append([s for _, s in a]) or ack_many(a)  # type: ignore[method-assign]

    def acks_and_lease(a: list, n: int) -> list:
        acks.append([s for _, s in a])
        leases.append(n)
        return ack_and_lease(a, n)

    consumer.ack_and_lease = acks_and_lease  # type: ignore[method-assign]
    seen = []
    with FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=prefetch)) as loader:
        step = 0
        while (batch := loader.next_batch()) is not None:
            step += 1
            seen.append((batch.sample_ids, loader.remaining_batches()))
            loader.ack(batch.refs, step=step)
        loader.flush()
    # The order of a lease per batch, and every count exact.
    assert [ids for ids, _ in seen] == [[f"s{i:02d}", f"s{i + 1:02d}"] for i in range(0, 10, 2)] + [
        ["s10"]
    ]
    assert [left for _, left in seen] == [5, 4, 3, 2, 1, 0]
    # The first batch is leased on the caller's thread, then one lease per `prefetch`
    # batches; the last lease ahead finds nothing, and the caller's last lease neither.
    assert leases[0] == leases[-1] == 2 and set(leases[1:-1]) == {2 * prefetch}
    assert len(leases) == 1 + -(-5 // prefetch) + 2
    # Acks of several steps go in one transaction, in order, each step once.
    assert [s for steps in acks for s in steps] == list(range(1, 7))
    assert len(acks) < 6
    state = replay(led, RUN)
    assert state.trained == {f"s{i:02d}": i // 2 + 1 for i in range(11)}
    assert consumer.finished and state.verify() == []


def test_unwritten_acks_are_written_before_the_loader_waits_for_a_stream(led, store) -> None:
    # A window of one batch: the producer can send the next batch only once the last one
    # is acked, so a loader holding its acks back while it waits would wait forever.
    import threading

    from dataflow.streams import MemoryStream

    stream = MemoryStream(window=2, expected_producers=1)
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer", stream=stream.receiver())
    consumer.resume()
    producer = Producer(led, store, run_id=RUN, producer_id="p", stream=stream.sender("p"))

    def produce() -> None:
        for i in range(8):
            producer.emit(f"s{i:02d}", {"x": torch.tensor(float(i))})
        producer.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while consumer.stream.stats().in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the window is full before the loader starts: the producer waits
    config = LoaderConfig(batch_size=2, prefetch=2, lease_timeout=20)
    with FeatureLoader(consumer, config=config) as loader:
        step = 0
        while (batch := loader.next_batch()) is not None:
            step += 1
            loader.ack(batch.refs, step=step)
        loader.flush()
    thread.join(20)
    state = replay(led, RUN)
    assert sorted(state.trained) == [f"s{i:02d}" for i in range(8)]
    assert state.verify() == []


def test_ack_many_writes_several_steps_in_one_transaction_or_nothing(led, store) -> None:
    _emit(led, store, 6)
    consumer = _consumer(led, store)
    first, second, third = (consumer.lease(2) for _ in range(3))
    head = consumer.state.head_seq
    consumer.ack_many([(first, 1), (second, 1), (third, 3)])
    state = replay(led, RUN)
    assert state.trained == {"s00": 1, "s01": 1, "s02": 1, "s03": 1, "s04": 3, "s05": 3}
    # One ACK row for all the steps (schema 4): each sample's step in its `steps`.
    assert state.head_seq == head + 1 and state.verify() == []
    (row,) = [r for r in led.rows(RUN) if r[0] == head + 1]
    assert row[5] == 3 and json.loads(row[7])["steps"] == [1, 1, 1, 1, 3, 3]
    assert consumer.finished


@pytest.mark.parametrize(
    ("acks", "error", "match"),
    [
        ("s00", TypeError, "ack_many takes a list of \\(refs, step\\) pairs"),
        ([("s00", 1, 2)], TypeError, "ack_many takes \\(refs, step\\) pairs"),
        ([["s00"]], TypeError, "ack_many takes \\(refs, step\\) pairs"),
        ([(["s00"], 2), (["s01"], 1)], LedgerStateError, "got step 1 after step 2"),
        ([(["s00"], 1), (["s00"], 2)], ValueError, "the same sample more than once: \\['s00'\\]"),
        ([(["s00"], 0)], LedgerStateError, "ack step must be >= 1, got 0"),
        ([(["s00"], 1), (["s05"], 2)], LedgerStateError, "cannot ack 's05': it is not leased"),
    ],
)
def test_ack_many_refuses_bad_input_and_writes_nothing(led, store, acks, error, match) -> None:
    _emit(led, store, 6)
    consumer = _consumer(led, store)
    consumer.lease(2)
    head = replay(led, RUN).head_seq
    with pytest.raises(error, match=match):
        consumer.ack_many(acks)
    assert replay(led, RUN).head_seq == head and replay(led, RUN).trained == {}


def test_acks_are_written_in_the_transaction_of_the_next_lease_ahead(led, store) -> None:
    _emit(led, store, 12)
    consumer = _consumer(led, store)
    writes = record_writes(led)
    with FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=2)) as loader:
        step = 0
        while (batch := loader.next_batch()) is not None:
            step += 1
            loader.ack(batch.refs, step=step)
        during = list(writes)
        loader.flush()
    # Batches 1 (leased by the caller) and 2-3 (ahead) before any ack; then every lease
    # ahead carries the acks given since the one before. The last acks wait for flush.
    assert during == ["lease", "lease", "ack+lease", "ack+lease", "ack+lease"]
    assert writes[len(during) :] == ["ack"]
    state = replay(led, RUN)
    assert state.trained == {f"s{i:02d}": i // 2 + 1 for i in range(12)}
    assert consumer.finished and state.verify() == []


def test_closing_while_a_lease_ahead_with_acks_waits_to_start_still_writes_the_acks(
    led, store
) -> None:
    _emit(led, store, 8)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=1))
    first = loader.next_batch()
    assert first is not None and loader._ahead is not None
    loader._ahead.result()  # the lease ahead (no acks yet) is done
    release = threading.Event()
    loader._executor().submit(release.wait, 20)  # the thread is busy: what comes next waits
    loader.ack(first.refs, step=1)
    second = loader.next_batch()  # read ahead; the next lease ahead carries step 1's ack
    assert second is not None and loader._ahead is not None and not loader._ahead.running()
    loader.ack(second.refs, step=2)
    closer = threading.Thread(target=loader.close)
    closer.start()
    deadline = time.monotonic() + 20
    while loader._ahead is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert loader._ahead is None  # close() cancelled the lease ahead before it started
    release.set()
    closer.join(20)
    assert not closer.is_alive()
    state = replay(led, RUN)
    assert state.trained == {
        **dict.fromkeys(first.sample_ids, 1),
        **dict.fromkeys(second.sample_ids, 2),
    }


def test_a_checkpoint_writes_the_acks_a_prefetching_loader_holds(led, store, tmp_path) -> None:
    _emit(led, store, 8)
    consumer = _consumer(led, store)
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=2))
    first = loader.next_batch()
    assert first is not None
    loader.ack(first.refs, step=1)  # held by the loader until its next lease ahead
    checkpoint = consumer.checkpoint(1, tmp_path)  # no loader.flush() first
    assert checkpoint is not None
    assert {s: consumer.state.trained.get(s) for s in first.sample_ids} == dict.fromkeys(
        first.sample_ids, 1
    )
    trained = list(first.sample_ids)
    for step, batch in enumerate(loader, start=2):  # a late ack of step 1 would be refused
        loader.ack(batch.refs, step=step)
        trained += batch.sample_ids
    loader.flush()
    assert sorted(trained) == [f"s{i:02d}" for i in range(8)]
    plan = Consumer(led, store, run_id=RUN, consumer_id="again").resume(checkpoint)
    assert not set(first.sample_ids) & set(plan.requeued)
    assert replay(led, RUN).verify() == []


def test_before_checkpoint_callbacks_run_first_and_a_failure_records_nothing(
    led, store, tmp_path
) -> None:
    _emit(led, store, 2)
    consumer = _consumer(led, store)
    calls: list[int] = []
    consumer.before_checkpoint(lambda: calls.append(len(replay(led, RUN).checkpoints)))
    consumer.checkpoint(0, tmp_path)
    assert calls == [0]  # before the checkpoint was recorded

    def fail() -> None:
        raise RuntimeError("held acks could not be written")

    consumer.before_checkpoint(fail)
    with pytest.raises(RuntimeError, match="held acks"):
        consumer.checkpoint(1, tmp_path)
    assert [c.step for c in replay(led, RUN).checkpoints] == [0]
    with pytest.raises(TypeError, match="callable"):
        consumer.before_checkpoint("flush")  # type: ignore[arg-type]


def test_before_checkpoint_holds_a_bound_method_weakly(led, store, tmp_path) -> None:
    import gc

    _emit(led, store, 2)
    consumer = _consumer(led, store)

    class Holder:
        calls = 0

        def flush(self) -> None:
            Holder.calls += 1

    holder = Holder()
    consumer.before_checkpoint(holder.flush)
    consumer.checkpoint(0, tmp_path)
    assert Holder.calls == 1
    del holder
    gc.collect()
    consumer.checkpoint(1, tmp_path)
    assert Holder.calls == 1
