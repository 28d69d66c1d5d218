"""stores.open_store: built-in schemes, plugins (in process and by entry point), hints."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import stores
from dataflow import InvalidRefError, StoreDependencyError, StoreError, UnknownStoreError
from stores import (
    ENTRY_POINT_GROUP,
    LocalFeatureStore,
    SharedDirFeatureStore,
    _registry,
    known_schemes,
    open_store,
    register_store,
)


@pytest.fixture(autouse=True)
def _clean_registrations(monkeypatch):
    monkeypatch.setattr(_registry, "_registered", {})


def test_public_names():
    assert stores.__all__ == sorted(stores.__all__)
    assert set(stores.__all__) == {
        "ENTRY_POINT_GROUP",
        "FeatureStore",
        "LocalFeatureStore",
        "MooncakeFeatureStore",
        "SharedDirFeatureStore",
        "StoreStats",
        "StoredObject",
        "known_schemes",
        "lend_memory",
        "open_store",
        "register_store",
    }


def test_importing_stores_leaves_mooncake_out_until_a_mooncake_name_is_used():
    code = (
        "import sys, stores\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules if 'mooncake' in m.split('.')[-1]"
        " or m.split('.')[0] == 'mooncake')\n"
        "print(','.join(loaded()))\n"
        "stores.MooncakeFeatureStore, stores.lend_memory\n"
        "print(','.join(loaded()))\n"
        "print(stores.MooncakeFeatureStore.__module__, 'lend_memory' in dir(stores))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "", f"import stores pulled in {out[0]}"
    assert "stores._mooncake" in out[1].split(",") and "mooncake" not in out[1].split(",")
    assert out[2] == "stores._mooncake True"
    with pytest.raises(AttributeError, match="no_such_name"):
        stores.no_such_name  # noqa: B018


def test_builtin_schemes(tmp_path):
    assert {"mem", "dir", "mooncake"} <= set(known_schemes())
    mem = open_store("mem://registry-builtin")
    assert isinstance(mem, LocalFeatureStore) and mem.uri == "mem://registry-builtin"
    assert open_store("mem://registry-builtin") is mem
    mem.close()
    shared = open_store(f"dir://{tmp_path}")
    assert isinstance(shared, SharedDirFeatureStore) and shared.root == tmp_path.resolve()
    shared.close()


def test_stores_are_shared_per_uri_until_closed(tmp_path):
    first = open_store(f"dir://{tmp_path}")
    assert open_store(first.uri) is first
    first.close()
    second = open_store(first.uri)
    assert second is not first
    ref = second.put("s", {"x": torch.ones(1)})
    assert open_store(ref.store) is second
    second.close()


def test_unknown_scheme_names_the_known_ones_and_the_way_out():
    with pytest.raises(UnknownStoreError) as info:
        open_store("s3://bucket/features")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for part in ("'s3'", "dir", "mem", "mooncake", ENTRY_POINT_GROUP, "register_store"):
        assert part in message


def test_malformed_uri():
    for bad in ("no-scheme", "", 3):
        with pytest.raises(InvalidRefError):
            open_store(bad)


class _Counting(LocalFeatureStore):
    @classmethod
    def from_uri(cls, uri):
        return cls(uri.split("://", 1)[1])


def test_register_a_class_a_factory_or_a_dotted_path():
    register_store("counting", _Counting)
    store = open_store("counting://one")
    assert isinstance(store, _Counting)
    store.close()
    register_store("factory", lambda uri: LocalFeatureStore(uri.split("://", 1)[1]))
    store = open_store("factory://two")
    assert isinstance(store, LocalFeatureStore)
    store.close()
    register_store("dotted", f"{__name__}:_Counting")
    store = open_store("dotted://three")
    assert isinstance(store, _Counting)
    store.close()
    assert {"counting", "factory", "dotted"} <= set(known_schemes())


def test_register_refuses_duplicates_and_bad_schemes():
    register_store("twice", _Counting)
    with pytest.raises(ValueError, match="already registered"):
        register_store("twice", _Counting)
    register_store("twice", _Counting, replace=True)
    with pytest.raises(ValueError):
        register_store("mem", _Counting)
    for bad in ("", "Upper", "1abc", "a b", None):
        with pytest.raises(ValueError):
            register_store(bad, _Counting)


def test_factory_must_return_a_store():
    register_store("broken", lambda uri: object())
    with pytest.raises(StoreError, match="not a FeatureStore"):
        open_store("broken://x")


def test_entry_point_plugins_are_found(tmp_path, monkeypatch):
    (tmp_path / "fake_plugin_store.py").write_text(
        textwrap.dedent("""
        from stores import LocalFeatureStore

        class FakeStore(LocalFeatureStore):
            @classmethod
            def from_uri(cls, uri):
                return cls(uri.split("://", 1)[1])
    """)
    )
    dist = tmp_path / "fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nfakeplug = fake_plugin_store:FakeStore\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "fakeplug" in known_schemes()
    store = open_store("fakeplug://plugged")
    assert type(store).__name__ == "FakeStore"
    store.close()


def test_a_builtin_whose_import_fails_gives_its_hint(monkeypatch):
    monkeypatch.setitem(
        _registry._BUILTIN, "ghost", ("no_such_module_xyz:Store", "pip install ghost")
    )
    with pytest.raises(StoreDependencyError, match="pip install ghost"):
        open_store("ghost://x")


def test_mooncake_without_mooncake_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(StoreDependencyError) as info:
        open_store("mooncake://127.0.0.1:1?namespace=x")
    assert "dataflow[mooncake-cpu]" in str(info.value)
    assert "libibverbs1" in str(info.value)
