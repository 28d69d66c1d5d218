"""PostgreSQL specifics of the ledger: per-run append serialization.

Why every append locks its run's row first: ``seq`` comes from a sequence,
and sequence values are handed out at INSERT time, not at COMMIT time. Two
concurrent transactions can take seq 41 and 42 and commit in the order 42,
41; a reader tailing the run "after seq 41" at the moment between the two
commits would read 42, move its cursor past 41, and never see 41. Taking
``SELECT ... FOR UPDATE`` on the run's row before inserting means a second
writer of the same run waits until the first has committed, so within a run
seq order is commit order and ``follow`` can never skip an event. Runs do not
block each other, and commits batch many events per lock.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url

from dataflow._db import Backend
from dataflow._schema import events, runs

_LOCK_RUN = f"SELECT epoch FROM {runs.name} WHERE run_id = %(run_id)s FOR UPDATE"
# A run's row starts at the newest epoch its events name: 0 for a new run, and the
# epoch it had for a run whose row was deleted (so a live consumer is not fenced off).
_NEW_RUN = (
    f"INSERT INTO {runs.name} (run_id, epoch) SELECT CAST(%(run_id)s AS VARCHAR), "
    f"COALESCE(MAX(epoch), 0) FROM {events.name} "
    "WHERE run_id = CAST(%(run_id)s AS VARCHAR) AND kind = 'resume' "
    "ON CONFLICT (run_id) DO NOTHING"
)


class PostgresBackend(Backend):
    name = "postgresql"

    def create_engine(self, url: str, *, durability: str, busy_timeout_s: float) -> Engine:
        parsed = make_url(url)
        if parsed.get_driver_name() != "psycopg":
            parsed = parsed.set(drivername="postgresql+psycopg")
        synchronous_commit = "on" if durability == "full" else "off"
        return create_engine(
            parsed,
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": max(1, round(busy_timeout_s)),
                # lock_timeout makes busy_timeout bound the wait for a run's
                # lock, as it does on SQLite, instead of waiting forever
                # behind a stuck transaction.
                "options": (
                    f"-c synchronous_commit={synchronous_commit} "
                    f"-c lock_timeout={round(busy_timeout_s * 1000)}"
                ),
            },
        )

    def lock_run(self, conn: Connection, run_id: str) -> int:
        # One round trip when the run exists (every append but its first), as plain
        # driver SQL: building Core statements cost more CPU than the server spent.
        params = {"run_id": run_id}
        epoch = conn.exec_driver_sql(_LOCK_RUN, params).scalar()
        if epoch is None:
            # A writer creating the run at the same moment makes this wait for its
            # commit (the primary key); then both lock the one row.
            conn.exec_driver_sql(_NEW_RUN, params)
            epoch = conn.exec_driver_sql(_LOCK_RUN, params).scalar_one()
        return int(epoch)

    def lock_schema(self, conn: Connection) -> None:
        # Concurrent CREATE TABLE IF NOT EXISTS can still collide in pg_type.
        conn.execute(text("SELECT pg_advisory_xact_lock(7354018)"))
