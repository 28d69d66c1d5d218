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

from dataflow.interfaces._store import FeatureStore, StoredObject, StoreStats
from stores._keeper import lend_memory
from stores._local import LocalFeatureStore
from stores._mooncake import MooncakeFeatureStore
from stores._registry import ENTRY_POINT_GROUP, known_schemes, open_store, register_store
from stores._shared_dir import SharedDirFeatureStore

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
