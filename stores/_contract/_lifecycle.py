"""Lifecycle: a closed store refuses everything; a ref reopens its store by URI."""

from __future__ import annotations

import time

import pytest
import torch

from dataflow import (
    StoreClosedError,
)
from dataflow.interfaces import FeatureStore, StoredObject
from dataflow.model import SampleRef
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    assert_same_tensors,
    fresh_id,
    sample_tensor,
)
from stores._registry import open_store


class ClosedStoreSuite(StoreSuite):
    """After ``close`` every call raises StoreClosedError."""

    def test_closed_store_refuses_everything(self, store: FeatureStore) -> None:
        ref = store.put(fresh_id(), {"x": torch.ones(1)})
        listed = StoredObject(ref.sample_id, ref.generation, ref.nbytes, time.time())
        scanning = store.scan()
        store.close()
        store.close()
        for call in (
            lambda: store.put(fresh_id(), {"x": torch.ones(1)}),
            lambda: store.put_many([(fresh_id(), {"x": torch.ones(1)})]),
            lambda: store.get(ref),
            lambda: store.get_into(ref, {"x": torch.zeros(1)}),
            lambda: store.delete(ref),
            lambda: store.exists(ref),
            store.stats,
            store.scan,
            lambda: store.delete_stored(listed),
            lambda: next(scanning),  # a scan begun before the close
        ):
            with pytest.raises(StoreClosedError):
                call()


class ReopenSuite(StoreSuite):
    """``open_store(ref.store)`` reaches the store that made the ref."""

    def test_refs_reopen_their_store_by_uri(self, store: FeatureStore) -> None:
        tensors = {"x": sample_tensor((5, 2), torch.float16, seed=4)}
        ref = SampleRef.from_json(store.put(fresh_id(), tensors).to_json())
        reopened = open_store(ref.store)
        try:
            assert reopened.uri == store.uri
            assert_same_tensors(reopened.get(ref), tensors)
        finally:
            if reopened is not store:
                reopened.close()
