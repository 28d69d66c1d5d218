"""MooncakeFeatureStore against a real mooncake_master: the contract, leases, errors.

The master (and the store client that every test shares) start once per
session. Without Mooncake the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from dataflow import (
    CorruptFeatureError,
    FeatureSpec,
    SampleRef,
    StaleRefError,
    StoreDependencyError,
    StoreUnavailableError,
)
from stores import MooncakeFeatureStore, mooncake_master, open_store
from stores.mooncake_master import MooncakeMaster, find_master_binary, free_port, port_open
from stores.testing import FeatureStoreContract, assert_same_tensor

pytestmark = pytest.mark.mooncake


@dataclass
class Cluster:
    master: MooncakeMaster
    anchor: MooncakeFeatureStore  # keeps the process's Mooncake client up between tests

    def store(self, **kwargs) -> MooncakeFeatureStore:
        kwargs.setdefault("namespace", f"t{uuid.uuid4().hex[:12]}")
        return MooncakeFeatureStore(
            self.master.master_address, metadata=self.master.metadata_url, **kwargs
        )


@pytest.fixture(scope="session")
def cluster(mooncake_master):
    anchor = MooncakeFeatureStore(
        mooncake_master.master_address,
        metadata=mooncake_master.metadata_url,
        namespace="anchor",
        segment_size=512 << 20,
    )
    yield Cluster(mooncake_master, anchor)
    anchor.close()


class TestMooncakeFeatureStore(FeatureStoreContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster):
        self.cluster = cluster

    def make_store(self, tmp_path):
        return self.cluster.store()


class TestMooncakeFeatureStoreStagedPuts(TestMooncakeFeatureStore):
    """The RDMA put path (copy into registered memory first), run over TCP."""

    def make_store(self, tmp_path):
        store = self.cluster.store()
        store._stage_puts = True
        return store


def _key_exists(cluster: Cluster, key: str) -> bool:
    return cluster.anchor._client.raw.is_exist(key) == 1


def _data_key(store: MooncakeFeatureStore, ref: SampleRef, name: str) -> str:
    return f"{store.namespace}/{ref.sample_id}/g{ref.generation}/{name}"


def test_uri_names_the_store_and_reopens_it(cluster):
    with cluster.store(namespace="uri-test") as store:
        assert store.uri == cluster.master.store_uri(namespace="uri-test")
        tuned = open_store(store.uri + "&segment_size=64M&buffer_size=16MiB")
        assert tuned.uri == store.uri
        tuned.close()


def test_bad_uris_are_refused():
    for bad in (
        "mooncake://",
        "mooncake://host-without-port?namespace=x",
        "mooncake://h:1?namespace=a/b",
        "mooncake://h:1?colour=red",
        "mooncake://h:1?protocol=carrier-pigeon",
        "mooncake://h:1?segment_size=lots",
    ):
        with pytest.raises(ValueError):
            MooncakeFeatureStore.from_uri(bad)


def test_objects_are_hard_pinned(cluster):
    assert cluster.anchor._client.config.with_hard_pin


def test_delete_right_after_get_does_not_stall(cluster):
    with cluster.store() as store:
        refs = [store.put(f"s{i}", {"x": torch.ones(256)}) for i in range(50)]
        start = time.perf_counter()
        for ref in refs:
            store.get(ref)
            store.delete(ref)
        assert time.perf_counter() - start < 1.0  # a lease wait would take 0.2 s per sample
        keys = [_data_key(store, ref, "x") for ref in refs]
        assert store._client.removals.pending(f"{store.namespace}/")  # leased: queued
        for ref in refs:
            assert not store.exists(ref)
            with pytest.raises(StaleRefError):
                store.get(ref)
        deadline = time.monotonic() + 5
        while store._client.removals.pending(f"{store.namespace}/") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store._client.removals.pending(f"{store.namespace}/")
        assert not any(_key_exists(cluster, key) for key in keys)


def test_close_drains_queued_removals(cluster):
    store = cluster.store()
    ref = store.put("s", {"x": torch.ones(8)})
    store.get(ref)
    store.delete(ref)
    assert store._client.removals.is_pending(_data_key(store, ref, "x"))
    store.close()
    assert not _key_exists(cluster, _data_key(store, ref, "x"))


def test_superseded_generation_is_removed(cluster):
    with cluster.store() as store:
        old = store.put("s", {"x": torch.ones(8)})
        store.put("s", {"x": torch.zeros(8)})
        deadline = time.monotonic() + 5
        while _key_exists(cluster, _data_key(store, old, "x")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _key_exists(cluster, _data_key(store, old, "x"))


def test_empty_tensors_store_no_key(cluster):
    with cluster.store() as store:
        ref = store.put("s", {"e": torch.empty(0, 3), "x": torch.ones(1)})
        assert _key_exists(cluster, _data_key(store, ref, "x"))
        assert not _key_exists(cluster, _data_key(store, ref, "e"))


def test_short_read_is_corrupt(cluster):
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.ones(1000)})
        longer = SampleRef(
            ref.sample_id, ref.store, ref.generation, {"x": FeatureSpec((2000,), torch.float32)}
        )
        with pytest.raises(CorruptFeatureError, match="read 4000 bytes"):
            store.get(longer)
        shorter = SampleRef(
            ref.sample_id, ref.store, ref.generation, {"x": FeatureSpec((500,), torch.float32)}
        )
        with pytest.raises(CorruptFeatureError, match=_data_key(store, ref, "x")):
            store.get(shorter)


def test_get_returns_registered_memory_and_recycles_it(cluster):
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.ones(1 << 18)})
        first = store.get(ref)["x"].data_ptr()
        second = store.get(ref)["x"].data_ptr()  # the first result is garbage by now
        assert first == second


def test_unreachable_master_fails_fast_with_its_address(mooncake_installed):
    address = f"127.0.0.1:{free_port()}"
    start = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match=address):
        MooncakeFeatureStore(address, metadata=f"http://127.0.0.1:{free_port()}/metadata")
    assert time.perf_counter() - start < 5


def test_unreachable_metadata_server_fails_fast(cluster):
    metadata = f"http://127.0.0.1:{free_port()}/metadata"
    with pytest.raises(StoreUnavailableError, match="metadata server"):
        MooncakeFeatureStore(cluster.master.master_address, metadata=metadata)


def test_missing_mooncake_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(StoreDependencyError, match=r"pip install 'dataflow\[mooncake-cpu\]'"):
        MooncakeFeatureStore(f"127.0.0.1:{free_port()}")


def test_master_helper_starts_and_stops_a_master(cluster):
    master = MooncakeMaster(lease_ttl_ms=200)
    with master:
        assert master.running and port_open("127.0.0.1", master.rpc_port)
        assert "-default_kv_lease_ttl=200" in master.command()
    assert not master.running and not port_open("127.0.0.1", master.rpc_port)
    master.stop()  # idempotent


def test_a_master_that_exits_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho cannot bind >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StoreUnavailableError, match=r"(?s)exited with 3.*cannot bind"):
        MooncakeMaster(binary=fake, startup_timeout=10).start()


def test_a_missing_master_binary_gives_the_install_hint(monkeypatch, tmp_path):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mooncake_master.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(mooncake_master.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StoreDependencyError, match=r"pip install 'dataflow\[mooncake-cpu\]'"):
        find_master_binary()


PUT_MANY = """
    import sys, torch
    from stores import MooncakeFeatureStore
    store = MooncakeFeatureStore(sys.argv[1], metadata=sys.argv[2], namespace=sys.argv[3],
                                 segment_size=0)
    for i in range(20):
        ref = store.put("contended", {"x": torch.tensor([int(sys.argv[4]), i])})
        print(ref.to_json(), flush=True)
    store.close()
"""


@pytest.mark.slow
def test_two_processes_put_the_same_id_at_once(cluster):
    # segment_size=0: the writers mount no memory, so what they wrote lives in
    # this process's segment and outlives them.
    namespace = f"t{uuid.uuid4().hex[:12]}"
    args = [cluster.master.master_address, cluster.master.metadata_url, namespace]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PUT_MANY), *args, str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in (1, 2)
    ]
    refs = []
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err[-2000:]
        refs += [SampleRef.from_json(line) for line in out.splitlines()]
    assert len({ref.generation for ref in refs}) == 40
    with cluster.store(namespace=namespace) as store:
        current = [ref for ref in refs if store.exists(ref)]
        assert len(current) == 1
        x = store.get(current[0])["x"]
        assert_same_tensor(x, x.clone())
        assert x[0].item() in (1, 2)
