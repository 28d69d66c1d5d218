"""Puts: round trips of every dtype and shape, and what a put refuses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from dataflow import (
    InvalidRefError,
    InvalidSampleIdError,
    StaleRefError,
    TensorInRefError,
)
from dataflow.interfaces import FeatureStore
from dataflow.model import FeatureSpec, SampleRef, dtype_name
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    DTYPES,
    INVALID_SAMPLE_IDS,
    UNSTORABLE_TENSORS,
    assert_same_tensor,
    assert_same_tensors,
    feature_sets,
    fresh_id,
    sample_tensor,
)


class PutSuite(StoreSuite):
    """A put stores what it was given, as it was given; a bad put stores nothing."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_round_trip_every_dtype(self, store: FeatureStore, dtype: torch.dtype) -> None:
        tensor = sample_tensor((3, 5), dtype, seed=7)
        ref = store.put(fresh_id(), {"x": tensor})
        assert ref.specs == {"x": FeatureSpec((3, 5), dtype)}
        assert_same_tensors(store.get(ref), {"x": tensor})

    def test_zero_dim_and_empty_tensors(self, store: FeatureStore) -> None:
        tensors = {
            "scalar": torch.tensor(2.5),
            "flag": torch.tensor(True),
            "half": torch.tensor(-1.5, dtype=torch.bfloat16),
            "none": torch.empty(0),
            "rows": torch.empty(3, 0, 2, dtype=torch.int64),
            "nobool": torch.empty(0, dtype=torch.bool),
        }
        ref = store.put(fresh_id(), tensors)
        assert ref.specs["scalar"].shape == () and ref.specs["rows"].shape == (3, 0, 2)
        assert_same_tensors(store.get(ref), tensors)

    def test_only_empty_tensors(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"none": torch.empty(0, 4)})
        assert store.exists(ref)
        assert_same_tensors(store.get(ref), {"none": torch.empty(0, 4)})
        empty = store.put(fresh_id(), {})
        assert store.get(empty) == {} and store.exists(empty)
        store.delete(ref)
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)

    def test_non_contiguous_inputs(self, store: FeatureStore) -> None:
        base = sample_tensor((6, 8), torch.float32, seed=1)
        tensors = {
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "column": base[:, 3],
            "expanded": torch.arange(4.0).expand(3, 4),
            "permuted": sample_tensor((2, 3, 4), torch.int16, seed=2).permute(2, 0, 1),
            "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "conj": torch.randn(3, 2, dtype=torch.complex64).conj(),
            "negative": torch.randn(4, dtype=torch.complex64).conj().imag,
            "bool_view": torch.tensor([[True, False], [False, True]]).t(),
        }
        ref = store.put(fresh_id(), tensors)
        assert_same_tensors(store.get(ref), tensors)

    def test_larger_sample(self, store: FeatureStore) -> None:
        tensors = {
            "big": sample_tensor((1024, 1024), torch.float32, seed=3),
            "small": torch.arange(5),
        }
        ref = store.put(fresh_id(), tensors)
        assert ref.nbytes == 4 * 1024 * 1024 + 40
        assert_same_tensors(store.get(ref), tensors)

    def test_put_keeps_its_own_copy(self, store: FeatureStore) -> None:
        tensor = torch.arange(10.0)
        ref = store.put(fresh_id(), {"x": tensor})
        tensor.fill_(-1.0)
        assert_same_tensor(store.get(ref)["x"], torch.arange(10.0))

    def test_ref_is_tensor_free_and_reads_after_json(self, store: FeatureStore) -> None:
        metadata = {"label": 3, "split": "train", "weights": [0.5, 1.5], "extra": {"k": None}}
        tensors = {"x": sample_tensor((2, 3), torch.bfloat16), "y": torch.tensor([1, 2])}
        ref = store.put(fresh_id(), tensors, metadata=metadata)
        assert ref.store == store.uri
        assert dict(ref.metadata) == metadata
        again = SampleRef.from_json(ref.to_json())
        assert again == ref
        assert_same_tensors(store.get(again), tensors)

    @pytest.mark.parametrize("bad", INVALID_SAMPLE_IDS, ids=repr)
    def test_invalid_sample_id_is_refused(self, store: FeatureStore, bad: object) -> None:
        before = store.stats()
        with pytest.raises(InvalidSampleIdError):
            store.put(bad, {"x": torch.ones(1)})  # type: ignore[arg-type]
        assert store.stats() == before

    def test_tensors_in_metadata_are_refused(self, store: FeatureStore) -> None:
        before = store.stats()
        for metadata in (
            {"t": torch.ones(1)},
            {"n": [np.zeros(2)]},
            {"deep": {"t": torch.ones(1)}},
        ):
            with pytest.raises(TensorInRefError):
                store.put(fresh_id(), {"x": torch.ones(1)}, metadata=metadata)
        assert store.stats() == before

    @pytest.mark.parametrize("case", sorted(UNSTORABLE_TENSORS))
    @pytest.mark.filterwarnings("ignore::UserWarning")  # prototype, beta, deprecated: all of them
    def test_unstorable_tensors_are_refused(self, store: FeatureStore, case: str) -> None:
        make, named = UNSTORABLE_TENSORS[case]
        before, sample_id = store.stats(), fresh_id()
        with pytest.raises(InvalidRefError, match=r"tensors\['bad'\]") as refused:
            store.put(sample_id, {"good": torch.ones(2), "bad": make()})
        assert re.search(rf"\b{re.escape(named)}\b", str(refused.value)), refused.value
        assert store.stats() == before
        never = SampleRef(sample_id, store.uri, 1, {"good": FeatureSpec((2,), torch.float32)})
        assert not store.exists(never)

    # One store serves every example (it is reusable by contract), and every
    # subclass runs this same method: both health checks are about neither.
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
    )
    @given(features=feature_sets)
    def test_round_trip_property(self, store: FeatureStore, features: dict) -> None:
        tensors = {}
        for name, (dtype, shape, transpose, seed) in features.items():
            tensor = sample_tensor(shape, dtype, seed)
            tensors[name] = tensor.t() if transpose and tensor.dim() == 2 else tensor
        ref = store.put(fresh_id("p"), tensors)
        assert {n: (s.shape, s.dtype) for n, s in ref.specs.items()} == {
            n: (tuple(t.shape), t.dtype) for n, t in tensors.items()
        }
        assert_same_tensors(store.get(ref), tensors)
        store.delete(ref)
