"""Listing: scan, stats and delete_stored, what a collector (dataflow gc) relies on."""

from __future__ import annotations

import time

import pytest
import torch

from dataflow import (
    InvalidRefError,
    StaleRefError,
)
from dataflow.interfaces import FeatureStore, StoreStats
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    assert_same_tensor,
    fresh_id,
    sample_tensor,
)


class ScanSuite(StoreSuite):
    """``scan`` lists the current generations, ``stats`` counts them, ``delete_stored``
    frees one."""

    def test_stats_counts_live_generations_and_tensor_bytes(self, store: FeatureStore) -> None:
        assert (store.stats().objects, store.stats().bytes) == (0, 0)
        a = store.put(fresh_id(), {"x": torch.ones(4), "y": torch.ones(2, dtype=torch.int64)})
        b = store.put(fresh_id(), {"x": torch.ones(8, dtype=torch.float64)})
        assert (store.stats().objects, store.stats().bytes) == (2, 16 + 16 + 64)
        store.put(a.sample_id, {"x": torch.ones(1)})
        assert (store.stats().objects, store.stats().bytes) == (2, 4 + 64)
        store.delete(b)
        store.delete(a)  # superseded already: no effect
        assert (store.stats().objects, store.stats().bytes) == (1, 4)

    def test_scan_lists_what_was_put(self, store: FeatureStore) -> None:
        before = time.time()
        refs = [
            store.put(fresh_id("scan"), {"x": torch.ones(4), "y": torch.arange(3)}),
            store.put(fresh_id("scan"), {"x": sample_tensor((2, 7), torch.float16, seed=3)}),
            store.put(fresh_id("scan/nested:id"), {"none": torch.empty(0)}),
        ]
        listed = self._listed(store, {ref.sample_id for ref in refs})
        assert set(listed) == {ref.sample_id for ref in refs}
        for ref in refs:
            obj = listed[ref.sample_id]
            assert (obj.generation, obj.nbytes) == (ref.generation, ref.nbytes)
            # Some file systems keep coarse times (a file's mtime may lag by a tick).
            assert before - 2 <= obj.created <= time.time() + 2, (obj.created, before)

    def test_scan_skips_deleted_and_superseded_generations(self, store: FeatureStore) -> None:
        replaced, deleted, kept = fresh_id("re"), fresh_id("del"), fresh_id("keep")
        old = store.put(replaced, {"x": torch.ones(8)})
        store.get(old)  # a read first: some stores must then wait before freeing
        new = store.put(replaced, {"x": torch.ones(2)})
        gone = store.put(deleted, {"x": torch.ones(8)})
        store.get(gone)
        store.delete(gone)
        store.put(kept, {"x": torch.ones(1)})
        listed = self._listed(store, {replaced, deleted, kept})
        assert set(listed) == {replaced, kept}
        assert (listed[replaced].generation, listed[replaced].nbytes) == (new.generation, 8)

    def test_stats_are_what_scan_lists(self, store: FeatureStore) -> None:
        for i in range(5):
            store.put(fresh_id("st"), {"x": torch.ones(i + 1)})
        store.delete(store.put(fresh_id("st"), {"x": torch.ones(3)}))
        listed = list(store.scan())
        assert store.stats() == StoreStats(len(listed), sum(o.nbytes for o in listed))

    def test_delete_stored_frees_the_listed_generation(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id("gc"), {"x": torch.ones(4)})
        other = store.put(fresh_id("gc"), {"x": torch.zeros(4)})
        (obj,) = self._listed(store, {ref.sample_id}).values()
        assert store.delete_stored(obj) is True
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)
        assert store.delete_stored(obj) is False  # gone already
        assert self._listed(store, {ref.sample_id}) == {}
        assert_same_tensor(store.get(other)["x"], torch.zeros(4))
        deleted = store.put(fresh_id("gc"), {"x": torch.ones(1)})
        (listed,) = self._listed(store, {deleted.sample_id}).values()
        store.delete(deleted)
        assert store.delete_stored(listed) is False
        with pytest.raises(InvalidRefError):
            store.delete_stored(ref)  # type: ignore[arg-type]

    def test_delete_stored_never_frees_a_newer_generation(self, store: FeatureStore) -> None:
        sample_id = fresh_id("gc-race")
        old = store.put(sample_id, {"x": torch.ones(4)})
        (listed,) = self._listed(store, {sample_id}).values()
        assert listed.generation == old.generation
        store.get(old)
        new = store.put(sample_id, {"x": torch.full((4,), 7.0)})  # put after the scan
        assert isinstance(store.delete_stored(listed), bool)
        assert store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.full((4,), 7.0))
        (now,) = self._listed(store, {sample_id}).values()
        assert now.generation == new.generation
