"""The recorder: the append-only event log (`Ledger`) and its SQLite and PostgreSQL backends."""

from dataflow.recorder._ledger import Ledger
from dataflow.recorder._write import NewEvent, WriteTransaction

__all__ = [
    "Ledger",
    "NewEvent",
    "WriteTransaction",
]
