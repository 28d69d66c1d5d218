"""SharedDirFeatureStore: the contract, the file format, and real processes sharing a directory."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stores._shared_dir
from dataflow import CorruptFeatureError, FeatureSpec, SampleRef, StaleRefError, StoreError
from dataflow.testing import feature_dicts, sample_ids
from stores import SharedDirFeatureStore, _tensors, open_store
from stores._shared_dir_format import MAGIC, FileLayout, array_of, file_pieces
from stores._shared_dir_layout import sample_file_name
from stores.testing import LOOKALIKE_SAMPLE_IDS, FeatureStoreContract, assert_same_tensor
from tests import _zygote


class TestSharedDirFeatureStore(FeatureStoreContract):
    def make_store(self, tmp_path):
        return SharedDirFeatureStore(tmp_path / "store")

    @contextlib.contextmanager
    def failing_puts(self, store, after):
        # A put makes its file the sample's with a link (a new sample) or a rename.
        placed, link, rename = itertools.count(), os.link, os.rename

        def failing(place):
            def fail_once(*args, **kwargs):
                if next(placed) == after:
                    raise OSError(errno.EIO, "Input/output error (failing_puts)")
                place(*args, **kwargs)

            return fail_once

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "link", failing(link))
            patch.setattr(os, "rename", failing(rename))
            yield

    def rewrite_stored_bytes(self, store, ref, name, change):
        path, tensor = store.path_for(ref.sample_id), store.get(ref, names=[name])[name]
        at, nbytes = _tensor_at(path, tensor), tensor.nbytes
        data = bytearray(path.read_bytes()[at : at + nbytes])
        change(data)
        _rewrite(path, at, bytes(data))


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


def _layout(path) -> tuple[bytes, dict, int]:
    """(file bytes, header, offset of the data) of a feature file, read by hand."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    return data, json.loads(data[32 : 32 + length]), -(-(32 + length) // 64) * 64


def _tensor_at(path, tensor: torch.Tensor) -> int:
    """Where the bytes of ``tensor`` are in the file at ``path`` (whatever its format)."""
    at = path.read_bytes().find(tensor.numpy().tobytes())
    assert at >= 0, f"{path} does not hold the tensor's bytes"
    return at


def _rewrite(path, offset: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    path.write_bytes(bytes(data))


def test_file_format(store):
    ref = store.put("fmt", {"b": torch.arange(3, dtype=torch.int16), "a": torch.tensor(1.0)})
    path = store.path_for(ref.sample_id)
    data, header, start = _layout(path)
    assert data[:8] == MAGIC == b"DFFEAT02"
    length = int.from_bytes(data[8:16], "little")
    assert int.from_bytes(data[16:24], "little") == ref.generation
    header_sum = xxhash.xxh3_64_intdigest(data[:24] + data[32 : 32 + length])
    assert int.from_bytes(data[24:32], "little") == header_sum
    assert header["sample_id"] == "fmt" and start + header["data_bytes"] == len(data)
    for name, entry in header["tensors"].items():
        assert entry["offset"] % 64 == 0
        assert entry["nbytes"] == ref.specs[name].nbytes
        assert entry["dtype"] == str(ref.specs[name].dtype).removeprefix("torch.")
        at = start + entry["offset"]
        assert entry["xxh3"] == xxhash.xxh3_64_hexdigest(data[at : at + entry["nbytes"]])
    b = start + header["tensors"]["b"]["offset"]
    assert data[b : b + 6] == torch.arange(3, dtype=torch.int16).numpy().tobytes()
    assert not list((store.root / "tmp").iterdir())


# -- no silent wrong answers (issue #11) -------------------------------------------
def test_a_flipped_tensor_byte_names_the_file_and_what_to_do(store):
    tensors = {"a": torch.arange(1000, dtype=torch.float32)}
    ref = store.put("flip", tensors)
    path = store.path_for(ref.sample_id)
    at = _tensor_at(path, tensors["a"]) + 2000
    _rewrite(path, at, bytes([path.read_bytes()[at] ^ 0x10]))
    message = rf"(?s){path}.*feature 'a' of sample 'flip'.*checksum.*put the sample again"
    with pytest.raises(CorruptFeatureError, match=message):
        store.get(ref)


def test_a_corrupt_generation_field_is_corrupt_not_stale(store):
    ref = store.put("gen", {"x": torch.ones(10)})
    path = store.path_for(ref.sample_id)
    for flipped in (ref.generation ^ 1, ref.generation + 10**12, 2**64 - 1):
        _rewrite(path, 16, flipped.to_bytes(8, "little"))
        with pytest.raises(CorruptFeatureError, match=rf"(?s){path}.*'gen'.*header.*checksum"):
            store.get(ref)
    assert not store.exists(ref)
    again = store.put("gen", {"x": torch.zeros(10)})  # a corrupt file is replaceable
    assert_same_tensor(store.get(again)["x"], torch.zeros(10))


def test_another_samples_file_in_place_is_corrupt_not_stale(store):
    mine = store.put("mine", {"x": torch.ones(10)})
    theirs = store.put("theirs", {"x": torch.zeros(10)})
    store.path_for("mine").write_bytes(store.path_for("theirs").read_bytes())
    assert theirs.generation > mine.generation  # what made it read as superseded
    with pytest.raises(CorruptFeatureError, match="names sample 'theirs'"):
        store.get(mine)


def test_a_newer_generation_is_still_stale(store):
    old = store.put("newer", {"x": torch.ones(10)})
    store.put("newer", {"x": torch.zeros(10)})
    with pytest.raises(StaleRefError, match="superseded"):
        store.get(old)


def test_a_file_of_the_old_format_is_refused_with_its_version(store):
    ref = store.put("v1", {"x": torch.ones(4)})
    path = store.path_for(ref.sample_id)
    header = json.dumps(
        {
            "sample_id": "v1",
            "data_bytes": 64,
            "tensors": {"x": {"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}},
        }
    ).encode()
    prefix = b"DFFEAT01" + len(header).to_bytes(8, "little") + ref.generation.to_bytes(8, "little")
    data = prefix + header
    data += bytes(-len(data) % 64) + torch.ones(4).numpy().tobytes() + bytes(48)
    path.write_bytes(data)
    with pytest.raises(CorruptFeatureError, match=r"format version 01.*version 02"):
        store.get(ref)


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


# -- listing (issue #12) ---------------------------------------------------------
def test_scan_never_follows_symlinks_out_of_the_root(store, tmp_path):
    with SharedDirFeatureStore(tmp_path / "elsewhere") as outside:
        foreign = outside.put("foreign", {"x": torch.ones(4)})
        foreign_file = outside.path_for("foreign")
        mine = store.put("mine", {"x": torch.ones(2)})
        bucket = store.path_for("mine").parent
        (bucket / "link-to-a-file").symlink_to(foreign_file)
        # An empty bucket swapped for a link to a bucket of the other store (a store of
        # one directory has no empty bucket: a link under a bucket's name).
        samples = store.root / "samples"
        empty = next(
            (b for b in samples.iterdir() if b.is_dir() and not any(b.iterdir())), samples / "00"
        )
        if empty.exists():
            empty.rmdir()
        empty.symlink_to(foreign_file.parent, target_is_directory=True)
        (store.root / "samples" / "not-a-bucket").symlink_to(foreign_file.parent)
        listed = list(store.scan())
        assert [(o.sample_id, o.generation) for o in listed] == [("mine", mine.generation)]
        assert store.stats().objects == 1
        assert outside.exists(foreign)


def test_scan_skips_corrupt_and_misplaced_files_and_says_so(store, caplog):
    good = store.put("good", {"x": torch.ones(3)})
    other = store.put("other", {"x": torch.ones(3)})
    bucket = store.path_for("good").parent
    (bucket / "garbage").write_bytes(b"not a feature file")
    misplaced = store.path_for("other").read_bytes()
    (bucket / "copy-of-other").write_bytes(misplaced)  # intact, but not where 'other' lives
    with caplog.at_level("WARNING", logger="stores._shared_dir"):
        listed = {o.sample_id: o.generation for o in store.scan()}
    assert listed == {"good": good.generation, "other": other.generation}
    text = caplog.text
    assert "garbage" in text and "copy-of-other" in text and "'other'" in text


def test_scan_is_lazy_and_skips_what_is_deleted_meanwhile(store):
    refs = [store.put(f"lazy/{i}", {"x": torch.ones(i + 1)}) for i in range(40)]
    scan = store.scan()
    first = next(scan)
    for ref in refs:
        store.delete(ref)
    rest = list(scan)  # files deleted under the scan are skipped, not errors
    assert first.sample_id.startswith("lazy/") and len(rest) < 39
    assert list(store.scan()) == []


def test_created_is_the_files_mtime(store):
    ref = store.put("old", {"x": torch.ones(1)})
    os.utime(store.path_for("old"), (1_000_000_000, 1_000_000_000))
    (obj,) = store.scan()
    assert (obj.sample_id, obj.generation, obj.created) == ("old", ref.generation, 1e9)


# -- real processes ------------------------------------------------------------
def _python(code: str, *args: str) -> subprocess.Popen[str]:
    """``python -c CODE ARGS``, forked from the test zygote: a process of its own (its
    files, locks and crashes as real), without a fresh import of torch (11 of them here)."""
    return _zygote.Popen(
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


def test_the_benchmark_switch_skips_checksums_and_checking_handles_refuse_its_files(tmp_path):
    unchecked = SharedDirFeatureStore(tmp_path / "store")
    unchecked._checksums = False
    ref = unchecked.put("raw", {"x": torch.ones(4)})
    assert_same_tensor(unchecked.get(ref)["x"], torch.ones(4))
    checking = SharedDirFeatureStore(tmp_path / "store")
    with pytest.raises(CorruptFeatureError, match="without a checksum"):
        checking.get(ref)
    checking.close()
    unchecked.close()


# -- layouts broken by hand --------------------------------------------------------
def test_a_directory_in_place_of_a_sample_file(store):
    ref = store.put("a", {"x": torch.arange(4.0)})
    path = store.path_for("a")
    path.unlink()
    path.mkdir()
    # Corrupt, not a bare IsADirectoryError: the training loader counts the sample lost.
    with pytest.raises(CorruptFeatureError, match=rf"{path} .*'a' but is a directory: remove it"):
        store.get(ref)
    assert not store.exists(ref)
    store.delete(ref)  # the ref's generation is gone: nothing to delete, no OSError
    assert path.is_dir()
    (path / "keep").write_text("somebody's")  # not empty: a put must not remove it
    with pytest.raises(CorruptFeatureError, match=rf"{path} .*'a'.*cannot be removed"):
        store.put("a", {"x": torch.zeros(1)})
    assert (path / "keep").read_text() == "somebody's"
    assert not list((store.root / "tmp").iterdir())
    (path / "keep").unlink()  # empty: a put replaces it
    again = store.put("a", {"x": torch.zeros(1)})
    assert_same_tensor(store.get(again)["x"], torch.zeros(1))
    assert [o.sample_id for o in store.scan()] == ["a"]


def test_a_root_that_is_a_file_is_refused_naming_it(tmp_path):
    root = tmp_path / "root"
    root.write_text("not a directory")
    for make in (SharedDirFeatureStore, lambda r: open_store(f"dir://{r}")):
        with pytest.raises(StoreError, match=rf"'{root}' is a file, not a directory"):
            make(root)
    (tmp_path / "samples-file").mkdir()
    (tmp_path / "samples-file" / "samples").write_text("")
    with pytest.raises(StoreError, match="cannot lay out the shared directory store under"):
        SharedDirFeatureStore(tmp_path / "samples-file")


def test_a_put_recreates_a_removed_bucket_tmp_or_locks_directory(store):
    ref = store.put("c", {"x": torch.ones(2)})
    shutil.rmtree(store.path_for("c").parent)
    with pytest.raises(StaleRefError, match="deleted"):
        store.get(ref)
    again = store.put("c", {"x": torch.zeros(2)})
    assert_same_tensor(store.get(again)["x"], torch.zeros(2))
    store.close()  # a fresh handle: no lock fd open yet, so locks/ is needed again
    with SharedDirFeatureStore(store.root) as fresh:
        shutil.rmtree(store.root / "tmp")
        shutil.rmtree(store.root / "locks")
        fresh.put("d", {"x": torch.ones(2)})  # a new sample's file: linked, with no lock
        d = fresh.put("d", {"x": torch.full((2,), 3.0)})  # replaced under its lock
        assert_same_tensor(fresh.get(d)["x"], torch.full((2,), 3.0))
        assert (store.root / "locks").is_dir() and not list((store.root / "tmp").iterdir())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(features=feature_dicts(max_features=4))
def test_a_file_lays_its_tensors_out_as_the_specs_say(tmp_path, features) -> None:
    """The format's layout (stores._tensors.layout of the ref's specs), and the whole file
    as long as the header says, with every pad zero."""
    store = SharedDirFeatureStore(tmp_path / "layout")
    try:
        ref = store.put("s", features)
        data = store.path_for("s").read_bytes()
    finally:
        store.close()
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[32 : 32 + length])
    start = -(-(32 + length) // 64) * 64
    spans = _tensors.layout(ref.specs)
    assert {name: (t["offset"], t["nbytes"]) for name, t in header["tensors"].items()} == spans
    assert header["data_bytes"] == _tensors.end_of(spans.values())
    assert len(data) == start + header["data_bytes"]
    used = bytearray(len(data))
    used[: 32 + length] = b"\1" * (32 + length)
    for name, (offset, nbytes) in spans.items():
        got = data[start + offset : start + offset + nbytes]
        assert got == _tensors.byte_view(features[name].contiguous()).numpy().tobytes()
        used[start + offset : start + offset + nbytes] = b"\1" * nbytes
    assert all(byte == 0 for byte, mark in zip(data, used, strict=True) if not mark)


@settings(max_examples=60, deadline=None)
@given(features=feature_dicts(max_features=4), checksums=st.booleans(), sample_id=sample_ids())
def test_a_header_of_a_shared_layout_is_the_json_of_its_fields(
    features, checksums, sample_id
) -> None:
    """Puts of samples with the same specs share a FileLayout: the header it writes for a
    sample is the compact JSON of the header's fields, keys in the order the format
    gives, tensors in the order of the put, and the file as long as the pieces."""
    layout = FileLayout(tuple((n, t.shape, t.dtype) for n, t in features.items()), checksums)
    header, pieces, size = file_pieces(
        sample_id, [array_of(features[name]) for name in layout.names], layout
    )
    spans = _tensors.layout(layout.specs)
    tensors = {
        name: {
            "dtype": _tensors.dtype_str(t.dtype),
            "shape": list(t.shape),
            "offset": spans[name][0],
            "nbytes": spans[name][1],
            "xxh3": xxhash.xxh3_64_hexdigest(_tensors.byte_view(t.contiguous()).numpy().tobytes())
            if checksums
            else None,
        }
        for name, t in features.items()
    }
    fields = {
        "sample_id": sample_id,
        "data_bytes": _tensors.end_of(spans.values()),
        "tensors": tensors,
    }
    assert header == json.dumps(fields, separators=(",", ":")).encode()
    assert size == 32 + len(header) + sum(memoryview(piece).nbytes for piece in pieces)


# -- the layout: one directory of sample files, or (stores made before) 256 buckets ----------
def test_a_batch_makes_its_renames_durable_with_one_directory_fsync(store, monkeypatch):
    synced: list[str] = []
    fsync_path = stores._shared_dir.fsync_path
    monkeypatch.setattr(
        stores._shared_dir,
        "fsync_path",
        lambda path, **kw: (synced.append(str(path)), fsync_path(path, **kw))[1],
    )
    refs = store.put_many([(f"batch/{i}", {"x": torch.full((4,), i)}) for i in range(64)])
    assert synced == [str(store.root / "samples" / "all")]
    assert {store.path_for(ref.sample_id).parent for ref in refs} == {
        store.root / "samples" / "all"
    }
    assert sorted(os.listdir(store.root / "samples")) == ["all"]


def test_a_store_of_bucket_directories_keeps_its_layout(tmp_path):
    root = tmp_path / "old"
    for bucket in range(256):  # what a store made before the one directory looks like
        (root / "samples" / f"{bucket:02x}").mkdir(parents=True)
    with SharedDirFeatureStore(root) as old:
        ref = old.put("a/b:c", {"x": torch.arange(3)})
        path = old.path_for("a/b:c")
        assert path.parent.parent == root / "samples" and path.parent.name != "all"
        assert path.name == sample_file_name("a/b:c") and path.is_file()
        more = old.put_many([(f"m{i}", {"x": torch.ones(2)}) for i in range(8)])
    assert not (root / "samples" / "all").exists()
    with SharedDirFeatureStore(root) as again:  # another handle: the same layout
        assert_same_tensor(again.get(ref)["x"], torch.arange(3))
        assert {o.sample_id for o in again.scan()} == {"a/b:c", *(r.sample_id for r in more)}
        again.delete(ref)
        assert not path.exists()


_OPEN_AND_PUT = """
    import sys, torch
    from stores import SharedDirFeatureStore
    with SharedDirFeatureStore(sys.argv[1]) as store:
        store.put_many([(f"{sys.argv[2]}/{i}", {"x": torch.ones(2)}) for i in range(4)])
"""


def test_processes_opening_a_new_root_at_once_agree_on_its_layout(tmp_path):
    root = tmp_path / "fresh"
    processes = [_python(_OPEN_AND_PUT, str(root), f"p{n}") for n in range(6)]
    for process in processes:
        _finish(process)
    assert sorted(os.listdir(root)) == ["locks", "samples", "tmp"]  # no layout left aside
    assert sorted(os.listdir(root / "samples")) == ["all"]
    with SharedDirFeatureStore(root) as store:
        assert len(list(store.scan())) == 24


def test_a_new_handle_keeps_the_one_directory_when_it_was_removed(store, caplog):
    store.put("gone", {"x": torch.ones(2)})
    shutil.rmtree(store.root / "samples" / "all")
    with caplog.at_level("WARNING", logger="stores._shared_dir"):
        fresh = SharedDirFeatureStore(store.root)
    with fresh:
        ref = fresh.put("back", {"x": torch.zeros(2)})
        assert fresh.path_for("back").parent == store.root / "samples" / "all"
        assert_same_tensor(store.get(ref)["x"], torch.zeros(2))  # the old handle agrees
    assert sorted(os.listdir(store.root / "samples")) == ["all"]
    assert "recreating the missing directory" in caplog.text
