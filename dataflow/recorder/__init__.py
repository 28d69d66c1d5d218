"""The recorder: the append-only event log (`Ledger`) and its SQLite and PostgreSQL backends."""
