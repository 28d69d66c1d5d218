"""Gets: what a get refuses, and stored bytes or refs that are not what was put."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    StoreError,
)
from dataflow.interfaces import FeatureStore
from dataflow.model import FeatureSpec, SampleRef
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    assert_same_tensor,
    flip,
    fresh_id,
    zero,
)


class GetSuite(StoreSuite):
    """A get returns what was put or raises: never other bytes, nor bytes read as another
    tensor."""

    def test_ref_of_another_store_is_refused(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.ones(1)})
        foreign = SampleRef(ref.sample_id, "mem://somewhere-else", ref.generation, ref.specs)
        with pytest.raises(StoreError):
            store.get(foreign)
        with pytest.raises(InvalidRefError):
            store.get("not a ref")  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "spec",
        [
            FeatureSpec((2, 3), torch.int32),  # another dtype, the same bytes
            FeatureSpec((3, 2), torch.float32),  # another shape
            FeatureSpec((6,), torch.float32),  # the same elements, flat
        ],
    )
    def test_a_ref_whose_specs_are_not_what_was_put_is_corrupt(
        self, store: FeatureStore, spec: FeatureSpec
    ) -> None:
        # A ref made by hand must never reinterpret the stored bytes as another tensor.
        ref = store.put(fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        forged = SampleRef(ref.sample_id, ref.store, ref.generation, {"x": spec}, {})
        reads: list[Callable[[], object]] = [
            lambda: store.get(forged),
            lambda: store.get_into(forged, {"x": torch.zeros(spec.shape, dtype=spec.dtype)}),
            lambda: store.get_many_into(
                [
                    (ref, {"x": torch.zeros(2, 3)}),
                    (forged, {"x": torch.zeros(spec.shape, dtype=spec.dtype)}),
                ]
            ),
        ]
        for read in reads:
            with pytest.raises(CorruptFeatureError, match=ref.sample_id):
                read()
        assert store.get(ref)["x"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]

    @pytest.mark.parametrize("size", [1000, 2 << 20], ids=["small", "large"])
    def test_a_flipped_stored_byte_is_corrupt(self, store: FeatureStore, size: int) -> None:
        tensors = {"a": torch.arange(size, dtype=torch.float32), "b": torch.ones(9)}
        ref = store.put(fresh_id("flip"), tensors)
        self.rewrite_stored_bytes(store, ref, "a", lambda data: flip(data, 4 * (size // 2)))
        for names in (None, ["a"]):
            with pytest.raises(CorruptFeatureError) as corrupt:
                store.get(ref, names=names)
            assert ref.sample_id in str(corrupt.value) and "'a'" in str(corrupt.value)
        assert_same_tensor(store.get(ref, names=["b"])["b"], torch.ones(9))  # b is intact

    def test_get_into_checks_the_bytes_it_reads(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id("into"), {"x": torch.arange(1000, dtype=torch.float32)})
        self.rewrite_stored_bytes(store, ref, "x", lambda data: flip(data, 2000))
        with pytest.raises(CorruptFeatureError, match="'x'"):
            store.get_into(ref, {"x": torch.zeros(1000)})

    def test_zeroed_stored_bytes_are_corrupt(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id("zeroed"), {"x": torch.arange(1, 1001, dtype=torch.int64)})
        self.rewrite_stored_bytes(store, ref, "x", zero)
        with pytest.raises(CorruptFeatureError) as corrupt:
            store.get(ref)
        assert ref.sample_id in str(corrupt.value) and "'x'" in str(corrupt.value)
