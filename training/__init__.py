"""Building blocks for custom trainers on a dataflow run.

``CheckpointManager`` writes checkpoints atomically and durably before the ledger
records them; ``FeatureLoader`` turns a Consumer's leases into collated batches;
``Trainer`` runs the resume -> step -> ack -> eval -> checkpoint loop around your
own step function; ``PadCollate`` pads variable-length features into one batch, each
sample read straight into its row. docs/training.md walks through a custom trainer.
"""

from training._checkpoint import CheckpointManager
from training._collate import PadCollate
from training._config import COMPONENTS, CheckpointConfig, LoaderConfig, TrainerConfig
from training._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    TrainingError,
)
from training._layout import SavedCheckpoint
from training._loader import Batch, FeatureLoader, collate
from training._rng import rng_state, set_rng_state
from training._step import StepHelper
from training._trainer import REGENERATE_PRODUCER_ID, Trainer

__all__ = [
    "Batch",
    "COMPONENTS",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FeatureLoader",
    "IncompatibleCheckpointError",
    "LoaderConfig",
    "PadCollate",
    "REGENERATE_PRODUCER_ID",
    "SavedCheckpoint",
    "StepHelper",
    "Trainer",
    "TrainerConfig",
    "TrainingError",
    "collate",
    "rng_state",
    "set_rng_state",
]
