"""SharedDirFeatureStore's lock-free puts of new samples, against its locked replacements.

A new sample's file is linked into place without the bucket's lock (a link never
replaces a file); a put over a file and a delete take the lock. The contract holds
whichever way a handle writes its files (unnamed, named in tmp/, or renamed on a file
system without hard links), and real processes that put, replace and delete the same
ids at once, some writing unnamed files and some named ones, never let an older
generation replace a newer one.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import stores._shared_dir
import tests.test_store_shared_dir as plain
from dataflow import FeatureSpec, SampleRef, StaleRefError
from stores import SharedDirFeatureStore
from stores.testing import assert_same_tensor
from tests import _zygote

_SPEC = FeatureSpec((64,), torch.int64)


def _named(store: SharedDirFeatureStore) -> SharedDirFeatureStore:
    """``store`` writing each new file to a temporary name, as where there is no O_TMPFILE."""
    store._dir.unnamed = False
    return store


class TestNamedFiles(plain.TestSharedDirFeatureStore):
    def make_store(self, tmp_path):
        return _named(SharedDirFeatureStore(tmp_path / "store"))


class TestWithoutHardLinks(plain.TestSharedDirFeatureStore):
    """A file system without hard links: every put renames, under its lock (as NFS
    exports of some servers, or a FUSE mount)."""

    def make_store(self, tmp_path):
        store = _named(SharedDirFeatureStore(tmp_path / "store"))
        link = os.link

        def no_links(src, dst, **kwargs):
            if str(dst).startswith(str(store.root)):
                raise PermissionError(errno.EPERM, "Operation not permitted")
            link(src, dst, **kwargs)

        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(os, "link", no_links)
        return store

    @pytest.fixture(autouse=True)
    def _undo(self):
        yield
        if hasattr(self, "_patch"):
            self._patch.undo()


def test_without_hard_links_a_put_renames_and_says_nothing_is_left(tmp_path, monkeypatch):
    with _named(SharedDirFeatureStore(tmp_path / "store")) as store:
        monkeypatch.setattr(
            os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EPERM, "no links"))
        )
        first = store.put("a", {"x": torch.ones(2)})
        second = store.put("a", {"x": torch.zeros(2)})
        assert not store._dir.links
        assert second.generation > first.generation
        assert_same_tensor(store.get(second)["x"], torch.zeros(2))
        assert os.listdir(store.root / "tmp") == []


def test_an_unnamed_new_file_leaves_no_temporary_name(tmp_path, monkeypatch):
    with SharedDirFeatureStore(tmp_path / "store") as store:
        if not store._dir.unnamed:
            pytest.skip("no O_TMPFILE here: new files are written named")
        made: list[str] = []
        open_tmp = store._dir.open_tmp
        monkeypatch.setattr(store._dir, "open_tmp", lambda: made.append("tmp") or open_tmp())
        refs = store.put_many([(f"s{i}", {"x": torch.full((3,), i)}) for i in range(8)])
        assert made == []  # none was named
        assert [store.get(r)["x"][0].item() for r in refs] == list(range(8))
        again = store.put("s0", {"x": torch.full((3,), 9)})  # a replacement: named, renamed
        assert again.generation > refs[0].generation
        assert os.listdir(store.root / "tmp") == []


_RACER = """
    import json, random, sys, torch
    from stores import SharedDirFeatureStore
    root, named = sys.argv[1], sys.argv[5] == "named"
    writer, seed, ops = (int(arg) for arg in sys.argv[2:5])
    store = SharedDirFeatureStore(root)
    if named:
        store._dir.unnamed = False  # new files written named in tmp/, then linked
    rng = random.Random(seed)
    mine = []  # refs this process put, newest last
    for n in range(ops):
        if mine and rng.random() < 0.4:
            ref = mine.pop(rng.randrange(len(mine)))
            store.delete(ref)
            print(json.dumps({"op": "delete", "ref": ref.to_json()}), flush=True)
            continue
        sample = f"id{rng.randrange(2)}"
        value = writer * 100000 + n
        ref = store.put(sample, {"x": torch.full((64,), value, dtype=torch.int64)})
        mine.append(ref)
        print(json.dumps({"op": "put", "ref": ref.to_json(), "value": value}), flush=True)
    store.close()
"""


@pytest.mark.slow
def test_processes_putting_replacing_and_deleting_the_same_ids_keep_the_newest(tmp_path):
    """Four processes (two writing unnamed files, two named) put, replace and delete
    two ids at once. Per id: every generation handed out is unique; at the end the file
    holds the largest generation put, or none if that one was deleted (a delete only
    removes its ref's generation); and what it holds is that put's tensor."""
    root = tmp_path / "store"
    SharedDirFeatureStore(root).close()
    seed = random.randrange(1 << 30)
    processes = [
        _zygote.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_RACER),
                str(root),
                str(w),
                str(seed + w),
                "150",
                "named" if w % 2 else "unnamed",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(4)
    ]
    puts: dict[str, dict[int, int]] = {}  # sample id -> generation -> value
    deleted: set[tuple[str, int]] = set()
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"seed {seed}: {err}"
        for line in out.splitlines():
            record = json.loads(line)
            ref = SampleRef.from_json(record["ref"])
            if record["op"] == "delete":
                deleted.add((ref.sample_id, ref.generation))
                continue
            generations = puts.setdefault(ref.sample_id, {})
            assert ref.generation not in generations, f"seed {seed}: a generation twice"
            generations[ref.generation] = record["value"]
    with SharedDirFeatureStore(root) as store:
        on_disk = {obj.sample_id: obj.generation for obj in store.scan()}
        for sample_id, generations in puts.items():
            newest = max(generations)
            if (sample_id, newest) in deleted:  # nothing newer came: none is left
                assert sample_id not in on_disk, f"seed {seed}: {sample_id} holds an older one"
                continue
            assert on_disk.get(sample_id) == newest, f"seed {seed}: {sample_id} holds an older one"
            ref = SampleRef(sample_id, store.uri, newest, {"x": _SPEC})
            value = torch.full((64,), generations[newest], dtype=torch.int64)
            assert_same_tensor(store.get(ref)["x"], value)
            for older in set(generations) - {newest}:
                with pytest.raises(StaleRefError):
                    store.get(SampleRef(sample_id, store.uri, older, {"x": _SPEC}))
        assert os.listdir(root / "tmp") == []


def test_a_file_system_without_unnamed_files_gets_named_ones(tmp_path, monkeypatch):
    with SharedDirFeatureStore(tmp_path / "store") as store:
        opened = os.open

        def no_tmpfile(path, flags, *args, **kwargs):
            if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return opened(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_tmpfile)
        refs = store.put_many([(f"s{i}", {"x": torch.full((2,), i)}) for i in range(3)])
        assert not store._dir.unnamed
        assert [store.get(r)["x"][0].item() for r in refs] == [0, 1, 2]
        assert os.listdir(store.root / "tmp") == []


def test_a_link_made_whose_reply_was_lost_counts_as_made(tmp_path, monkeypatch):
    """Over NFS a link whose reply was lost is sent again and fails with EEXIST: the put
    finds its own file there and takes it as linked (not as another's to replace)."""
    with _named(SharedDirFeatureStore(tmp_path / "store")) as store:
        link = os.link

        def resent(src, dst, **kwargs):
            link(src, dst, **kwargs)
            raise FileExistsError(errno.EEXIST, "File exists")

        rewritten: list[int] = []  # a visible file rewritten in place could tear a read
        monkeypatch.setattr(stores._shared_dir, "pwrite_all", lambda *a: rewritten.append(1))
        monkeypatch.setattr(os, "link", resent)
        ref = store.put("a", {"x": torch.arange(3)})
        assert rewritten == []
        monkeypatch.undo()
        assert [(o.sample_id, o.generation) for o in store.scan()] == [("a", ref.generation)]
        assert_same_tensor(store.get(ref)["x"], torch.arange(3))
