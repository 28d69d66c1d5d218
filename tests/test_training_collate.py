"""training.PadCollate: padding variable-length features with masks, on its own and in a
FeatureLoader that reads each sample straight into its padded row (a real SQLite ledger
and a real shared-directory store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow import Consumer, FeatureSpec, InvalidArgumentError, Ledger, Producer, replay
from stores import SharedDirFeatureStore
from training import FeatureLoader, LoaderConfig, PadCollate

RUN = "run"
DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.uint8)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 100).to(dtype)


@st.composite
def batches(draw):
    """Samples with a padded ``ids`` [L] and ``h`` [L, W] of one length each, and a fixed
    ``y`` [2]; dtypes and lengths drawn (0 included)."""
    width = draw(st.integers(1, 4))
    dtype_ids = draw(st.sampled_from(DTYPES))
    dtype_h = draw(st.sampled_from(DTYPES))
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    samples = [
        {
            "ids": _tensor((n,), dtype_ids, i),
            "h": _tensor((n, width), dtype_h, 100 + i),
            "y": _tensor((2,), torch.float32, 200 + i),
        }
        for i, n in enumerate(lengths)
    ]
    return samples, lengths


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(1, 8), st.sampled_from([0, 7]))
def test_padded_rows_hold_each_sample_then_the_pad_value(drawn, multiple_of, pad_value):
    samples, lengths = drawn
    collate = PadCollate(pad=("ids", "h"), pad_values={"h": pad_value}, multiple_of=multiple_of)
    batch = collate(samples)
    longest = max(lengths) + -max(lengths) % multiple_of
    assert set(batch) == {"ids", "h", "y", "attention_mask", "lengths"}
    assert batch["ids"].shape == (len(samples), longest)
    assert batch["h"].shape == (len(samples), longest, samples[0]["h"].shape[1])
    assert batch["ids"].dtype == samples[0]["ids"].dtype  # dtypes kept
    assert batch["h"].dtype == samples[0]["h"].dtype
    assert batch["lengths"].tolist() == lengths
    assert batch["attention_mask"].dtype == torch.bool
    for i, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        assert batch["attention_mask"][i].tolist() == [True] * n + [False] * (longest - n)
        assert torch.equal(batch["ids"][i, :n], sample["ids"])
        assert torch.equal(batch["h"][i, :n], sample["h"])
        assert torch.equal(batch["y"][i], sample["y"])
        assert (batch["ids"][i, n:] == 0).all()
        assert (batch["h"][i, n:] == torch.tensor(pad_value).to(batch["h"].dtype)).all()


@settings(max_examples=40, deadline=None)
@given(batches())
def test_each_row_is_a_contiguous_view_of_the_batch(drawn):
    """What lets a store read a sample straight into the batch: one copy, no stacking."""
    samples, lengths = drawn
    specs = [{name: FeatureSpec.of(t) for name, t in sample.items()} for sample in samples]
    batch, rows = PadCollate(pad=("ids", "h")).empty(specs)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        for name, view in row.items():
            assert view.is_contiguous()
            assert view.shape == samples[i][name].shape
            assert view.untyped_storage().data_ptr() == batch[name].untyped_storage().data_ptr()
        assert row["h"].data_ptr() == batch["h"][i, :n].data_ptr()


def test_bad_configs_and_batches_raise_naming_the_value():
    with pytest.raises(InvalidArgumentError, match="pad must be a tuple"):
        PadCollate(pad="ids")
    with pytest.raises(InvalidArgumentError, match="not in pad"):
        PadCollate(pad=("ids",), pad_values={"h": 1})
    with pytest.raises(InvalidArgumentError, match="two new names"):
        PadCollate(pad=("ids",), mask="ids")
    with pytest.raises(InvalidArgumentError, match="multiple_of must be >= 1"):
        PadCollate(pad=("ids",), multiple_of=0)
    collate = PadCollate(pad=("ids", "h"))
    with pytest.raises(InvalidArgumentError, match="differ in length"):
        collate([{"ids": torch.zeros(3), "h": torch.zeros(4, 2)}])
    with pytest.raises(InvalidArgumentError, match="trailing dimensions"):
        collate(
            [
                {"ids": torch.zeros(3), "h": torch.zeros(3, 2)},
                {"ids": torch.zeros(3), "h": torch.zeros(3, 5)},
            ]
        )
    with pytest.raises(InvalidArgumentError, match="add 'y' to pad"):
        PadCollate(pad=("ids",))(
            [
                {"ids": torch.zeros(2), "y": torch.zeros(2)},
                {"ids": torch.zeros(2), "y": torch.zeros(3)},
            ]
        )
    with pytest.raises(InvalidArgumentError, match="do not have"):
        collate([{"ids": torch.zeros(3)}])
    with pytest.raises(InvalidArgumentError, match="no samples"):
        collate([])
    with pytest.raises(InvalidArgumentError, match="which PadCollate adds"):
        collate([{"ids": torch.zeros(3), "h": torch.zeros(3, 1), "lengths": torch.zeros(1)}])


class RecordingStore(SharedDirFeatureStore):
    """A shared-directory store that remembers the tensors it was asked to read into."""

    outs: list[dict[str, torch.Tensor]]

    def get_many_into(self, items):
        items = list(items)
        self.outs = getattr(self, "outs", []) + [dict(out) for _, out in items]
        super().get_many_into(items)


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


def _sample(i: int) -> dict[str, torch.Tensor]:
    n = 3 + 5 * i % 7
    return {
        "ids": torch.arange(n) + i,
        "h": torch.full((n, 4), float(i), dtype=torch.bfloat16),
        "w": torch.tensor([float(i)]),
    }


def test_the_loader_reads_each_sample_straight_into_its_padded_row(led, tmp_path):
    store = RecordingStore(str(tmp_path / "features"))
    producer = Producer(led, store, run_id=RUN)
    for i in range(10):
        producer.emit(f"s{i:02d}", _sample(i))
    producer.close()
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    consumer.resume()
    loader = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=4), collate_fn=PadCollate(pad=("ids", "h"))
    )
    seen = 0
    for step, batch in enumerate(loader, start=1):
        features = batch.features
        for row, sample_id in enumerate(batch.sample_ids):
            want = _sample(int(sample_id[1:]))
            n = len(want["ids"])
            assert features["lengths"][row] == n
            assert torch.equal(features["ids"][row, :n], want["ids"])
            assert torch.equal(features["h"][row, :n], want["h"])
            assert not features["attention_mask"][row, n:].any()
            # The store's read went into this row of the batch: the one copy of the sample.
            out = store.outs[seen + row]
            assert out["h"].data_ptr() == features["h"][row, :n].data_ptr()
            assert out["ids"].data_ptr() == features["ids"][row, :n].data_ptr()
            assert out["w"].data_ptr() == features["w"][row].data_ptr()
        seen += len(batch)
        consumer.ack(batch.refs, step=step)
    assert seen == 10
    assert replay(led, RUN).verify() == []


def test_a_lost_sample_leaves_the_others_padded_in_the_batch(led, tmp_path):
    store = SharedDirFeatureStore(str(tmp_path / "features"))
    producer = Producer(led, store, run_id=RUN)
    refs = [producer.emit(f"s{i:02d}", _sample(i)) for i in range(4)]
    producer.close()
    store.delete(refs[1])
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    consumer.resume()
    loader = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=4), collate_fn=PadCollate(pad=("ids", "h"))
    )
    with pytest.warns(UserWarning, match="reported lost"):
        batch = loader.next_batch()
    assert batch.sample_ids == ["s00", "s02", "s03"]
    for row, sample_id in enumerate(batch.sample_ids):
        want = _sample(int(sample_id[1:]))
        n = len(want["ids"])
        assert batch.features["lengths"][row] == n
        assert torch.equal(batch.features["h"][row, :n], want["h"])
        assert batch.features["attention_mask"][row].sum() == n


def test_samples_that_do_not_pad_together_raise_through_the_loader(led, tmp_path):
    store = SharedDirFeatureStore(str(tmp_path / "features"))
    producer = Producer(led, store, run_id=RUN)
    producer.emit("a", {"ids": torch.arange(3), "h": torch.zeros(3, 4)})
    producer.emit("b", {"ids": torch.arange(3), "h": torch.zeros(3, 5)})
    producer.close()
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    consumer.resume()
    loader = FeatureLoader(
        consumer, config=LoaderConfig(batch_size=2), collate_fn=PadCollate(pad=("ids", "h"))
    )
    with pytest.raises(InvalidArgumentError, match="trailing dimensions"):
        loader.next_batch()
