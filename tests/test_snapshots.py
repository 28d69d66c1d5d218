"""Snapshots: a restart or a replay folds the newest valid snapshot plus the tail of the log.

On both ledger backends. The property harness (tests/test_property_ledger.py) checks
snapshot + tail against full replays after every rule; here: a run with every kind of
event cut at every seq, what a restarted consumer starts from, damaged and foreign
snapshots (a full replay, with a warning), retention, and the migration of a
version-1 ledger.
"""

from __future__ import annotations

import re
import sqlite3
import struct
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from sqlalchemy import delete, select, update

from dataflow import (
    Consumer,
    Ledger,
    Producer,
    replay,
)
from dataflow.model import _snapshot
from dataflow.recorder._schema import SCHEMA_VERSION, events, producers, schema_info, snapshots
from stores import LocalFeatureStore
from tests._paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


def _busy_run(ledger: Ledger, store, run_id: str) -> None:
    """A run with commits, leases, acks, nacks, a death, a loss, a regeneration, releases,
    checkpoints, a removed checkpoint, a data epoch and a resume from an older checkpoint."""
    producer = Producer(ledger, store, run_id=run_id)
    producer.emit_many((f"s{i}", _features(f"s{i}")) for i in range(12))
    producer.close()
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="a", max_attempts=2)
    cons.snapshot_every = None
    cons.resume()
    refs = cons.lease(6)
    cons.ack(refs[:3], step=1)
    cons.nack([refs[3]], reason="oom")
    cons.nack([refs[4]], retryable=False, reason="bad sample")
    cons.lost([refs[5]], reason="store restarted")
    first = cons.checkpoint(1, ckpt(1))
    producer = Producer(ledger, store, run_id=run_id)  # a closed producer started again
    producer.regenerate(refs[5].sample_id, _features(refs[5].sample_id))
    more = cons.lease(4)
    cons.ack(more, step=2)
    cons.checkpoint(2, ckpt(2))
    cons.remove_checkpoints([first], reason="retention")
    cons.start_data_epoch(seed=7)
    cons.ack(cons.lease(3), step=3)
    cons.checkpoint(3, ckpt(3))
    again = Consumer(ledger, store, run_id=run_id, consumer_id="b", max_attempts=2)
    again.snapshot_every = None
    again.resume(2)  # an older checkpoint: the acks of step 3 are void
    again.ack(again.lease(2), step=3)


def test_snapshot_plus_tail_equals_the_full_fold_at_every_cut(ledger, store, run_id):
    _busy_run(ledger, store, run_id)
    full = replay(ledger, run_id, snapshots=False)
    assert full.verify() == [] and full.plans and full.removed_checkpoints
    # Each event's seq (SQLite's are 1 to the head; PostgreSQL's are transaction ids << 20).
    for cut in [row[0] for row in ledger.rows(run_id)]:
        at_cut = replay(ledger, run_id, upto_seq=cut, snapshots=False)
        restored = _snapshot.decode(run_id, _snapshot.encode(at_cut), ref_source=ledger)
        assert _snapshot._dump(restored) == _snapshot._dump(at_cut), f"round trip at seq {cut}"
        restored.apply_rows(ledger.rows(run_id, after_seq=cut))
        assert _snapshot._dump(restored) == _snapshot._dump(full), f"tail after seq {cut}"
        assert restored.snapshot() == full.snapshot() and restored.plans == full.plans
        assert {s: restored.ref(s) for s in restored.committed} == dict(full.committed)


def test_a_restarted_consumer_starts_from_the_newest_snapshot(ledger, store, run_id, emit):
    emit(*(f"s{i}" for i in range(10)))
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="t")
    cons.snapshot_every = 5
    cons.resume()
    cons.ack(cons.lease(4), step=1)
    cons.checkpoint(1, ckpt(1))  # 10 commits + resume + 8 leases and acks + ...: snapshotted
    taken = cons._snapshot_seq
    assert taken == ledger.head_seq(run_id)
    cons.ack(cons.lease(2), step=2)  # the tail after the snapshot

    restarted = Consumer(ledger, store, run_id=run_id, consumer_id="t")
    plan = restarted.resume()
    assert restarted._snapshot_seq == taken  # started from it, folded only what came after
    assert plan.checkpoint_step == 1 and len(plan.requeued) == 6
    full = replay(ledger, run_id, snapshots=False)
    assert _snapshot._dump(restarted.state) == _snapshot._dump(full)
    reads = []
    read = ledger.commit_payloads
    ledger.commit_payloads = lambda *a: reads.append(a) or read(*a)  # type: ignore[method-assign]
    leased = restarted.lease(6)  # refs of a restored state come from the ledger
    del ledger.commit_payloads
    assert len(reads) == 1  # in one read, not one per ref
    assert [r.sample_id for r in leased] == list(plan.requeued)
    assert all(store.get(r)["x"].tolist() == list(r.sample_id.encode()) for r in leased)
    restarted.ack(leased, step=2)
    assert replay(ledger, run_id).verify() == []


def test_only_the_newest_snapshots_are_kept(ledger, store, run_id, emit):
    emit("a", "b", "c")
    state = replay(ledger, run_id)
    seqs = []
    for sid in "def":
        emit(sid)
        state = replay(ledger, run_id, snapshots=False)
        assert ledger.save_snapshot(run_id, state, keep=2)
        seqs.append(state.head_seq)
    assert not ledger.save_snapshot(run_id, state)  # one per seq
    with ledger._engine.connect() as conn:
        kept = conn.execute(select(snapshots.c.seq).order_by(snapshots.c.seq)).scalars().all()
    assert kept == seqs[-2:]
    assert ledger.load_snapshot(run_id).head_seq == seqs[-1]
    assert ledger.load_snapshot(run_id, upto_seq=seqs[-1] - 1).head_seq == seqs[-2]
    assert ledger.load_snapshot(run_id, upto_seq=seqs[-2] - 1) is None
    assert ledger.load_snapshot("another-run") is None


def _damage(ledger: Ledger, run_id: str, **values: object) -> None:
    with ledger._engine.begin() as conn:
        conn.execute(update(snapshots).where(snapshots.c.run_id == run_id).values(**values))


def _signed(body: bytes) -> dict[str, object]:
    return {"body": body, "digest": _snapshot.digest(body)}


def _segment(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize(
    "damage, why",
    [
        ({"body": b"\x00" * 40}, "digest does not match"),
        ({"body": b"not zlib", "digest": _snapshot.digest(b"not zlib")}, "cannot be read"),
        (  # a segment that claims more bytes than the body holds
            {
                "body": b"DFSNAP01\xff\x00\x00\x00\x00\x00\x00\x00xx",
                "digest": _snapshot.digest(b"DFSNAP01\xff\x00\x00\x00\x00\x00\x00\x00xx"),
            },
            "runs past the end",
        ),
        # digests that match bodies a writer bug could leave: a cut length prefix, and a
        # header that is JSON but no object
        (_signed(b"DFSNAP01\x01\x02\x03"), r"cannot be read \(error"),
        (_signed(b"DFSNAP01" + _segment(zlib.compress(b"[1, 2]"))), "AttributeError"),
    ],
)
def test_a_damaged_snapshot_falls_back_to_the_full_replay_with_a_warning(
    ledger, store, run_id, emit, damage, why
):
    emit("a", "b")
    ledger.save_snapshot(run_id, replay(ledger, run_id))
    emit("c")
    _damage(ledger, run_id, **damage)
    with pytest.warns(UserWarning, match=why):
        state = replay(ledger, run_id)
    assert list(state.committed) == ["a", "b", "c"] and state.verify() == []
    with pytest.warns(UserWarning, match=why):
        cons = Consumer(ledger, store, run_id=run_id, consumer_id="t")
        cons.resume()
    assert [r.sample_id for r in cons.lease(3)] == ["a", "b", "c"]


def test_a_snapshot_that_decodes_but_covers_another_seq_is_refused(ledger, run_id, emit):
    emit("a")
    early = replay(ledger, run_id)
    emit("b")
    body = _snapshot.encode(early)
    ledger.save_snapshot(run_id, replay(ledger, run_id))
    _damage(ledger, run_id, body=body, digest=_snapshot.digest(body))
    with pytest.warns(UserWarning, match="covers seq"):
        assert ledger.load_snapshot(run_id) is None


def test_a_snapshot_of_another_format_is_skipped_quietly(ledger, run_id, emit):
    emit("a")
    ledger.save_snapshot(run_id, replay(ledger, run_id))
    _damage(ledger, run_id, format=_snapshot.FORMAT + 1)  # written by a newer dataflow
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ledger.load_snapshot(run_id) is None
        assert list(replay(ledger, run_id).committed) == ["a"]


def test_bad_input_to_snapshots_is_refused(ledger, run_id, emit):
    emit("a")
    state = replay(ledger, run_id)
    with pytest.raises(ValueError, match="of run 'run', not 'other'"):
        ledger.save_snapshot("other", state)
    for keep in (0, -1, 2.5, "2", True, None):
        with pytest.raises(ValueError, match=f"keep must be an int >= 1 .*got {keep!r}"):
            ledger.save_snapshot(run_id, state, keep=keep)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state must be a RunState, got NoneType"):
        ledger.save_snapshot(run_id, None)  # type: ignore[arg-type]
    assert ledger.load_snapshot(run_id) is None  # nothing was saved
    with pytest.raises(ValueError, match="upto_seq"):
        ledger.load_snapshot(run_id, upto_seq=-1)
    with pytest.raises(TypeError, match="snapshots must be a bool"):
        replay(ledger, run_id, snapshots="yes")  # type: ignore[arg-type]


def _as_version_1(path: Path) -> None:
    """Turn a ledger file into one a dataflow of schema version 1 wrote."""
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP TABLE dataflow_snapshots")
        conn.execute("UPDATE dataflow_schema SET version = 1")
    conn.close()


def test_a_version_1_ledger_is_migrated_by_a_writer_and_read_as_is_by_a_reader(tmp_path, store):
    path = tmp_path / "v1.db"
    led = Ledger.open(f"sqlite:///{path}")
    Producer(led, store, run_id="r").emit_many((s, _features(s)) for s in "ab")
    led.close()
    _as_version_1(path)

    reader = Ledger.open(f"sqlite:///{path}", create=False)  # read-only: nothing changes
    state = replay(reader, "r")
    assert list(state.committed) == ["a", "b"]
    assert reader.save_snapshot("r", state) is False and reader.load_snapshot("r") is None
    reader.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT version FROM dataflow_schema").fetchall() == [(1,)]
    conn.close()

    writer = Ledger.open(f"sqlite:///{path}")  # a writer migrates, in one transaction
    with writer._engine.connect() as conn:
        assert conn.execute(select(schema_info.c.version)).scalar() == SCHEMA_VERSION == 4
    assert writer.save_snapshot("r", replay(writer, "r"))
    assert list(writer.load_snapshot("r").committed) == ["a", "b"]
    writer.close()


def test_a_postgres_ledger_of_version_1_is_migrated(postgres_url, store):
    led = Ledger.open(postgres_url)
    Producer(led, store, run_id="r").emit_many((s, _features(s)) for s in "ab")
    with led._engine.begin() as conn:
        snapshots.drop(conn)
        producers.drop(conn)  # and the claims: a version 1 ledger has neither
        conn.execute(delete(events).where(events.c.kind == "claim"))
        conn.execute(update(events).values(epoch=0))  # commits before producer epochs
        conn.execute(update(schema_info).values(version=1))
    led.close()
    led = Ledger.open(postgres_url)
    with led._engine.connect() as conn:
        assert conn.execute(select(schema_info.c.version)).scalar() == SCHEMA_VERSION == 4
    assert led.save_snapshot("r", replay(led, "r"))
    assert list(replay(led, "r").committed) == ["a", "b"]
    Producer(led, store, run_id="r").emit("c", _features("c"))  # the producers table is back
    state = replay(led, "r")
    assert list(state.committed) == ["a", "b", "c"] and state.verify() == []
    led.close()


@pytest.mark.parametrize(
    ("every", "error", "says"),
    [
        ("100", TypeError, "snapshot_every must be an int, got str '100'"),
        (True, TypeError, "got bool True"),
        (1.5, TypeError, "got float 1.5"),
        (0, ValueError, "snapshot_every must be >= 1, got 0"),
        (-5, ValueError, "got -5"),
        (2**64, ValueError, "must fit in 64 bits"),
    ],
)
def test_a_bad_snapshot_every_is_refused_when_set(tmp_path: Path, every, error, says) -> None:
    # It was taken as it came, and the first checkpoint after raised a TypeError of its
    # own, with the checkpoint already recorded.
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    cons = Consumer(led, LocalFeatureStore(), run_id="r", consumer_id="a")
    with pytest.raises(error, match=re.escape(says)):
        cons.snapshot_every = every
    assert cons.snapshot_every == 50_000
    cons.snapshot_every = None
    assert cons.snapshot_every is None
    cons.snapshot_every = 7
    assert cons.snapshot_every == 7 and Consumer.snapshot_every.__doc__
