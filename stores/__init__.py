"""Feature stores: where feature tensors live while tensor-free refs travel.

``FeatureStore`` is the interface (defined in :mod:`dataflow`); each backend
is a module of its own, and :func:`open_store` picks one by URI scheme::

    mem://NAME                     LocalFeatureStore (this process)
    dir:///ABS/PATH                SharedDirFeatureStore (processes sharing a directory)
    mooncake://HOST:PORT?...       MooncakeFeatureStore (needs the mooncake extra)

``stores.testing.FeatureStoreContract`` is the conformance suite every store
passes; ``stores.mooncake_master.MooncakeMaster`` runs a master for tests, and
:func:`lend_memory` (``dataflow mooncake-keeper``) lends a Mooncake cluster memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dataflow.interfaces import FeatureStore, StoredObject, StoreStats
from stores._registry import ENTRY_POINT_GROUP, known_schemes, open_store, register_store

if TYPE_CHECKING:
    from stores._keeper import lend_memory
    from stores._local import LocalFeatureStore
    from stores._mooncake import MooncakeFeatureStore
    from stores._shared_dir import SharedDirFeatureStore

# Names whose modules import torch or the Mooncake client: loaded on first use, so
# that `import stores` works without the mooncake extra and costs no torch import
# (a command that only checks a store URI, as `dataflow demo` does before it starts,
# stays at a third of a second).
_LAZY = {
    "LocalFeatureStore": "stores._local",
    "MooncakeFeatureStore": "stores._mooncake",
    "SharedDirFeatureStore": "stores._shared_dir",
    "lend_memory": "stores._keeper",
}

__all__ = [
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
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
