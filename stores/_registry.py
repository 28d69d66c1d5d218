"""Which store serves a URI: scheme -> store class, imported on first use.

Three sources, first match wins:

1. :func:`register_store` calls in this process;
2. the built-ins below (a dotted path each, so Mooncake is imported only when
   a ``mooncake://`` URI is opened);
3. the ``dataflow.stores`` entry-point group of installed packages: the
   entry-point name is the scheme, its value ``module:Class``.

A target is a class with a ``from_uri(uri)`` classmethod, or any callable
``factory(uri) -> FeatureStore``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable
from typing import Any

from dataflow import (
    InvalidRefError,
    StoreDependencyError,
    StoreError,
    UnknownStoreError,
)
from dataflow.interfaces import FeatureStore

ENTRY_POINT_GROUP = "dataflow.stores"

MOONCAKE_HINT = (
    "install the Mooncake extra: pip install 'dataflow[mooncake-cpu]' "
    "(or 'dataflow[mooncake]' on CUDA machines); the wheel also needs the system "
    "libraries: apt-get install libibverbs1 libnuma1"
)

# scheme -> (dotted path, what to do when importing it fails)
_BUILTIN: dict[str, tuple[str, str]] = {
    "mem": ("stores._local:LocalFeatureStore", "it ships with dataflow"),
    "dir": ("stores._shared_dir:SharedDirFeatureStore", "it ships with dataflow"),
    "mooncake": ("stores._mooncake:MooncakeFeatureStore", MOONCAKE_HINT),
}

_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*")

_lock = threading.RLock()
_registered: dict[str, Any] = {}
_opened: dict[str, FeatureStore] = {}

StoreFactory = Callable[[str], FeatureStore]


def register_store(
    scheme: str, target: type[FeatureStore] | StoreFactory | str, *, replace: bool = False
) -> None:
    """Serve ``scheme://`` URIs in this process with ``target``.

    ``target`` is a FeatureStore class with ``from_uri``, a ``factory(uri)``,
    or a ``"module:Class"`` path imported on first use. Registering a scheme
    twice raises ValueError unless ``replace=True``.
    """
    if not isinstance(scheme, str) or not _SCHEME_RE.fullmatch(scheme):
        raise ValueError(f"scheme {scheme!r} must match [a-z][a-z0-9+.-]*")
    with _lock:
        if not replace and (scheme in _registered or scheme in _BUILTIN):
            raise ValueError(f"scheme {scheme!r} is already registered; pass replace=True")
        _registered[scheme] = target


def known_schemes() -> list[str]:
    """Every scheme open_store can serve now (registered, built-in, entry points)."""
    names = set(_registered) | set(_BUILTIN) | {ep.name for ep in _entry_points()}
    return sorted(names)


def open_store(uri: str) -> FeatureStore:
    """Open (or return the already open) store that ``uri`` names.

    ``mem://NAME``, ``dir:///ABS/PATH``,
    ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``, or a
    scheme registered by a plugin. Stores are shared per URI within a process:
    opening the URI of a ref (``open_store(ref.store)``) returns the store that
    made the ref when it is still open here. Closing a store closes it for
    every holder; the next open_store opens a fresh one.
    """
    if not isinstance(uri, str) or "://" not in uri:
        raise InvalidRefError(f"a store URI looks like scheme://..., got {uri!r}")
    scheme = uri.split("://", 1)[0]
    with _lock:
        store = _opened.get(uri)
        if store is not None and not _is_closed(store):
            return store
        store = _call(_resolve(scheme, uri), uri)
        for key in (uri, store.uri):
            cached = _opened.get(key)
            if cached is None or _is_closed(cached):
                _opened[key] = store
        return store


def _resolve(scheme: str, uri: str) -> Any:
    target = _registered.get(scheme)
    if target is not None:
        return _load(target, scheme, "") if isinstance(target, str) else target
    if scheme in _BUILTIN:
        path, hint = _BUILTIN[scheme]
        return _load(path, scheme, hint)
    for ep in _entry_points():
        if ep.name == scheme:
            try:
                return ep.load()
            except ImportError as exc:
                raise StoreDependencyError(
                    f"the {scheme}:// store ({ep.value}, from the {ENTRY_POINT_GROUP!r} "
                    f"entry points) failed to import: {exc}"
                ) from exc
    raise UnknownStoreError(
        f"no store is registered for the scheme {scheme!r} of {uri!r}; known schemes: "
        f"{', '.join(known_schemes())}. Install the package that provides it (it registers "
        f"under the {ENTRY_POINT_GROUP!r} entry-point group) or call "
        f"stores.register_store({scheme!r}, StoreClass)"
    )


def _load(path: str, scheme: str, hint: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise StoreDependencyError(
            f"the {scheme}:// store needs {exc.name or module}: {hint}"
        ) from exc


def _call(target: Any, uri: str) -> FeatureStore:
    factory = getattr(target, "from_uri", target)
    if not callable(factory):
        raise StoreError(f"store target {target!r} is neither a class with from_uri nor callable")
    store = factory(uri)
    if not isinstance(store, FeatureStore):
        raise StoreError(f"{target!r} returned {type(store).__name__}, not a FeatureStore")
    return store


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _is_closed(store: FeatureStore) -> bool:
    return store.closed
