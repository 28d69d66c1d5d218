"""Threads: one store shared by threads that put, get, delete and scan at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from dataflow.interfaces import FeatureStore
from dataflow.model import FeatureSpec, SampleRef
from stores._contract._base import StoreSuite
from stores._contract._cases import (
    DTYPES,
    assert_same_tensor,
    fresh_id,
    recording,
    sample_tensor,
)


class ThreadSuite(StoreSuite):
    """A store is thread-safe: generations stay unique, scans stay consistent."""

    def test_scan_while_threads_put_and_delete(self, store: FeatureStore) -> None:
        ids = [fresh_id("busy") for _ in range(12)]
        done = threading.Event()
        survivors: dict[str, SampleRef] = {}
        lock = threading.Lock()

        def churn(worker: int) -> None:
            mine = ids[worker::4]
            for round_ in range(6):
                for sample_id in mine:
                    ref = store.put(sample_id, {"x": torch.full((64,), float(round_))})
                    if (round_ + worker) % 3 == 0:
                        store.delete(ref)
                        with lock:
                            survivors.pop(sample_id, None)
                    else:
                        with lock:
                            survivors[sample_id] = ref

        scans = 0

        def scan_until_done() -> None:
            nonlocal scans
            while not done.is_set() or scans == 0:
                for obj in store.scan():
                    assert obj.nbytes >= 0 and obj.generation >= 0
                scans += 1

        scanner = threading.Thread(target=scan_until_done)
        errors: list[BaseException] = []
        scanner.run = recording(scanner.run, errors)  # type: ignore[method-assign]
        scanner.start()
        try:
            with ThreadPoolExecutor(max_workers=4) as pool:
                list(pool.map(churn, range(4)))
        finally:
            done.set()
            scanner.join()
        assert not errors, errors
        listed = self._listed(store, set(ids))
        assert {sid: o.generation for sid, o in listed.items()} == {
            sid: ref.generation for sid, ref in survivors.items()
        }

    def test_thread_safety(self, store: FeatureStore) -> None:
        shared = fresh_id("shared")
        shared_puts: dict[int, int] = {}  # generation -> the value put with it
        lock = threading.Lock()

        def work(i: int) -> None:
            own = sample_tensor((16, 16), DTYPES[i % len(DTYPES)], seed=i)
            ref = store.put(fresh_id("t"), {"x": own})
            assert_same_tensor(store.get(ref)["x"], own)
            if i % 2:
                store.delete(ref)
                assert not store.exists(ref)
            shared_ref = store.put(shared, {"i": torch.tensor(i)})
            with lock:
                shared_puts[shared_ref.generation] = i

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(work, range(48)))
        assert len(shared_puts) == 48  # no two puts got the same generation
        refs = [
            SampleRef(shared, store.uri, g, {"i": FeatureSpec((), torch.int64)})
            for g in shared_puts
        ]
        current = [ref for ref in refs if store.exists(ref)]
        assert len(current) == 1
        assert store.get(current[0])["i"].item() == shared_puts[current[0].generation]
        assert store.stats().objects == 24 + 1
