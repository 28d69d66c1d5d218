"""Generations and stale refs: each put a new generation, only the current one readable."""

from __future__ import annotations

import pytest
import torch

from dataflow import (
    StaleRefError,
)
from dataflow.interfaces import FeatureStore
from dataflow.model import SampleRef
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    LOOKALIKE_SAMPLE_IDS,
    assert_same_tensor,
    fresh_id,
)


class GenerationSuite(StoreSuite):
    """Generations grow with each put; a superseded or deleted ref is stale."""

    def test_each_put_gets_a_new_larger_generation(self, store: FeatureStore) -> None:
        sample_id = fresh_id()
        generations = [store.put(sample_id, {"x": torch.tensor(i)}).generation for i in range(5)]
        assert generations == sorted(set(generations))

    def test_superseded_ref_is_stale(self, store: FeatureStore) -> None:
        sample_id = fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        new = store.put(sample_id, {"x": torch.tensor([3, 4, 5])})
        with pytest.raises(StaleRefError):
            store.get(old)
        with pytest.raises(KeyError):  # StaleRefError is a KeyError
            store.get(old, names=["x"])
        assert not store.exists(old) and store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.tensor([3, 4, 5]))

    def test_deleting_an_old_generation_keeps_the_new_one(self, store: FeatureStore) -> None:
        sample_id = fresh_id()
        old = store.put(sample_id, {"x": torch.tensor(1.0)})
        store.get(old)
        new = store.put(sample_id, {"x": torch.tensor(2.0)})
        store.delete(old)
        store.delete(old)
        assert store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.tensor(2.0))

    def test_delete_is_idempotent(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.ones(3)})
        other = store.put(fresh_id(), {"x": torch.zeros(3)})
        store.get(ref)
        store.delete(ref)
        store.delete(ref)
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)
        assert_same_tensor(store.get(other)["x"], torch.zeros(3))

    def test_put_after_delete_gets_a_newer_generation(self, store: FeatureStore) -> None:
        sample_id = fresh_id()
        first = store.put(sample_id, {"x": torch.tensor(1)})
        store.delete(first)
        second = store.put(sample_id, {"x": torch.tensor(2)})
        assert second.generation > first.generation
        with pytest.raises(StaleRefError):
            store.get(first)
        assert_same_tensor(store.get(second)["x"], torch.tensor(2))

    def test_exists(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.ones(2)})
        assert store.exists(ref)
        never = SampleRef(fresh_id(), store.uri, ref.generation, dict(ref.specs))
        assert not store.exists(never)
        with pytest.raises(StaleRefError):
            store.get(never)

    def test_lookalike_ids_stay_apart(self, store: FeatureStore) -> None:
        refs = {
            sample_id: store.put(sample_id, {"x": torch.tensor([i])})
            for i, sample_id in enumerate(LOOKALIKE_SAMPLE_IDS)
        }
        for i, sample_id in enumerate(LOOKALIKE_SAMPLE_IDS):
            assert_same_tensor(store.get(refs[sample_id])["x"], torch.tensor([i]))
