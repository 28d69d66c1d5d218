"""SharedDirFeatureStore: the contract, the file format, and real processes sharing a directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dataflow import CorruptFeatureError, FeatureSpec, SampleRef, StaleRefError
from stores import SharedDirFeatureStore, open_store
from stores._shared_dir import MAGIC, sample_file_name
from stores.testing import LOOKALIKE_SAMPLE_IDS, FeatureStoreContract, assert_same_tensor


class TestSharedDirFeatureStore(FeatureStoreContract):
    def make_store(self, tmp_path):
        return SharedDirFeatureStore(tmp_path / "store")


@pytest.fixture
def store(tmp_path):
    with SharedDirFeatureStore(tmp_path / "store") as shared:
        yield shared


def test_uri_round_trips_odd_paths(tmp_path):
    root = tmp_path / "a dir%with?odd#chars"
    with SharedDirFeatureStore(root) as store:
        assert store.uri.startswith("dir:///")
        reopened = open_store(store.uri)
        assert reopened.root == root.resolve()
        ref = store.put("s", {"x": torch.ones(2)})
        assert_same_tensor(reopened.get(ref)["x"], torch.ones(2))
        reopened.close()


def test_bad_uris_are_refused():
    for bad in ("dir://relative/path", "dir:///x?y=1", "dir://host/abs"):
        with pytest.raises(ValueError):
            SharedDirFeatureStore.from_uri(bad)


def test_file_names_are_safe_and_distinct():
    names = {sample_file_name(i) for i in LOOKALIKE_SAMPLE_IDS}
    assert len(names) == len(LOOKALIKE_SAMPLE_IDS)
    for name in names:
        assert "/" not in name and name not in (".", "..") and not name.startswith(".")
        assert len(name) <= 200
    assert sample_file_name("x" * 256).startswith("~")


def test_file_format(store):
    ref = store.put("fmt", {"b": torch.arange(3, dtype=torch.int16), "a": torch.tensor(1.0)})
    data = store.path_for(ref.sample_id).read_bytes()
    assert data[:8] == MAGIC
    length = int.from_bytes(data[8:16], "little")
    assert int.from_bytes(data[16:24], "little") == ref.generation
    header = json.loads(data[24 : 24 + length])
    start = -(-(24 + length) // 64) * 64
    assert header["sample_id"] == "fmt" and start + header["data_bytes"] == len(data)
    for name, entry in header["tensors"].items():
        assert entry["offset"] % 64 == 0
        assert entry["nbytes"] == ref.specs[name].nbytes
        assert entry["dtype"] == str(ref.specs[name].dtype).removeprefix("torch.")
    b = start + header["tensors"]["b"]["offset"]
    assert data[b : b + 6] == torch.arange(3, dtype=torch.int16).numpy().tobytes()
    assert not list((store.root / "tmp").iterdir())


def test_truncated_file_names_the_file(store):
    ref = store.put("trunc", {"x": torch.ones(1000)})
    path = store.path_for(ref.sample_id)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CorruptFeatureError, match=str(path)):
        store.get(ref)
    os.truncate(path, 10)
    with pytest.raises(CorruptFeatureError, match=str(path)):
        store.get(ref)


def test_corrupt_header_names_the_file(store):
    ref = store.put("bad", {"x": torch.ones(10)})
    path = store.path_for(ref.sample_id)
    data = bytearray(path.read_bytes())
    data[24:28] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match=str(path)):
        store.get(ref)
    path.write_bytes(b"not a feature file at all, not at all")
    with pytest.raises(CorruptFeatureError, match=str(path)):
        store.get(ref)


def test_file_that_disagrees_with_the_ref_is_corrupt(store):
    ref = store.put("mismatch", {"x": torch.ones(10)})
    wrong = SampleRef(
        ref.sample_id, ref.store, ref.generation, {"x": FeatureSpec((20,), torch.float32)}
    )
    with pytest.raises(CorruptFeatureError, match="mismatch"):
        store.get(wrong)


def test_delete_never_removes_a_newer_generation(store):
    old = store.put("gens", {"x": torch.ones(1)})
    new = store.put("gens", {"x": torch.zeros(1)})
    store.delete(old)
    assert store.path_for("gens").exists() and store.exists(new)
    store.delete(new)
    assert not store.path_for("gens").exists()


# -- real processes ------------------------------------------------------------
def _python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float = 60) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out


PUT = """
    import sys, torch
    from stores import open_store
    store = open_store(sys.argv[1])
    tensors = {"x": torch.arange(1000, dtype=torch.float64) * 3, "flag": torch.tensor(True)}
    print(store.put("shared/sample", tensors, metadata={"by": "child"}).to_json())
"""

GET = """
    import sys, torch
    from dataflow import SampleRef
    from stores import open_store
    ref = SampleRef.from_json(sys.argv[1])
    out = open_store(ref.store).get(ref)
    assert torch.equal(out["x"], torch.arange(1000, dtype=torch.float64) * 3), out
    assert out["flag"].item() is True
    print("ok")
"""

PUT_MANY = """
    import sys, torch
    from stores import open_store
    store = open_store(sys.argv[1])
    writer = int(sys.argv[2])
    for i in range(int(sys.argv[3])):
        value = writer * 1000 + i
        x = torch.full((int(sys.argv[4]),), value, dtype=torch.int64)
        ref = store.put("contended", {"x": x})
        print(ref.to_json(), value, flush=True)
"""


@pytest.mark.slow
def test_one_process_puts_another_gets(store):
    ref_json = _finish(_python(PUT, store.uri)).strip()
    assert _finish(_python(GET, ref_json)).strip() == "ok"
    ref = SampleRef.from_json(ref_json)
    assert ref.metadata == {"by": "child"}
    assert store.get(ref)["x"][1].item() == 3.0


@pytest.mark.slow
def test_two_processes_put_the_same_id_at_once(store):
    writers = [_python(PUT_MANY, store.uri, str(w), "40", "1000") for w in (1, 2)]
    puts = {}
    for writer in writers:
        for line in _finish(writer).splitlines():
            ref_json, value = line.rsplit(" ", 1)
            ref = SampleRef.from_json(ref_json)
            puts[ref.generation] = (ref, int(value))
    assert len(puts) == 80  # every put succeeded with its own generation
    newest = max(puts)
    for generation, (ref, value) in puts.items():
        if generation == newest:
            assert_same_tensor(store.get(ref)["x"], torch.full((1000,), value, dtype=torch.int64))
        else:
            with pytest.raises(StaleRefError):
                store.get(ref)
    assert store.stats().objects == 1
    assert not list((store.root / "tmp").iterdir())


@pytest.mark.slow
def test_a_reader_never_sees_a_torn_file(store):
    # The reader takes whatever generation the sample's file holds while the
    # writer replaces it with 1 MiB generations: it reads a whole one, or
    # finds it superseded, never a mix.
    size = 1 << 17
    spec = {"x": FeatureSpec((size,), torch.int64)}
    path = store.path_for("contended")
    writer = _python(PUT_MANY, store.uri, "7", "40", str(size))
    whole = 0
    while writer.poll() is None or whole == 0:
        try:
            generation = int.from_bytes(path.read_bytes()[16:24], "little")
        except FileNotFoundError:
            continue
        try:
            x = store.get(SampleRef("contended", store.uri, generation, spec))["x"]
        except StaleRefError:
            continue
        assert 7000 <= x[0].item() < 7040 and bool((x == x[0]).all()), "torn read"
        whole += 1
    _finish(writer)
    assert whole >= 1
