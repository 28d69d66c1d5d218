"""PostgreSQL specifics of the ledger: run locks that let producers append at once, and
seqs that a reader can tail exactly.

Why a seq cannot come from a sequence once appends run concurrently: a sequence
hands out values at INSERT time, not at COMMIT time. Two transactions can take
seq 41 and 42 and commit in the order 42, 41; a reader tailing the run "after
seq 41" at the moment between the two commits would read 42, move its cursor
past 41, and never see 41. (Until issue 37 every append took ``SELECT ... FOR
UPDATE`` on the run's row, which made seq order commit order by serializing
every append of a run.)

So an event's seq is ``(xid << 20) | ordinal`` (``_sql.SEQ_SHIFT``): the id of
the transaction that appends it, which PostgreSQL hands out in time order, then
its place among that transaction's rows. A transaction's rows then sort
together, and a reader outside a write transaction reads only below the
*horizon* ``xmin << 20`` of its statement's snapshot (every transaction with a
smaller id has ended: nothing can still appear below it), as gap-free
notification logs do (``_sql._settled``). What it reads is final; what a
running transaction adds sorts above it.

Each append transaction takes a transaction-scoped advisory lock on its run
(a 64-bit hash of the run id) before it takes its id, in one of three modes
(``_pg_append.py`` has the functions that take them, one statement each):

- producer transactions (``Ledger.write(shared=True)``: commits, closes) take
  it shared, so they run at once; the unique commit index still settles two
  commits of one sample (the second waits for the first, then skips), and a
  producer's epoch is read inside the transaction, after the lock was granted;
  the lock waits for the transaction's first statement (a commit's one call);
- consumer writes (``Ledger.write(consumers=True)``: a lease, an ack, a resume
  ...) take it shared too. Once it holds its id, a consumer write waits until
  every writer of the run with a smaller id has ended: each took the run's lock
  before its id and holds it to its end, producers and consumer writes alike, so
  consumer writes follow each other in the order of their ids, and every row
  below its own seqs is final: the tail it reads (``WriteTransaction.rows_after``,
  which stops below its own seqs) is exact, and producers that started meanwhile
  hold larger ids and sort after it. Consumers decide leases from that tail. The
  wait reads the horizon (every transaction on the server with a smaller id has
  ended); if a transaction open elsewhere holds that back for 50 ms, it reads the
  run's lock holders and their ids from ``pg_locks`` instead;
- every other transaction (a producer's claim, a next revision, an exclusion)
  takes it exclusive: it waits for the producer and consumer transactions in
  flight and blocks new ones until it ends. A producer transaction that
  committed before it had its id before it, and one that starts after it takes
  a larger one; so the tail it reads is exact too, and every row it appends
  sorts after what it read and before what producers commit after it.

The cost: a transaction holding an id anywhere on the server (any database)
holds every reader's horizon back, not its writers, until it ends (a consumer
write, 50 ms, then it reads ``pg_locks``); a client that died inside one is ended
after
``idle_in_transaction_session_timeout`` (:func:`connect_args`).
docs/reliability.md ("Readers and long transactions") says what to watch.

No deadlock between the modes: a transaction takes its run's lock first,
holding nothing else and no id (the id comes after the lock), and a producer
holding the lock shared waits only on other producers of the run (a row of the
runs table they create, keys of the commit index, which each inserts in
sample-id order), never on a consumer write or an exclusive holder. A consumer
write waits (polling, no lock) only for smaller ids, which never wait for it.
``lock_timeout`` bounds every wait, the advisory lock's and a consumer write's
(SQLSTATE 55P03: ``translate_errors`` says "held the ledger's write lock for
longer than busy_timeout", as before).
"""

from __future__ import annotations

import math

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url

from dataflow.model._errors import SchemaVersionError
from dataflow.recorder import _pg_append
from dataflow.recorder._db import Backend
from dataflow.recorder._pg_append import run_lock_key
from dataflow.recorder._schema import events, runs
from dataflow.recorder._sql import LOCK_DEFERRED, SEQ_SHIFT

_XID = "pg_current_xact_id()::text::bigint"
_EPOCH = f"(SELECT epoch FROM {runs.name} WHERE run_id = %(run_id)s)"
_LOCK_EXCLUSIVE = "SELECT pg_advisory_xact_lock(%(key)s)"
# After the lock, in a statement of its own: its snapshot then shows what the
# transactions that held the lock before committed (a resume's epoch).
_XID_AND_EPOCH = f"SELECT {_XID}, {_EPOCH}"
# One round trip for a producer: the subquery (OFFSET 0 keeps it one) takes the lock
# before the outer row takes the transaction's id. The epoch is the statement's
# snapshot's, taken before any wait for the lock: producers do not read it.
_LOCK_SHARED = (
    f"SELECT {_XID}, {_EPOCH} FROM "
    "(SELECT pg_advisory_xact_lock_shared(%(key)s) OFFSET 0) AS locked"
)
_RUN_EPOCH = f"SELECT epoch FROM {runs.name} WHERE run_id = %(run_id)s"
# The values a sequence gave (ledgers written before issue 37) against the first seq a
# new transaction can take.
_SEQUENCE_AND_FIRST_SEQ = (
    f"SELECT pg_sequence_last_value(pg_get_serial_sequence('{events.name}', 'seq')), "
    f"pg_snapshot_xmax(pg_current_snapshot())::text::bigint << {SEQ_SHIFT}"
)
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
    #: Whether the ledger has the append functions of ``_pg_append``; None: not yet read.
    _functions: bool | None = None

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

    def lock_run(
        self, conn: Connection, run_id: str, *, shared: bool = False, consumers: bool = False
    ) -> tuple[int, int]:
        if self._functions is None:  # once per ledger: it was made before them or not
            self._functions = _pg_append.installed(conn)
        if not self._functions:  # a consumer write then holds the lock alone, as it did
            return self._lock_run_by_statements(conn, run_id, shared=shared)
        if shared:  # taken by the transaction's first statement (_pg_append)
            return 0, LOCK_DEFERRED
        mode = _pg_append.CONSUMERS if consumers else _pg_append.EXCLUSIVE
        first, epoch, _ = _pg_append.lock_run(conn, run_id, mode=mode)
        return epoch, first

    def _lock_run_by_statements(
        self, conn: Connection, run_id: str, *, shared: bool
    ) -> tuple[int, int]:
        """``lock_run`` on a ledger without the append functions (made by an older
        dataflow and opened with ``create=False``): a round trip per step."""
        # Plain driver SQL: building Core statements cost more CPU than the server spent.
        params = {"run_id": run_id, "key": run_lock_key(run_id)}
        if shared:
            xid, epoch = conn.exec_driver_sql(_LOCK_SHARED, params).one()
        else:
            conn.exec_driver_sql(_LOCK_EXCLUSIVE, params)
            xid, epoch = conn.exec_driver_sql(_XID_AND_EPOCH, params).one()
        if epoch is None:
            # A writer creating the run at the same moment makes this wait for its commit
            # (the primary key). Both hold the lock shared then (an exclusive holder is
            # alone), and the one waited for waits on nothing this one holds.
            conn.exec_driver_sql(_NEW_RUN, params)
            epoch = conn.exec_driver_sql(_RUN_EPOCH, params).scalar_one()
        return int(epoch), _pg_append.first_seq(xid)

    def check_seqs(self, conn: Connection) -> None:
        # A ledger written before issue 37 holds seqs from a sequence: new ones must
        # sort after them, which they do unless that ledger averaged 2**20 events per
        # transaction.
        given, first = conn.exec_driver_sql(_SEQUENCE_AND_FIRST_SEQ).one()
        if given is not None and given >= first:
            raise SchemaVersionError(
                f"the ledger's events hold seqs up to {given} from the sequence of an older "
                f"dataflow, at or above {first}, the first seq this dataflow would give a new "
                "event: new events would sort before them, where a live fold never reads "
                "them. Export the runs (dataflow export) into a new ledger"
            )

    def lock_schema(self, conn: Connection) -> None:
        # Concurrent CREATE TABLE IF NOT EXISTS can still collide in pg_type.
        conn.execute(text("SELECT pg_advisory_xact_lock(7354018)"))
        # Under that lock, with the tables (a PL/pgSQL body names tables it need not
        # find yet): what a writer that opens the ledger may create, it creates here.
        _pg_append.install(conn)
