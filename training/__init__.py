"""Building blocks for custom trainers on a dataflow run.

``CheckpointManager`` writes checkpoints atomically and durably before the ledger
records them; ``FeatureLoader`` turns a Consumer's leases into collated batches;
``Trainer`` runs the resume -> step -> ack -> eval -> checkpoint loop around your
own step function. docs/training.md walks through a custom trainer.
"""

from training._checkpoint import CheckpointManager, SavedCheckpoint
from training._config import CheckpointConfig, LoaderConfig, TrainerConfig
from training._loader import Batch, FeatureLoader, collate
from training._trainer import Trainer

__all__ = [
    "Batch",
    "CheckpointConfig",
    "CheckpointManager",
    "FeatureLoader",
    "LoaderConfig",
    "SavedCheckpoint",
    "Trainer",
    "TrainerConfig",
    "collate",
]
