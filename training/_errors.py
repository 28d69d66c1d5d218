"""The errors of ``training``; they derive from ``dataflow.DataflowError``::

    DataflowError
    └── TrainingError
        └── CheckpointError                        a save or load could not be done
            ├── CheckpointNotFoundError (FileNotFoundError)
            ├── CorruptCheckpointError             bytes on disk differ from what was recorded
            ├── IncompatibleCheckpointError (ValueError)  saved by a differently set-up run
            └── (private) a peer's failure in the consumer's meetings of a save, also a
                dataflow.PeerFailedError

A peer's failure in the manager's own meetings (``training._dist.agree``, through
``dataflow.live.agree``) raises ``CheckpointError``, carrying the failed rank's error.

Bad arguments raise ``dataflow.InvalidArgumentError`` (a ``ValueError``) or
``dataflow.ArgumentTypeError`` (a ``TypeError``), as everywhere in dataflow.
"""

from __future__ import annotations

from dataflow import DataflowError, PeerFailedError


class TrainingError(DataflowError):
    """Root of the errors raised by ``training``."""


class CheckpointError(TrainingError):
    """A checkpoint could not be saved or loaded (on this rank or on another one)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint matches what was asked for, or its directory is gone."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest, or its manifest the ledger's record."""


class _PeerCheckpointError(CheckpointError, PeerFailedError):
    """Another rank failed while this one recorded a checkpoint (in the consumer's meetings):
    what a peer's failure is everywhere, a ``PeerFailedError``, and what the manager's
    callers catch, a ``CheckpointError``."""


class _ReplacedError(CorruptCheckpointError):
    """A checkpoint's file or directory was replaced while a load checked or read it (without
    a ledger, the step saved again meanwhile): not corruption; the load lists again."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint was saved by a run set up differently (accumulation, seed, dataset;
    ranks, unless resized with ``allow_resize``)."""
