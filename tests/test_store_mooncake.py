"""MooncakeFeatureStore against a real mooncake_master: the contract, leases, errors.

The master (and the store client that every test shares) start once per
session. Without Mooncake the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import xxhash

from dataflow import (
    CorruptFeatureError,
    FeatureSpec,
    SampleRef,
    StaleRefError,
    StoreDependencyError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from stores import MooncakeFeatureStore, _mooncake_client, mooncake_master, open_store
from stores._mooncake_client import _Generations
from stores._mooncake_records import _HEAD_MAGIC, _HEAD_SUM, _decode_record, _encode_record
from stores.mooncake_master import MooncakeMaster, find_master_binary, free_port, port_open
from stores.testing import FeatureStoreContract, assert_same_tensor
from tests import _zygote

pytestmark = pytest.mark.mooncake


@dataclass
class Cluster:
    master: MooncakeMaster
    anchor: MooncakeFeatureStore  # keeps the process's Mooncake client up between tests

    def store(self, **kwargs) -> MooncakeFeatureStore:
        kwargs.setdefault("namespace", f"t{uuid.uuid4().hex[:12]}")
        kwargs.setdefault("admin", self.master.admin_address)
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
        admin=mooncake_master.admin_address,  # the client's: it tells "full" from "restarted"
    )
    yield Cluster(mooncake_master, anchor)
    anchor.close()


class TestMooncakeFeatureStore(FeatureStoreContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster):
        self.cluster = cluster

    def make_store(self, tmp_path):
        return self.cluster.store()

    @contextlib.contextmanager
    def failing_puts(self, store, after):
        """The master stores the objects of ``after`` sample generations of a batch write
        and refuses the next ones (WRITE_FAIL), as a server that breaks in the middle of
        a batch: the real writes before the failure stay for the store to undo."""
        io = store._puts._io
        write, generations = io.write, []

        def failing_write(writes):
            taken, refused = [], []
            for entry in writes:
                kind, sample_id, generation = io.keys.parse(entry[0])
                if kind in ("record", "tensor") and (sample_id, generation) not in generations:
                    generations.append((sample_id, generation))
                late = kind != "head" and generations.index((sample_id, generation)) >= after
                (refused if late else taken).append(entry)
            return write(taken) + [(entry[0], -500) for entry in refused]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(io, "write", failing_write)
            yield

    def rewrite_stored_bytes(self, store, ref, name, change):
        key = _data_key(store, ref, name)
        data = bytearray(self.cluster.anchor._client.raw.get(key))
        change(data)
        _overwrite(self.cluster, key, bytes(data))


class TestMooncakeFeatureStoreStagedPuts(TestMooncakeFeatureStore):
    """The RDMA put path (copy into registered memory first), run over TCP."""

    def make_store(self, tmp_path):
        store = self.cluster.store()
        store._stage_puts = True
        return store


def _key_exists(cluster: Cluster, key: str) -> bool:
    return cluster.anchor._client.raw.is_exist(key) == 1


def _gone(cluster: Cluster, keys: list[str], timeout: float = 5.0) -> bool:
    """Whether every key is removed once the removal queue let go of them (removals wait
    for read leases; a probe is a read, so it waits for the queue before probing)."""
    removals = cluster.anchor._client.removals
    deadline = time.monotonic() + timeout
    while any(removals.is_pending(key) for key in keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_key_exists(cluster, key) for key in keys)


def _data_key(store: MooncakeFeatureStore, ref: SampleRef, name: str) -> str:
    return f"{store.namespace}/{ref.sample_id}/g{ref.generation}/{name}"


def test_uri_names_the_store_and_reopens_it(cluster):
    with cluster.store(namespace="uri-test") as store:
        opened = open_store(cluster.master.store_uri(namespace="uri-test"))
        assert opened.uri == store.uri and "admin" not in store.uri  # identity only
        assert opened.admin == cluster.master.admin_address
        tuned = open_store(store.uri + "&segment_size=64M&buffer_size=16MiB")
        assert tuned.uri == store.uri
        tuned.close()
        opened.close()


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
        refs = [store.put(f"s{i}", {"x": torch.ones(256)}) for i in range(100)]
        start = time.perf_counter()
        for ref in refs:
            store.get(ref)
            store.delete(ref)
        # A delete that waited out the read lease (0.2 s) would take 20 s for these: half
        # of that only catches such a wait, not a loaded machine.
        lease_s = cluster.master.lease_ttl_ms / 1000
        assert time.perf_counter() - start < len(refs) * lease_s / 2
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


def test_close_with_a_drain_timeout_waits_for_queued_removals(cluster):
    store = cluster.store(drain_timeout=5.0)
    ref = store.put("s", {"x": torch.ones(8)})
    store.get(ref)
    store.delete(ref)
    assert store._client.removals.is_pending(_data_key(store, ref, "x"))
    store.close()
    assert not _key_exists(cluster, _data_key(store, ref, "x"))


def test_a_removal_keeps_the_record_until_the_tensors_are_gone(cluster):
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.ones(8), "y": torch.ones(3)})
        store.get(ref)  # a read lease on the tensors, not on the record
        store.delete(ref)
        record = f"{store.namespace}/s/g{ref.generation}/@"
        assert _key_exists(cluster, record)  # the tensors wait for the lease: so does it
        assert store._client.removals.is_pending(record)
        assert _gone(cluster, [record, _data_key(store, ref, "x"), _data_key(store, ref, "y")])


def test_tensors_or_a_head_left_without_a_record_are_listed_and_freed(cluster):
    # What a process that died in a delete of an older dataflow left: it removed the
    # record first, then was killed while the tensors (or the head) waited.
    with cluster.store() as store:
        left = "left.over-1:a/b"  # characters a regex would read as its own
        tensors = store.put(left, {"x": torch.ones(8), "y": torch.ones(3)})
        head = store.put("head", {"x": torch.ones(8)})
        kept = store.put("kept", {"x": torch.ones(8)})
        raw = cluster.anchor._client.raw
        prefix = store.namespace
        assert raw.remove(f"{prefix}/{left}/g{tensors.generation}/@", True) == 0
        assert raw.remove(_head_key(store, left), True) == 0
        for key in (f"{prefix}/head/g{head.generation}/@", _data_key(store, head, "x")):
            assert raw.remove(key, True) == 0
        listed = {o.sample_id: o for o in store.scan()}
        assert {s: (o.generation, o.nbytes) for s, o in listed.items()} == {
            left: (tensors.generation, 0),
            "head": (head.generation, 0),
            "kept": (kept.generation, kept.specs["x"].nbytes),
        }
        assert listed[left].created <= time.time()
        assert store.delete_stored(listed[left]) and store.delete_stored(listed["head"])
        keys = [_data_key(store, tensors, "x"), _data_key(store, tensors, "y")]
        assert _gone(cluster, [*keys, _head_key(store, "head")])
        assert [o.sample_id for o in store.scan()] == ["kept"]
        assert not store.delete_stored(listed[left])  # nothing left of it


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


def test_a_ref_whose_specs_differ_from_the_heads_names_the_feature(cluster):
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.ones(2, 3), "e": torch.empty(0, 4)})
        x, e = FeatureSpec((2, 3), torch.float32), FeatureSpec((0, 4), torch.float32)
        as_int = FeatureSpec((2, 3), torch.int32)
        for specs, match in (
            ({"x": as_int, "e": e}, r"'x' .* is float32 \[2, 3\], the ref says int32 \[2, 3\]"),
            ({"x": FeatureSpec((6,), torch.float32), "e": e}, r"'x' .* the ref says float32 \[6\]"),
            ({"x": x, "e": FeatureSpec((4, 0), torch.float32)}, r"'e' .* is float32 \[0, 4\]"),
            ({"x": x}, r"'e' .* is float32 \[0, 4\], the ref says no such feature"),
        ):  # fmt: skip
            forged = SampleRef(ref.sample_id, ref.store, ref.generation, specs)
            with pytest.raises(CorruptFeatureError, match=match):
                store.get(forged)


def test_a_head_from_before_specs_were_recorded_is_read_unchecked(cluster):
    # Heads written by an older dataflow have no "specs": they read as they always did.
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.arange(4.0)})
        raw, config = cluster.anchor._client.raw, cluster.anchor._client.config
        head_key = store._head_key("s")
        head = _decode_record(raw.get(head_key), "s", head_key)
        assert head.specs == {"x": ["float32", [4]]}
        body = json.dumps(
            {"sample_id": "s", "generation": ref.generation, "created": head.created,
             "nbytes": 16, "xxh3": head.checksums}
        ).encode()  # fmt: skip
        old_head = _HEAD_MAGIC + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body)) + body
        assert raw.upsert(head_key, old_head, config) == 0
        assert _decode_record(raw.get(head_key), "s", head_key).specs is None
        assert store.get(ref)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


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
        # Read straight into the caller's tensor (TCP): nothing past it is written.
        guarded = torch.full((600,), -1.0)
        with pytest.raises(CorruptFeatureError, match=_data_key(store, ref, "x")):
            store.get_many_into([(shorter, {"x": guarded[:500]})])
        assert (guarded[500:] == -1.0).all()
        with pytest.raises(CorruptFeatureError, match="read 4000 bytes"):
            store.get_many_into([(longer, {"x": torch.zeros(2000)})])


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
    # Mooncake's own setup retries an unreachable master for about 90 s; a refused
    # connection answers at once, however loaded the machine.
    assert time.perf_counter() - start < 45


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


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on at ``port``, from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, at = local.split(":")
        if state == "0A" and int(at, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def test_the_master_helper_listens_on_loopback_only(cluster):
    with MooncakeMaster(lease_ttl_ms=200) as master:
        # The RPC and the admin (metrics) servers; Mooncake's HTTP metadata server binds
        # every interface whatever -http_metadata_server_host says (docs/store-mooncake.md).
        for port in (master.rpc_port, master.metrics_port):
            assert _listening_addresses(port) == {"127.0.0.1"}, port


def _documented_master_command() -> list[str]:
    """The ``mooncake_master`` command of docs/store-mooncake.md, as a shell would split it."""
    doc = (Path(__file__).parent.parent / "docs" / "store-mooncake.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", doc, re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip().startswith("mooncake_master "):
                return shlex.split(line)
    raise AssertionError("docs/store-mooncake.md shows no mooncake_master command")


def test_the_documented_master_command_listens_on_the_address_given(mooncake_installed):
    command = _documented_master_command()
    flags = dict(arg.lstrip("-").split("=", 1) for arg in command[1:])
    assert flags["rpc_address"] == flags["metrics_host"] == "127.0.0.1"
    ports = {name: free_port() for name in ("rpc_port", "metrics_port")}
    ports["http_metadata_server_port"] = free_port()
    args = [f"-{name}={ports.get(name, value)}" for name, value in flags.items()]
    with tempfile.TemporaryFile() as log:
        master = subprocess.Popen(
            [str(find_master_binary()), *args], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 30
            while not all(port_open("127.0.0.1", port) for port in ports.values()):
                assert master.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            for name in ("rpc_port", "metrics_port"):  # the RPC and the admin servers
                assert _listening_addresses(ports[name]) == {"127.0.0.1"}, name
            admin = f"http://127.0.0.1:{ports['metrics_port']}/get_all_keys"
            with _mooncake_client._OPENER.open(admin, timeout=5) as response:
                assert response.status == 200  # where scan() and gc list the keys
        finally:
            master.kill()
            master.wait()


def test_a_master_that_exits_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho cannot bind >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StoreUnavailableError, match=r"(?s)exited with 3.*cannot bind"):
        MooncakeMaster(binary=fake, startup_timeout=10).start()


def test_a_master_gets_three_distinct_free_ports_and_keeps_the_ports_it_is_given(monkeypatch):
    # Probed one at a time, the kernel handed out the same free port twice: a master whose
    # rpc and metrics ports were equal exited with 1 (seen under the suite's load). Here
    # the kernel is made to do that every time it can.
    calls = iter([40001, 40001, 40002, 40001, 40003] * 4)
    real_socket = mooncake_master.socket.socket

    class SamePort(real_socket):  # type: ignore[misc, valid-type]
        def getsockname(self):
            return ("127.0.0.1", next(calls))

    monkeypatch.setattr(mooncake_master.socket, "socket", SamePort)
    master = MooncakeMaster()
    assert len({master.rpc_port, master.http_port, master.metrics_port}) == 3
    assert mooncake_master.free_ports("127.0.0.1", 2, taken=(40001,)) == [40002, 40003]
    given = MooncakeMaster(rpc_port=40001, metrics_port=40005)
    assert (given.rpc_port, given.metrics_port) == (40001, 40005)
    assert given.http_port not in (40001, 40005)


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
    # The outcome: every put succeeds with a generation of its own; exactly one
    # is current (the head written last) and reads; every other ref is stale.
    # A put that lost the race to make its head current leaves its objects
    # stored (listed by scan) until its ref is deleted, which frees exactly them.
    # segment_size=0: the writers mount no memory, so what they wrote lives in
    # this process's segment and outlives them.
    namespace = f"t{uuid.uuid4().hex[:12]}"
    args = [cluster.master.master_address, cluster.master.metadata_url, namespace]
    writers = [
        _zygote.Popen(
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
        (winner,) = [ref for ref in refs if store.exists(ref)]
        x = store.get(winner)["x"]
        assert x[0].item() in (1, 2)
        losers = [ref for ref in refs if ref is not winner]
        for ref in losers:
            with pytest.raises(StaleRefError):
                store.get(ref)
        listed = {obj.generation for obj in store.scan()}
        assert winner.generation in listed <= {ref.generation for ref in refs}
        for ref in losers:
            store.delete(ref)
        assert [obj.generation for obj in store.scan()] == [winner.generation]
        assert_same_tensor(store.get(winner)["x"], x)


def test_a_generation_left_behind_is_listed_and_freed_alone(cluster):
    # What a put leaves when its process dies after writing its tensors and
    # record but before its head: stored, unreadable, listed, and freed by
    # delete_stored without touching the current generation.
    with cluster.store() as store:
        current = store.put("s", {"x": torch.ones(8)})
        left = current.generation + 5
        tensor = torch.full((4,), 3.0)
        record = _encode_record(
            "s", left, time.time() - 3600, 16, {"x": None}, {"x": FeatureSpec((4,), torch.float32)}
        )
        raw, config = cluster.anchor._client.raw, cluster.anchor._client.config
        keys = store._keys("s", left, ["x"])
        assert raw.upsert(keys[0], record, config) == 0
        assert raw.upsert(keys[1], tensor.numpy().tobytes(), config) == 0
        listed = {obj.generation: obj for obj in store.scan()}
        assert set(listed) == {current.generation, left}
        assert listed[left].nbytes == 16 and listed[left].created < time.time() - 3000
        stale = SampleRef("s", store.uri, left, {"x": FeatureSpec((4,), torch.float32)})
        with pytest.raises(StaleRefError, match="not current"):
            store.get(stale)
        assert store.delete_stored(listed[left]) is True  # queued: the scan read the record
        assert store.delete_stored(listed[left]) is False
        assert _gone(cluster, keys)
        assert_same_tensor(store.get(current)["x"], torch.ones(8))
        assert [obj.generation for obj in store.scan()] == [current.generation]


class _CountingClient:
    """A Mooncake client that counts the calls the store makes on it."""

    def __init__(self, raw):
        self.raw, self.calls = raw, {}

    def __getattr__(self, name):
        attr = getattr(self.raw, name)
        if not callable(attr) or name in ("register_buffer", "unregister_buffer"):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def test_put_many_takes_one_round_trip_per_phase(cluster, monkeypatch):
    # Not counted: the check, once a second, that the master still holds the claim.
    monkeypatch.setattr(_mooncake_client, "_CLAIM_CHECK_S", 3600.0)
    with cluster.store() as store:
        store.put("warm", {"x": torch.ones(1)})  # claims this client's block of generations
        counting = _CountingClient(store._client.raw)
        monkeypatch.setattr(store._client, "raw", counting)
        batch = [(f"s{i}", {"x": torch.full((1000,), i), "y": torch.ones(2)}) for i in range(8)]
        refs = store.put_many(batch)
        # Read the heads, then write tensors, records and (new samples) heads.
        assert counting.calls == {"batch_get_into": 1, "batch_upsert_from": 1}
        counting.calls.clear()
        again = store.put_many(batch)
        # Replacing: the new heads go in a batch of their own, after the tensors
        # (the superseded generations are removed by the removal queue's client).
        assert counting.calls == {"batch_get_into": 1, "batch_upsert_from": 2}
        counting.calls.clear()
        store.put("single", {"x": torch.ones(3)})
        assert counting.calls == {"batch_get_into": 1, "batch_upsert_from": 1}
        monkeypatch.undo()
        for ref in refs:
            assert not store.exists(ref)
        for ref, (_, tensors) in zip(again, batch, strict=True):
            assert_same_tensor(store.get(ref)["x"], tensors["x"])


def test_a_put_many_that_fails_leaves_the_store_as_it_was(cluster, monkeypatch):
    with cluster.store() as store:
        old = store.put("replaced", {"x": torch.ones(4)})
        failing = _CountingClient(store._client.raw)
        upsert = failing.batch_upsert_from

        def full_on_the_second_batch(keys, *args):
            if failing.calls.get("batch_upsert_from") == 1:  # the heads that replace others
                return [-200] * len(keys)  # NO_AVAILABLE_HANDLE: Mooncake is full
            return upsert(keys, *args)

        failing.batch_upsert_from = full_on_the_second_batch
        monkeypatch.setattr(store._client, "raw", failing)
        with pytest.raises(StoreFullError):
            store.put_many([("new", {"x": torch.ones(2)}), ("replaced", {"x": torch.zeros(4)})])
        monkeypatch.undo()
        assert_same_tensor(store.get(old)["x"], torch.ones(4))  # still current
        assert [(o.sample_id, o.generation) for o in store.scan()] == [("replaced", old.generation)]


def test_a_read_that_outlasts_its_lease_is_read_again(cluster, monkeypatch):
    # Mooncake refuses bytes whose transfer ended after the read lease
    # (LEASE_EXPIRED, e.g. 256 MiB under a 200 ms lease): read again, and say
    # what to change when it keeps happening.
    with cluster.store() as store:
        ref = store.put("s", {"x": torch.arange(100.0)})
        flaky = _CountingClient(store._client.raw)
        read = flaky.batch_get_into
        expired = {"left": 2}

        def expire_twice(keys, ptrs, sizes):
            if expired["left"]:
                expired["left"] -= 1
                return [-707] * len(keys)
            return read(keys, ptrs, sizes)

        flaky.batch_get_into = expire_twice
        monkeypatch.setattr(store._client, "raw", flaky)
        assert_same_tensor(store.get(ref)["x"], torch.arange(100.0))
        expired["left"] = 99
        with pytest.raises(StoreError, match="default_kv_lease_ttl"):
            store.get(ref)


def test_clients_claim_disjoint_blocks_of_generations(cluster):
    # Two clients (here two allocators on one connection) that start at once
    # race for the same block: the master gives it to one, the other takes the next.
    client = cluster.anchor._client
    prefix = f"t{uuid.uuid4().hex[:12]}/@generations/"
    first, second = _Generations(client, prefix), _Generations(client, prefix)
    floor = time.time_ns() + 10**12  # both ask for the same floor: the same block
    a, b = first.take([floor, 0, 0]), second.take([floor, 0, 0])
    assert a == sorted(a) and b == sorted(b) and a[0] >= floor and b[0] >= floor
    assert not set(a) & set(b) and abs(a[0] - b[0]) == 1 << 20
    assert _key_exists(cluster, f"{prefix}{min(a[0], b[0])}")


def test_a_sample_too_large_for_its_record_is_refused_before_anything_is_stored(cluster):
    with cluster.store() as store:
        many = {f"f{i:03d}" + "x" * 120: torch.ones(1) for i in range(200)}
        with pytest.raises(ValueError, match="too many features"):
            store.put_many([("fine", {"x": torch.ones(1)}), ("many", many)])
        assert list(store.scan()) == [] and store.stats().objects == 0


def test_scan_needs_the_masters_http_server(cluster):
    admin = f"127.0.0.1:{free_port()}"
    with cluster.store(admin=admin) as store:
        store.put("s", {"x": torch.ones(1)})
        with pytest.raises(StoreUnavailableError, match=rf"{admin}.*admin=HOST:PORT"):
            list(store.scan())


# -- no silent wrong answers (issue #11) -------------------------------------------
def _head_key(store: MooncakeFeatureStore, sample_id: str) -> str:
    return f"{store.namespace}/{sample_id}/@head"


def _overwrite(cluster: Cluster, key: str, data: bytes) -> None:
    """Replace the bytes of ``key`` behind the store's back (retried past read leases)."""
    raw, config = cluster.anchor._client.raw, cluster.anchor._client.config
    deadline = time.monotonic() + 5
    while (code := raw.upsert(key, data, config)) != 0:
        assert time.monotonic() < deadline, f"upsert of {key} kept failing with {code}"
        time.sleep(0.05)


def test_a_flipped_byte_names_the_key_and_what_to_do(cluster):
    with cluster.store() as store:
        ref = store.put("flip", {"a": torch.arange(1000, dtype=torch.float32)})
        key = _data_key(store, ref, "a")
        data = bytearray(cluster.anchor._client.raw.get(key))
        data[2000] ^= 0x10
        _overwrite(cluster, key, bytes(data))
        message = rf"(?s){key}.*feature 'a' of sample 'flip'.*checksum.*put it again"
        with pytest.raises(CorruptFeatureError, match=message):
            store.get(ref)
        with pytest.raises(CorruptFeatureError, match=message):  # read straight into `out`
            store.get_many_into([(ref, {"a": torch.zeros(1000)})])


def test_a_corrupt_generation_in_the_head_is_corrupt_not_stale(cluster):
    with cluster.store() as store:
        ref = store.put("gen", {"x": torch.ones(10)})
        key = _head_key(store, "gen")
        head = cluster.anchor._client.raw.get(key)
        altered = str(ref.generation + 1).encode()
        _overwrite(cluster, key, head.replace(str(ref.generation).encode(), altered))
        with pytest.raises(CorruptFeatureError, match=rf"(?s){key}.*'gen'.*checksum"):
            store.get(ref)
        assert not store.exists(ref)
        again = store.put("gen", {"x": torch.zeros(10)})  # a corrupt head is replaced
        assert_same_tensor(store.get(again)["x"], torch.zeros(10))


def test_another_samples_head_in_place_is_corrupt(cluster):
    with cluster.store() as store:
        mine = store.put("mine", {"x": torch.ones(10)})
        store.put("theirs", {"x": torch.zeros(10)})
        theirs = cluster.anchor._client.raw.get(_head_key(store, "theirs"))
        _overwrite(cluster, _head_key(store, "mine"), theirs)
        with pytest.raises(CorruptFeatureError, match="names sample 'theirs'"):
            store.get(mine)


def test_a_head_of_the_old_format_is_refused_with_its_version(cluster):
    with cluster.store() as store:
        ref = store.put("v1", {"x": torch.ones(4)})
        old = {"sample_id": "v1", "generation": ref.generation, "names": ["x"]}
        _overwrite(cluster, _head_key(store, "v1"), json.dumps(old).encode())
        with pytest.raises(CorruptFeatureError, match=r"format version 01.*version 02"):
            store.get(ref)


def test_a_ref_whose_head_was_removed_is_stale(cluster):
    # What another process sees of a delete: the head goes at once, the tensors
    # once their read leases end.
    with cluster.store() as store:
        ref = store.put("gone", {"x": torch.ones(10)})
        assert cluster.anchor._client.raw.remove(_head_key(store, "gone"), True) == 0
        with pytest.raises(StaleRefError, match="deleted"):
            store.get(ref)
        assert not store.exists(ref)


def test_a_loader_reads_a_batch_of_ragged_samples_in_one_round_trip(cluster, monkeypatch, tmp_path):
    from dataflow import Consumer, Ledger, Producer
    from training import FeatureLoader, LoaderConfig

    monkeypatch.setattr(_mooncake_client, "_CLAIM_CHECK_S", 3600.0)
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    with cluster.store() as store:
        producer = Producer(led, store, run_id="r")
        producer.emit_many((f"s{i}", {"ids": torch.arange(1 + i)}) for i in range(6))
        producer.close()
        consumer = Consumer(led, store, run_id="r", consumer_id="trainer")
        consumer.resume()
        loader = FeatureLoader(
            consumer, config=LoaderConfig(batch_size=3), collate_fn=lambda samples: samples
        )
        counting = _CountingClient(store._client.raw)
        monkeypatch.setattr(store._client, "raw", counting)
        seen = []
        while (batch := loader.next_batch()) is not None:
            for sample_id, sample in zip(batch.sample_ids, batch.features, strict=True):
                assert_same_tensor(sample["ids"], torch.arange(1 + int(sample_id[1:])))
                seen.append(sample_id)
            consumer.ack(batch.refs, step=len(seen))
        loader.close()
        assert sorted(seen) == [f"s{i}" for i in range(6)]
        assert counting.calls == {"batch_get_into": 2}  # one a batch of 3 ragged samples
    led.close()
