"""PostgreSQL's append in one round trip: the server-side functions a write transaction calls.

A producer's commit used to be six round trips after BEGIN: the run's lock with the
transaction's id, the producer-epoch check, the insert, the check for seqs above the
insert, and COMMIT (raw psycopg: the insert and COMMIT). Each costs the client a
statement's Python and the server a parse, a plan and a wake-up; on a loaded server
those, not the rows, were most of the gap. Two PL/pgSQL functions, created with the
schema (:func:`install`), fold them into one statement each:

- ``dataflow_lock_run_v1`` takes the run's advisory lock (shared or exclusive), then
  reads the transaction's id, the run's epoch (creating the run's row when it is
  missing) and, when asked, a producer's epoch. It is one statement, and each
  statement inside it takes its own snapshot after the lock was granted: it sees what
  the holders before it committed (a resume's epoch, a producer's claim), as the
  separate statement after the lock did.
- ``dataflow_commit_v1`` is a producer's whole commit: that lock (shared) and
  producer check, then, only if the producer still holds its id, the insert of
  revision 0 of each sample (``ON CONFLICT DO NOTHING`` on the commit index, in
  sample-id order as ``WriteTransaction._numbered`` orders them) and the check for
  seqs above it. It returns what Python decides from: the producer's epoch as held,
  how many rows went in, a seq above the insert.

A producer's transaction on PostgreSQL (``Ledger.write(shared=True)``) therefore takes
its run's lock lazily (``_postgres.LOCK_DEFERRED``): with the first statement that
needs it, which for a commit is ``dataflow_commit_v1``: BEGIN, one call, COMMIT.

The functions are named with a version: a change to one is a new name, so processes
of two dataflow versions on one ledger each call their own. A ledger whose writer
opened it with ``create=False`` before they existed has none; its writers take the
statement-by-statement path (:func:`installed` says which).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from dataflow.model._errors import LedgerError
from dataflow.model._events import Kind
from dataflow.recorder._clock import SERVER_TS
from dataflow.recorder._schema import events, producers, runs
from dataflow.recorder._sql import SEQ_SHIFT

#: Transaction ids whose seqs fit a BIGINT.
MAX_XID = 2 ** (63 - SEQ_SHIFT) - 1
_LOCK_FUNCTION = "dataflow_lock_run_v1"
_COMMIT_FUNCTION = "dataflow_commit_v1"

#: The modes of :func:`lock_run` (see ``_postgres.py``).
SHARED, EXCLUSIVE, CONSUMERS = "shared", "exclusive", "consumers"
#: How long a consumer write waits for the server's horizon before it reads which of
#: the run's writers it waits for from pg_locks (costlier to read, and read less often).
_HORIZON_WAIT_S = 0.05

_LOCK_DDL = f"""
CREATE OR REPLACE FUNCTION {_LOCK_FUNCTION}(
    p_key bigint, p_run_id text, p_mode text, p_producer text
) RETURNS TABLE (xid bigint, run_epoch integer, producer_epoch integer)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_since timestamptz := clock_timestamp();
    v_limit interval := nullif(current_setting('lock_timeout')::interval, interval '0');
    v_low bigint;
    v_xmin bigint;
    v_older bigint;
    v_nap double precision := 0.0001;
BEGIN
    IF p_mode = '{EXCLUSIVE}' THEN
        PERFORM pg_advisory_xact_lock(p_key);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(p_key);
    END IF;
    -- Every statement from here takes its snapshot after the lock was granted. The id
    -- comes after it: a transaction waiting for the lock holds none.
    xid := pg_current_xact_id()::text::bigint;
    IF p_mode = '{CONSUMERS}' THEN
        -- Until every writer of the run with a smaller id has ended: what this one
        -- reads below its own seqs is then final. Such a writer holds the run's lock
        -- (it took the lock before its id) until it ends: the producers, and the
        -- consumer writes, which therefore follow each other in the order of their ids.
        -- Writers that start later hold larger ids: they go on meanwhile, their rows
        -- sort after this one's. First the horizon (every transaction with a smaller
        -- id on the server has ended: one cheap read); past {_HORIZON_WAIT_S} s (a
        -- transaction open elsewhere holds it back) the run's lock holders themselves,
        -- from pg_locks (their 32-bit ids compared modulo 2^32), every 5 ms. No lock is waited for:
        -- nothing can deadlock; lock_timeout bounds the wait as it bounds a lock's.
        v_low := xid & 4294967295;
        LOOP
            SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint INTO v_xmin;
            EXIT WHEN v_xmin >= xid;
            IF clock_timestamp() - v_since > interval '{_HORIZON_WAIT_S} seconds' THEN
                -- Each transaction holds a lock on its own id: pg_locks shows it to
                -- every role (pg_stat_activity's backend_xid, only to some).
                SELECT count(*) INTO v_older
                FROM pg_locks l JOIN pg_locks t ON t.pid = l.pid
                WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                  AND l.database = (SELECT d.oid FROM pg_database d
                                    WHERE d.datname = current_database())
                  AND l.classid = ((p_key >> 32) & 4294967295)::oid
                  AND l.objid = (p_key & 4294967295)::oid
                  AND t.locktype = 'transactionid' AND t.mode = 'ExclusiveLock'
                  AND t.granted
                  AND mod(v_low - t.transactionid::text::bigint + 4294967296, 4294967296)
                      BETWEEN 1 AND 2147483647;
                EXIT WHEN v_older = 0;
                v_nap := greatest(v_nap, 0.005);
            END IF;
            IF v_limit IS NOT NULL AND clock_timestamp() - v_since > v_limit THEN
                RAISE EXCEPTION USING ERRCODE = 'lock_not_available', MESSAGE =
                    'canceling statement due to lock timeout: transaction ' || xid
                    || ' waited for the writers of its run before it to end';
            END IF;
            PERFORM pg_sleep(v_nap);
            v_nap := least(v_nap * 2, 0.002);
        END LOOP;
    END IF;
    SELECT r.epoch INTO run_epoch FROM {runs.name} r WHERE r.run_id = p_run_id;
    IF NOT FOUND THEN
        -- A run whose row was deleted starts at the newest epoch its events name.
        INSERT INTO {runs.name} (run_id, epoch)
        SELECT p_run_id, COALESCE(MAX(e.epoch), 0) FROM {events.name} e
        WHERE e.run_id = p_run_id AND e.kind = '{Kind.RESUME}'
        ON CONFLICT (run_id) DO NOTHING;
        SELECT r.epoch INTO run_epoch FROM {runs.name} r WHERE r.run_id = p_run_id;
    END IF;
    IF p_producer IS NOT NULL THEN
        SELECT p.epoch INTO producer_epoch FROM {producers.name} p
        WHERE p.run_id = p_run_id AND p.producer_id = p_producer;
    END IF;
    RETURN NEXT;
END
$fn$
"""

_COMMIT_DDL = f"""
CREATE OR REPLACE FUNCTION {_COMMIT_FUNCTION}(
    p_key bigint, p_run_id text, p_producer text, p_producer_epoch integer,
    p_actor text, p_epoch integer, p_sample_ids text[], p_payloads text[]
) RETURNS TABLE (xid bigint, producer_epoch integer, inserted integer, seq_above bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_first bigint;
BEGIN
    SELECT l.xid, l.producer_epoch INTO xid, producer_epoch
    FROM {_LOCK_FUNCTION}(p_key, p_run_id, '{SHARED}', p_producer) l;
    inserted := 0;
    IF xid > {MAX_XID}
       OR (p_producer IS NOT NULL AND producer_epoch IS DISTINCT FROM p_producer_epoch) THEN
        RETURN NEXT;  -- fenced, or no seq fits: nothing inserted, Python raises
        RETURN;
    END IF;
    v_first := xid << {SEQ_SHIFT};
    -- Seqs in the given order, rows into the commit index in sample-id order (byte
    -- order, as Python sorts them): two producers never wait on each other in a cycle.
    INSERT INTO {events.name} (seq, run_id, kind, sample_id, revision, epoch, step, actor,
                               payload, ts)
    SELECT v_first + u.o - 1, p_run_id, '{Kind.COMMIT}', u.s, 0, p_epoch, NULL, p_actor, u.p,
           {SERVER_TS["postgresql"]}
    FROM unnest(p_sample_ids, p_payloads) WITH ORDINALITY AS u(s, p, o)
    ORDER BY u.s COLLATE "C"
    ON CONFLICT (run_id, sample_id, revision) WHERE revision IS NOT NULL DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    IF inserted > 0 THEN
        SELECT e.seq INTO seq_above FROM {events.name} e
        WHERE e.run_id = p_run_id AND e.seq >= GREATEST(
            pg_snapshot_xmax(pg_current_snapshot())::text::bigint << {SEQ_SHIFT},
            v_first + {1 << SEQ_SHIFT})
        ORDER BY e.seq DESC LIMIT 1;
    END IF;
    RETURN NEXT;
END
$fn$
"""

_INSTALLED = (
    f"SELECT to_regproc('{_LOCK_FUNCTION}') IS NOT NULL "
    f"AND to_regproc('{_COMMIT_FUNCTION}') IS NOT NULL"
)
_LOCK = (
    f"SELECT xid, run_epoch, producer_epoch FROM {_LOCK_FUNCTION}("
    "%(key)s::bigint, %(run_id)s::text, %(mode)s::text, %(producer)s::text)"
)
_COMMIT = (
    f"SELECT xid, producer_epoch, inserted, seq_above FROM {_COMMIT_FUNCTION}("
    "%(key)s::bigint, %(run_id)s::text, %(producer)s::text, %(producer_epoch)s::integer, "
    "%(actor)s::text, %(epoch)s::integer, %(sample_ids)b::text[], %(payloads)b::text[])"
)


def run_lock_key(run_id: str) -> int:
    """The run's advisory lock key: a stable signed 64-bit hash of its id (two runs that
    share one only wait for each other)."""
    digest = hashlib.blake2b(run_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def installed(conn: Connection) -> bool:
    """Whether the ledger on ``conn`` has this dataflow's append functions."""
    return bool(conn.exec_driver_sql(_INSTALLED).scalar())


def install(conn: Connection) -> None:
    """Create the append functions where they are missing (under the schema lock).

    Only where missing: replacing a function makes every session that cached a plan
    of it plan again.
    """
    if not installed(conn):
        conn.exec_driver_sql(_LOCK_DDL)
        conn.exec_driver_sql(_COMMIT_DDL)


def first_seq(xid: int) -> int:
    """The first seq of the transaction ``xid``; LedgerError once seqs no longer fit."""
    if xid > MAX_XID:
        raise LedgerError(
            f"transaction id {xid} is past {MAX_XID}, the last one whose seqs fit the "
            "ledger's BIGINT seq column: this PostgreSQL server cannot hold a ledger any "
            "more; move the ledger to a new server (dataflow export)"
        )
    return xid << SEQ_SHIFT


def lock_run(
    conn: Connection, run_id: str, *, mode: str, producer: str | None = None
) -> tuple[int, int, int | None]:
    """Lock ``run_id`` for this transaction in one round trip: the transaction's first
    seq, the run's epoch and ``producer``'s epoch (None: not asked, or it holds none).

    ``mode``: SHARED (producers), EXCLUSIVE (alone), or CONSUMERS (shared, once every
    writer of the run with a smaller transaction id has ended: see ``_LOCK_DDL``).
    """
    params = {
        "key": run_lock_key(run_id),
        "run_id": run_id,
        "mode": mode,
        "producer": producer,
    }
    xid, run_epoch, producer_epoch = conn.exec_driver_sql(_LOCK, params).one()
    return first_seq(xid), int(run_epoch), producer_epoch


def commit_first_revisions(
    conn: Connection,
    run_id: str,
    *,
    producer: tuple[str, int] | None,
    actor: str,
    epoch: int,
    sample_ids: Sequence[str],
    payloads: Sequence[str],
) -> tuple[int, int | None, int, int | None]:
    """A producer's commit as the first statement of its transaction (see the module).

    ``producer``: (id, epoch) to check, or None. Returns the transaction's first seq
    (its rows hold ``len(sample_ids)`` seqs from it, inserted or not), the producer's
    epoch as held (None when unchecked or gone), how many rows were inserted (0 when
    fenced), and a seq above the insert, if the run holds one.
    """
    producer_id, producer_epoch = producer if producer is not None else (None, None)
    params: dict[str, Any] = {
        "key": run_lock_key(run_id),
        "run_id": run_id,
        "producer": producer_id,
        "producer_epoch": producer_epoch,
        "actor": actor,
        "epoch": epoch,
        "sample_ids": list(sample_ids),
        "payloads": list(payloads),
    }
    xid, held, inserted, above = conn.exec_driver_sql(_COMMIT, params).one()
    return first_seq(xid), held, inserted, above
