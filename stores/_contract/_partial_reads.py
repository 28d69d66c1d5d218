"""Partial reads: some features of a sample, and reads into the caller's memory."""

from __future__ import annotations

import pytest
import torch

from dataflow import (
    InvalidRefError,
    StaleRefError,
    StoreError,
)
from dataflow.interfaces import FeatureStore
from dataflow.model import SampleRef, dtype_name
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    DTYPES,
    assert_same_tensor,
    assert_same_tensors,
    fresh_id,
    sample_tensor,
)


class PartialReadSuite(StoreSuite):
    """``get(names=...)``, ``get_into`` and ``get_many_into``."""

    def test_several_features_and_partial_reads(self, store: FeatureStore) -> None:
        tensors = {
            n: sample_tensor((4, i + 1), DTYPES[i], seed=i)
            for i, n in enumerate(["a", "b", "c", "d", "e"])
        }
        ref = store.put(fresh_id(), tensors)
        assert_same_tensors(
            store.get(ref, names=["d", "b"]), {"b": tensors["b"], "d": tensors["d"]}
        )
        assert store.get(ref, names=[]) == {}
        with pytest.raises(InvalidRefError):
            store.get(ref, names=["zz"])
        with pytest.raises(InvalidRefError):
            store.get(ref, names="a")

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_get_into_reads_into_rows_of_a_batch(
        self, store: FeatureStore, dtype: torch.dtype
    ) -> None:
        tensors = [sample_tensor((3, 5), dtype, seed=seed) for seed in range(3)]
        refs = [
            store.put(fresh_id(), {"x": t, "n": torch.tensor(i)}) for i, t in enumerate(tensors)
        ]
        batch = torch.zeros(3, 3, 5, dtype=dtype)
        for row, ref in zip(batch, reversed(refs), strict=True):
            store.get_into(ref, {"x": row})  # only the features named in out
        for row, tensor in zip(batch, reversed(tensors), strict=True):
            assert_same_tensor(row, tensor)

    def test_get_into_reads_what_get_reads(self, store: FeatureStore) -> None:
        tensors = {
            "scalar": torch.tensor(2.5),
            "none": torch.empty(3, 0),
            "big": sample_tensor((1024, 1100), torch.float32, seed=5),
            "ids": torch.arange(7),
        }
        ref = store.put(fresh_id(), tensors)
        out = {name: torch.full_like(t, 9) for name, t in tensors.items()}
        store.get_into(ref, out)
        assert_same_tensors(out, tensors)
        store.get_into(ref, {})

    def test_get_into_a_tensor_that_does_not_fit_is_refused(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        for bad in (
            torch.zeros(3, 2),
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(3, 2).t(),  # right shape, not contiguous
        ):
            with pytest.raises(InvalidRefError, match="'x'"):
                store.get_into(ref, {"x": bad})
            assert not bad.any()
        with pytest.raises(InvalidRefError, match="'y' is not in ref"):
            store.get_into(ref, {"y": torch.zeros(2, 3)})
        with pytest.raises(InvalidRefError, match=r"must be a torch\.Tensor"):
            store.get_into(ref, {"x": [[0.0] * 3] * 2})  # type: ignore[dict-item]
        with pytest.raises(InvalidRefError, match="out must map"):
            store.get_into(ref, [torch.zeros(2, 3)])  # type: ignore[arg-type]

    def test_get_into_a_lazy_conjugate_view_is_refused(self, store: FeatureStore) -> None:
        # Contiguous, of the right dtype and shape, yet no read can write through it.
        stored = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        ref = store.put(fresh_id(), {"z": stored})
        base = torch.zeros(2, dtype=torch.complex64)
        with pytest.raises(InvalidRefError, match=r"out\['z'\] is a lazily conjugated view"):
            store.get_into(ref, {"z": base.conj()})
        with pytest.raises(InvalidRefError, match="lazily conjugated"):
            store.get_many_into([(ref, {"z": base.conj()})])
        assert not base.any()  # nothing was read into it
        store.get_into(ref, {"z": base})
        assert torch.equal(base, stored)

    def test_get_into_a_stale_ref_raises(self, store: FeatureStore) -> None:
        sample_id = fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        store.put(sample_id, {"x": torch.tensor([3, 4])})
        with pytest.raises(StaleRefError):
            store.get_into(old, {"x": torch.zeros(2, dtype=torch.int64)})
        with pytest.raises(StaleRefError):  # as get(ref, names=[]) does
            store.get_into(old, {})

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_get_many_into_reads_each_item_as_get_into_would(
        self, store: FeatureStore, dtype: torch.dtype
    ) -> None:
        tensors = [sample_tensor((3, 5), dtype, seed=seed) for seed in range(4)]
        refs = [
            store.put(fresh_id(), {"x": t, "n": torch.tensor(i), "none": torch.empty(0)})
            for i, t in enumerate(tensors)
        ]
        batch = torch.zeros(4, 3, 5, dtype=dtype)
        whole = {  # other bits than the sample's, in every feature
            name: sample_tensor(tuple(t.shape), t.dtype, seed=99)
            for name, t in store.get(refs[0]).items()
        }
        items = [(ref, {"x": row}) for ref, row in zip(reversed(refs), batch, strict=True)]
        store.get_many_into([*items, (refs[0], whole), (refs[1], {})])  # refs[0] twice
        for row, tensor in zip(batch, reversed(tensors), strict=True):
            assert_same_tensor(row, tensor)
        assert_same_tensors(whole, store.get(refs[0]))
        store.get_many_into([])
        store.get_many_into(iter([(refs[2], {"n": torch.tensor(0)})]))  # any iterable

    def test_get_many_into_reads_many_large_samples(self, store: FeatureStore) -> None:
        tensors = [sample_tensor((1024, 1100), torch.float32, seed=s) for s in range(3)]
        refs = [store.put(fresh_id(), {"big": t}) for t in tensors]
        outs = [{"big": torch.zeros(1024, 1100)} for _ in refs]
        store.get_many_into(list(zip(refs, outs, strict=True)))
        for out, tensor in zip(outs, tensors, strict=True):
            assert_same_tensor(out["big"], tensor)

    def test_get_many_into_raises_for_a_stale_ref_among_good_ones(
        self, store: FeatureStore
    ) -> None:
        good = store.put(fresh_id(), {"x": torch.tensor([1, 2])})
        sample_id = fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        store.put(sample_id, {"x": torch.tensor([3, 4])})
        gone = store.put(fresh_id(), {"x": torch.tensor([5, 6])})
        store.delete(gone)
        for bad in (old, gone):
            items = [(good, {"x": torch.zeros(2, dtype=torch.int64)})]
            with pytest.raises(StaleRefError, match=bad.sample_id):
                store.get_many_into([*items, (bad, {"x": torch.zeros(2, dtype=torch.int64)})])
        out = torch.zeros(2, dtype=torch.int64)
        store.get_many_into([(good, {"x": out})])  # the store still serves the good one
        assert out.tolist() == [1, 2]

    def test_get_many_into_checks_every_item_before_reading_any(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        first = torch.zeros(2, 3)
        for bad_item, match in (
            ((ref, {"x": torch.zeros(3, 2)}), "'x'"),
            ((ref, {"y": torch.zeros(2, 3)}), "'y' is not in ref"),
            ((ref, [torch.zeros(2, 3)]), "out must map"),
            ((ref,), r"\(ref, out\) pairs"),
            ([ref, {"x": torch.zeros(2, 3)}], r"\(ref, out\) pairs"),
            (("not-a-ref", {"x": torch.zeros(2, 3)}), "expected a SampleRef"),
        ):
            with pytest.raises(InvalidRefError, match=match):
                store.get_many_into([(ref, {"x": first}), bad_item])  # type: ignore[list-item]
            assert not first.any(), f"read before {bad_item!r:.60} was refused"
        for not_items in ({ref.sample_id: {"x": first}}, "ab", ref):
            with pytest.raises(InvalidRefError, match="get_many_into takes"):
                store.get_many_into(not_items)  # type: ignore[arg-type]
        other = SampleRef(ref.sample_id, "mem://elsewhere", ref.generation, ref.specs)
        with pytest.raises(StoreError, match="belongs to store"):
            store.get_many_into([(other, {"x": first})])
