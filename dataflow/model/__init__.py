"""The pure model of a run: event kinds, ids, refs, the fold and its snapshot codec.

No SQL and no torch at import time; everything here is a function of the log.
"""

from dataflow.model._events import Event, Kind
from dataflow.model._fold import Checkpoint, ReconcilePlan, RunState, seeded_order
from dataflow.model._refs import (
    MAX_SAMPLE_ID_LENGTH,
    FeatureSpec,
    SampleRef,
    dtype_name,
    validate_feature_name,
    validate_sample_id,
)

__all__ = [
    "Checkpoint",
    "Event",
    "FeatureSpec",
    "Kind",
    "MAX_SAMPLE_ID_LENGTH",
    "ReconcilePlan",
    "RunState",
    "SampleRef",
    "dtype_name",
    "seeded_order",
    "validate_feature_name",
    "validate_sample_id",
]
