"""The ledger's tables: one schema, shared by SQLite and PostgreSQL (SQLAlchemy Core)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

#: 1: events and runs. 2: snapshots. 3: producer epochs. 4: batch rows (a lease, ack, nack
#: or release row may name many samples; dataflow.model._events). An older ledger is
#: migrated when a writer opens it (``Ledger.open(create=True)``).
SCHEMA_VERSION = 4

metadata = MetaData()

#: One row: the schema version this database was written with.
schema_info = Table(
    "dataflow_schema",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),
)

#: One row per run: its current consumer epoch (each append transaction locks its run
#: first: SQLite's one writer; on PostgreSQL an advisory lock, see _postgres).
runs = Table(
    "dataflow_runs",
    metadata,
    Column("run_id", String(256), primary_key=True),
    Column("epoch", Integer, nullable=False),
)

#: The append-only log. ``seq`` is global and orders a run's events (on PostgreSQL the
#: appending transaction's id << 20, plus the event's place in it: see _postgres).
events = Table(
    "dataflow_events",
    metadata,
    Column(
        "seq",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("run_id", String(256), nullable=False),
    Column("kind", String(16), nullable=False),
    # NULL on events of no sample, and on batch rows (their payload names the samples).
    Column("sample_id", String(256)),
    # Set on commits only (0, then 1, 2 ... for regenerations); NULL elsewhere.
    # The partial unique index below is the database's own dedup of commits;
    # lease and ack rows (most of a run) skip it entirely.
    Column("revision", Integer),
    Column("epoch", Integer, nullable=False),
    Column("step", BigInteger),
    Column("actor", String(256), nullable=False),
    Column("payload", Text),
    Column("ts", Float, nullable=False),
)

Index("ix_dataflow_events_run_seq", events.c.run_id, events.c.seq)
Index(
    "ux_dataflow_events_commit",
    events.c.run_id,
    events.c.sample_id,
    events.c.revision,
    unique=True,
    sqlite_where=events.c.revision.isnot(None),
    postgresql_where=events.c.revision.isnot(None),
)

#: Snapshots of a run's fold (dataflow.model._snapshot): derived data, a cache of a
#: replay. A bad or missing one only costs a full replay.
snapshots = Table(
    "dataflow_snapshots",
    metadata,
    Column("run_id", String(256), primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("format", Integer, nullable=False),
    Column("digest", String(64), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("ts", Float, nullable=False),
)

#: One row per producer id of a run: the epoch of the process that holds the id now
#: (its newest CLAIM). Read under the run's lock by every commit and close, which the
#: database refuses from any other epoch: a producer id is held by one process at a time.
producers = Table(
    "dataflow_producers",
    metadata,
    Column("run_id", String(256), primary_key=True),
    Column("producer_id", String(256), primary_key=True),
    Column("epoch", Integer, nullable=False),
)
