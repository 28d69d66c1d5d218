"""Batches: put_many as puts in order, checked whole before anything is stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataflow import (
    DataflowError,
    InvalidRefError,
    StaleRefError,
)
from dataflow.interfaces import FeatureStore
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    assert_same_tensors,
    fresh_id,
    sample_tensor,
)


class PutManySuite(StoreSuite):
    """``put_many`` is ``put`` of each sample in order, all checked first."""

    def test_put_many_is_put_in_order(self, store: FeatureStore) -> None:
        a, b = fresh_id("many"), fresh_id("many")
        samples = [
            (a, {"x": sample_tensor((3, 4), torch.bfloat16, seed=1), "e": torch.empty(0)}),
            (b, {"y": torch.arange(5)}, {"split": "val"}),
            (a, {"x": torch.ones(2)}),  # a repeated id: the later item supersedes
        ]
        refs = store.put_many(samples)
        assert [ref.sample_id for ref in refs] == [a, b, a]
        assert refs[2].generation > refs[0].generation
        assert dict(refs[1].metadata) == {"split": "val"} and dict(refs[0].metadata) == {}
        with pytest.raises(StaleRefError):
            store.get(refs[0])
        assert_same_tensors(store.get(refs[1]), samples[1][1])
        assert_same_tensors(store.get(refs[2]), samples[2][1])
        assert store.put_many([]) == []
        assert store.put_many(iter([(fresh_id(), {})]))[0].specs == {}

    @pytest.mark.parametrize(
        "bad",
        [
            ("not a valid id", {"x": torch.ones(1)}),
            ("ok-id", {"x": np.ones(1)}),
            ("ok-id", {"x": torch.ones(1)}, {"t": torch.ones(1)}),
            ("ok-id",),
            ["ok-id", {"x": torch.ones(1)}],
        ],
        ids=["invalid-id", "numpy", "tensor-in-metadata", "one-field", "a-list"],
    )
    def test_put_many_checks_every_sample_before_storing_any(
        self, store: FeatureStore, bad: object
    ) -> None:
        before = store.stats()
        good = fresh_id("first")
        with pytest.raises((ValueError, TypeError)):
            store.put_many([(good, {"x": torch.ones(3)}), bad])  # type: ignore[list-item]
        assert store.stats() == before
        assert [o for o in store.scan() if o.sample_id == good] == []
        with pytest.raises(InvalidRefError):
            store.put_many("abc")  # type: ignore[arg-type]

    def test_a_put_many_that_fails_midway_keeps_none_of_its_generations(
        self, store: FeatureStore
    ) -> None:
        ids = [fresh_id("broken") for _ in range(5)]
        samples = [
            (sid, {"x": sample_tensor((4,), torch.float32, seed=seed)})
            for seed, sid in enumerate(ids)
        ]
        before = store.stats()
        with self.failing_puts(store, after=3), pytest.raises((OSError, DataflowError)):
            store.put_many(samples)
        assert self._listed(store, set(ids)) == {}
        assert store.stats() == before
        refs = store.put_many(samples)  # the store works on
        assert_same_tensors(store.get(refs[4]), samples[4][1])
