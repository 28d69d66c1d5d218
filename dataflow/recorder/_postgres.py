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

import math

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url

from dataflow.recorder._db import Backend
from dataflow.recorder._schema import events, runs

_LOCK_RUN = f"SELECT epoch FROM {runs.name} WHERE run_id = %(run_id)s FOR UPDATE"
# A run's row starts at the newest epoch its events name: 0 for a new run, and the
# epoch it had for a run whose row was deleted (so a live consumer is not fenced off).
_NEW_RUN = (
    f"INSERT INTO {runs.name} (run_id, epoch) SELECT CAST(%(run_id)s AS VARCHAR), "
    f"COALESCE(MAX(epoch), 0) FROM {events.name} "
    "WHERE run_id = CAST(%(run_id)s AS VARCHAR) AND kind = 'resume' "
    "ON CONFLICT (run_id) DO NOTHING"
)
_PROBES = 4
_MIN_DEAD_PEER_S = 2.0  # also libpq's least connect_timeout
_MAX_INT = 2**31 - 1
_MAX_KEEPALIVE_S = 32767  # Linux refuses longer keepalive times and intervals


def dead_peer_s(busy_timeout_s: float) -> float:
    """How long a session may stay silent or idle in a transaction before it is given up.

    ``busy_timeout`` already bounds how long a writer waits for a run's lock, so a
    holder silent for longer has made others fail: its session is ended then, and
    the lock goes with it. At least two seconds, so that a tiny busy_timeout does
    not end a healthy session that a loaded machine keeps between two statements.
    """
    return max(busy_timeout_s, _MIN_DEAD_PEER_S)


def connect_args(busy_timeout_s: float, *, synchronous_commit: str) -> dict[str, object]:
    """libpq parameters and per-session settings that bound every wait on the server or link.

    With D = :func:`dead_peer_s` and B = busy_timeout (docs/reliability.md, "Timeouts"):

    - server side, per session: ``lock_timeout`` B (a writer's wait for a run's lock),
      ``statement_timeout`` B + D, ``idle_in_transaction_session_timeout`` D (a client
      that died inside a transaction, the run's lock held), and TCP keepalives and
      ``tcp_user_timeout`` D, so the server drops a peer that vanished without a FIN
      and rolls back what it held;
    - client side (libpq): the same keepalives and ``tcp_user_timeout``, so a query or
      reply lost on a silent link fails after about D instead of the kernel's 15
      minutes, and ``connect_timeout`` D for a new connection.
    """
    dead = dead_peer_s(busy_timeout_s)
    dead_ms = _ms(dead)
    # Probes every quarter of D; tcp_user_timeout then ends the connection at the first
    # unanswered probe past D (Linux), and without it four unanswered probes end it.
    probe_s = min(max(1, math.ceil(dead / 4)), _MAX_KEEPALIVE_S)
    session = {
        "synchronous_commit": synchronous_commit,
        "lock_timeout": _ms(busy_timeout_s),
        "statement_timeout": _ms(busy_timeout_s + dead),
        "idle_in_transaction_session_timeout": dead_ms,
        "tcp_keepalives_idle": probe_s,
        "tcp_keepalives_interval": probe_s,
        "tcp_keepalives_count": _PROBES,
        "tcp_user_timeout": dead_ms,
    }
    return {
        "connect_timeout": math.ceil(dead),
        "keepalives": 1,
        "keepalives_idle": probe_s,
        "keepalives_interval": probe_s,
        "keepalives_count": _PROBES,
        "tcp_user_timeout": dead_ms,
        "options": " ".join(f"-c {name}={value}" for name, value in session.items()),
    }


def _ms(seconds: float) -> int:
    """``seconds`` in whole milliseconds, at most what PostgreSQL's settings and the
    socket's TCP_USER_TIMEOUT take (a C int): a huge busy_timeout means "no bound"."""
    return min(math.ceil(seconds * 1000), _MAX_INT)


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
            connect_args=connect_args(busy_timeout_s, synchronous_commit=synchronous_commit),
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
