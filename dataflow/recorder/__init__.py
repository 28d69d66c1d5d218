"""The recorder: the append-only event log (`Ledger`) and its SQLite and PostgreSQL backends."""

from dataflow.recorder._ledger import Ledger, NewEvent, WriteTransaction

__all__ = [
    "Ledger",
    "NewEvent",
    "WriteTransaction",
]
