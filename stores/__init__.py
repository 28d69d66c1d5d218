"""Feature stores: where feature tensors live while tensor-free refs travel.

``FeatureStore`` is the interface (defined in :mod:`dataflow`); each backend
is a module of its own.
"""

from dataflow._contracts import FeatureStore, StoreStats
from stores._local import LocalFeatureStore

__all__ = ["FeatureStore", "LocalFeatureStore", "StoreStats"]
