"""LocalFeatureStore: the contract, plus what only an in-process store promises."""

from __future__ import annotations

import contextlib
import gc
import itertools
from pathlib import Path

import pytest
import torch

from dataflow import (
    CorruptFeatureError,
    FeatureSpec,
    FeatureStore,
    InvalidRefError,
    SampleRef,
    StoreError,
    StoreFullError,
    StoreStats,
)
from stores import LocalFeatureStore, StoredObject, open_store
from stores.testing import FeatureStoreContract


class TestLocalFeatureStore(FeatureStoreContract):
    # Live tensors in process memory: no bytes at rest to corrupt behind the store's
    # back, so the contract's at-rest checks do not apply (left to themselves they skip).
    test_a_flipped_stored_byte_is_corrupt = None
    test_zeroed_stored_bytes_are_corrupt = None
    test_get_into_checks_the_bytes_it_reads = None

    def make_store(self, tmp_path):
        return LocalFeatureStore()

    @contextlib.contextmanager
    def failing_puts(self, store, after):
        puts, put = itertools.count(), store._put

        def failing_put(*args):
            if next(puts) == after:
                raise StoreFullError("the store is full (failing_puts)")
            return put(*args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store, "_put", failing_put)
            yield


def test_get_returns_the_stored_tensor_without_a_copy():
    with LocalFeatureStore() as store:
        ref = store.put("s", {"x": torch.ones(1 << 20)})
        first, second = store.get(ref)["x"], store.get(ref)["x"]
        assert first.data_ptr() == second.data_ptr()


def test_max_bytes_bounds_resident_bytes():
    with LocalFeatureStore(max_bytes=100) as store:
        ref = store.put("a", {"x": torch.ones(20)})  # 80 bytes
        with pytest.raises(StoreFullError) as info:
            store.put("b", {"x": torch.ones(10)})
        assert isinstance(info.value, MemoryError)
        store.put("a", {"x": torch.ones(25)})  # replacing "a" frees its old 80 bytes
        store.delete(store.put("a", {"x": torch.ones(1)}))
        assert store.stats().bytes == 0
        store.put("b", {"x": torch.ones(25)})
        with pytest.raises(StoreError):
            store.get(ref)


def test_max_bytes_must_be_a_non_negative_int():
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            LocalFeatureStore(max_bytes=bad)


def test_open_store_returns_the_live_store_of_a_name():
    with LocalFeatureStore("local-named") as store:
        assert open_store("mem://local-named") is store
        assert LocalFeatureStore.from_uri("mem://local-named") is store


def test_a_second_live_store_with_the_same_name_is_refused():
    with LocalFeatureStore("local-twice"), pytest.raises(StoreError, match="already live"):
        LocalFeatureStore("local-twice")


def test_a_closed_store_gives_its_name_back():
    first = LocalFeatureStore("local-reused")
    ref = first.put("s", {"x": torch.ones(2)})
    first.close()
    second = open_store("mem://local-reused")
    try:
        assert second is not first
        assert not second.exists(ref)  # generations are unique in the process
        assert second.put("s", {"x": torch.ones(2)}).generation != ref.generation
    finally:
        second.close()


def test_an_unreferenced_store_leaves_the_registry():
    store = LocalFeatureStore("local-dropped")
    del store
    gc.collect()
    fresh = LocalFeatureStore("local-dropped")
    fresh.close()


def test_bad_names_and_uris():
    for bad in ("", "a/b", "a b", 3):
        with pytest.raises(ValueError):
            LocalFeatureStore(bad)
    with pytest.raises(ValueError):
        LocalFeatureStore.from_uri("mem://a/b")


def test_stats_counts_orphans_and_says_so():
    # A producer killed between put and commit leaves its features stored: the
    # store cannot know the ledger, so stats() counts them, and must say so.
    with LocalFeatureStore() as store:
        store.put("never-committed", {"x": torch.ones(4)})
        assert store.stats() == StoreStats(objects=1, bytes=16)
    page = (Path(__file__).resolve().parents[1] / "docs" / "stores.md").read_text()
    for text in (FeatureStore.stats.__doc__, StoreStats.__doc__, page):
        assert text and "orphan" in text and "dataflow gc" in text, text


def test_stored_objects_are_checked():
    assert StoredObject("a/b", 3, 16, 5).created == 5.0
    for bad in (
        ("../x", 1, 0, 0.0),
        ("a", -1, 0, 0.0),
        ("a", 1, True, 0.0),
        ("a", 1, 0, "yesterday"),
    ):
        with pytest.raises(ValueError):
            StoredObject(*bad)


def test_scan_lists_a_snapshot():
    with LocalFeatureStore() as store:
        store.put("a", {"x": torch.ones(1)})
        scan = store.scan()
        store.put("b", {"x": torch.ones(1)})  # after the scan began: not in it
        assert [o.sample_id for o in scan] == ["a"]


def _nested_metadata(levels: int) -> dict:
    """Metadata ``levels`` containers deep, the top dict included: {"a": [[...]]}."""
    inner: list = []
    for _ in range(levels - 2):
        inner = [inner]
    return {"a": inner}


def test_metadata_nesting_is_capped_at_32_levels():
    # Deeper metadata was committed but unreadable (RecursionError when a reader parsed it),
    # and around 990 levels the put itself raised a raw RecursionError.
    with LocalFeatureStore() as store:
        ref = store.put("ok", {"x": torch.zeros(1)}, metadata=_nested_metadata(32))
        assert ref.metadata == _nested_metadata(32)
        for levels in (33, 980, 100_000):
            with pytest.raises(
                InvalidRefError,
                match=r"nested deeper than 32 levels at "
                r"metadata\['a'\](\[0\]){31}; flatten it",
            ):
                store.put(
                    f"deep-{levels}", {"x": torch.zeros(1)}, metadata=_nested_metadata(levels)
                )
        cycle: list = []
        cycle.append(cycle)
        with pytest.raises(InvalidRefError, match="nested deeper than 32 levels"):
            store.put("cycle", {"x": torch.zeros(1)}, metadata={"a": cycle})
        assert [o.sample_id for o in store.scan()] == ["ok"]
        assert store.stats().objects == 1


@pytest.mark.parametrize(
    "specs",
    [
        {"x": FeatureSpec((2, 3), torch.int32)},  # another dtype
        {"x": FeatureSpec((3, 2), torch.float32)},  # another shape
        {"x": FeatureSpec((6,), torch.float32)},  # same numel
    ],
)
def test_a_ref_whose_specs_are_not_what_was_put_is_corrupt(specs) -> None:
    store = LocalFeatureStore()
    ref = store.put("a", {"x": torch.zeros(2, 3)})
    forged = SampleRef(ref.sample_id, ref.store, ref.generation, specs, {})
    with pytest.raises(CorruptFeatureError, match="not what the ref describes"):
        store.get(forged)
    assert store.get(ref)["x"].shape == (2, 3)  # the honest ref still reads
