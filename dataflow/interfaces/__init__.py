"""The interfaces other packages implement: a feature store and a ref stream."""

from dataflow.interfaces._copy import byte_view, copy
from dataflow.interfaces._durable import fsync_path, fsync_tree
from dataflow.interfaces._store import FeatureStore, StoredObject, StoreStats
from dataflow.interfaces._stream import RefReceiver, RefSender

__all__ = [
    "FeatureStore",
    "RefReceiver",
    "RefSender",
    "StoreStats",
    "StoredObject",
    "byte_view",
    "copy",
    "fsync_path",
    "fsync_tree",
]
