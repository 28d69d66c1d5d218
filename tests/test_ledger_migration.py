"""A schema-3 ledger (one row per sample for every lease, ack, nack and release), written by
dataflow at c05a553, read and appended to by this dataflow (schema 4, batch rows).

The ledger and what c05a553's fold made of it are committed under tests/data/, with the
script that made them (tests/data/make_ledger_v3.py).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, Kind, Ledger, Producer, SchemaVersionError, replay
from dataflow.model._events import row_samples
from stores import LocalFeatureStore
from tests.data.make_ledger_v3 import RUN, plain

DATA = Path(__file__).parent / "data"


@pytest.fixture
def old_ledger(tmp_path: Path) -> Path:
    """A copy of the schema-3 ledger."""
    path = tmp_path / "ledger.db"
    shutil.copyfile(DATA / "ledger_v3.db", path)
    return path


@pytest.fixture
def expected() -> dict:
    return json.loads((DATA / "ledger_v3.json").read_text())


def version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT version FROM dataflow_schema").fetchone()[0]


#: What the fold observes now and the fold of c05a553 did not (empty for its ledger).
NEWER_KEYS = {"excluded": {}}


def as_then(observable: dict) -> dict:
    """``observable`` as the fold of c05a553 saw it: the keys added since must be empty."""
    for key, empty in NEWER_KEYS.items():
        assert observable[key] == empty, key
    return plain({k: v for k, v in observable.items() if k not in NEWER_KEYS})


def test_the_fixture_is_a_schema_3_ledger_of_single_sample_rows(old_ledger: Path) -> None:
    assert version(old_ledger) == 3
    with sqlite3.connect(old_ledger) as db:
        batched = db.execute(
            "SELECT count(*) FROM dataflow_events WHERE sample_id IS NULL "
            "AND kind IN ('lease', 'ack', 'nack', 'release')"
        ).fetchone()[0]
    assert batched == 0


@pytest.mark.parametrize("read_only", [True, False])
def test_an_old_ledger_replays_to_the_state_its_own_dataflow_folded(
    old_ledger: Path, expected: dict, read_only: bool
) -> None:
    with Ledger.open(f"sqlite:///{old_ledger}", read_only=read_only) as ledger:
        assert ledger.schema_version == (3 if read_only else 4)
        state = replay(ledger, RUN)
        assert as_then(state.observable()) == expected["observable"]
        assert state.verify() == expected["verify"] == []
        assert sum(1 for _ in ledger.rows(RUN)) == expected["rows"]
    assert version(old_ledger) == (3 if read_only else 4)  # migrated by a writer's open


def test_a_migrated_ledger_takes_batch_rows_and_folds_both(
    old_ledger: Path, expected: dict
) -> None:
    url = f"sqlite:///{old_ledger}"
    with Ledger.open(url) as ledger, LocalFeatureStore() as store:
        head = ledger.head_seq(RUN)
        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", max_attempts=2)
        assert consumer.rejoin() == ()
        leased = consumer.lease(3)
        consumer.ack(leased[:2], step=4)
        consumer.nack(leased[2:], retryable=False, reason="gone")
        producer = Producer(ledger, store, run_id=RUN, producer_id="p2")
        producer.emit("b6", {"x": torch.tensor([1, 2], dtype=torch.uint8)})
        producer.close()
        new = [row for row in ledger.rows(RUN, after_seq=head)]
        state = replay(ledger, RUN)
        assert state.verify() == []
        consumer.refresh()
        assert consumer.state.observable() == state.observable()
    ids = [r.sample_id for r in leased]
    kinds = [(row[1], row[2], row_samples(row[1], row[2], row[7])) for row in new]
    assert kinds[:3] == [
        (Kind.LEASE, None, ids),
        (Kind.ACK, None, ids[:2]),
        (Kind.NACK, None, ids[2:]),
    ]
    assert (Kind.COMMIT, "b6", ["b6"]) in kinds
    assert {s: state.trained[s] for s in ids[:2]} == dict.fromkeys(ids[:2], 4)
    assert ids[2] in state.dead
    assert "b6" in state.pending
    # What the old rows folded to is untouched by the new ones.
    old = expected["observable"]
    assert {s: state.trained[s] for s in old["trained"]} == old["trained"]
    assert set(old["released"]) <= state.released
    with Ledger.open(url, read_only=True) as ledger:
        assert replay(ledger, RUN).observable() == state.observable()


def test_a_writer_of_an_unmigrated_ledger_writes_single_sample_rows(old_ledger: Path) -> None:
    """Opened with create=False nothing is migrated: the ledger stays schema 3, and what is
    appended is what schema-3 readers read."""
    with (
        Ledger.open(f"sqlite:///{old_ledger}", create=False) as ledger,
        LocalFeatureStore() as store,
    ):
        head = ledger.head_seq(RUN)
        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", max_attempts=2)
        consumer.rejoin()
        leased = consumer.lease(2)
        consumer.ack(leased, step=4)
        rows = list(ledger.rows(RUN, after_seq=head))
        assert replay(ledger, RUN).verify() == []
    assert [(row[1], row[2]) for row in rows] == [
        (Kind.LEASE, leased[0].sample_id),
        (Kind.LEASE, leased[1].sample_id),
        (Kind.ACK, leased[0].sample_id),
        (Kind.ACK, leased[1].sample_id),
    ]
    assert version(old_ledger) == 3


def test_a_ledger_of_a_newer_schema_is_refused(old_ledger: Path) -> None:
    with sqlite3.connect(old_ledger) as db:
        db.execute("UPDATE dataflow_schema SET version = 5")
    with pytest.raises(SchemaVersionError, match="schema version 5, newer than this dataflow's 4"):
        Ledger.open(f"sqlite:///{old_ledger}")


@pytest.mark.postgres
def test_the_same_rows_in_a_schema_3_postgres_ledger_migrate_and_replay_alike(
    postgres_url: str, expected: dict
) -> None:
    """The fixture's tables copied row for row into PostgreSQL (seqs kept), marked schema 3:
    a writer's open migrates it, and it folds as it did in SQLite."""
    from sqlalchemy import create_engine, insert, text

    from dataflow.recorder._schema import events, producers, runs, schema_info

    Ledger.open(postgres_url).close()  # the tables, at schema 4
    engine = create_engine(postgres_url)
    with sqlite3.connect(DATA / "ledger_v3.db") as db, engine.begin() as conn:
        for table in (runs, producers, events):
            columns = [c.name for c in table.columns]
            rows = db.execute(f"SELECT {', '.join(columns)} FROM {table.name}").fetchall()
            conn.execute(insert(table), [dict(zip(columns, row, strict=True)) for row in rows])
        conn.execute(text("SELECT setval(pg_get_serial_sequence('dataflow_events', 'seq'), 1000)"))
        conn.execute(schema_info.update().values(version=3))
    engine.dispose()
    with Ledger.open(postgres_url, read_only=True) as ledger:
        assert ledger.schema_version == 3
        assert as_then(replay(ledger, RUN).observable()) == expected["observable"]
    with Ledger.open(postgres_url) as ledger, LocalFeatureStore() as store:
        assert ledger.schema_version == 4
        state = replay(ledger, RUN)
        assert as_then(state.observable()) == expected["observable"]
        assert state.verify() == []
        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", max_attempts=2)
        consumer.rejoin()
        leased = consumer.lease(2)
        consumer.ack(leased, step=4)
        state = replay(ledger, RUN)
        assert state.verify() == []
        assert {r.sample_id for r in leased} <= set(state.trained)
        assert consumer.state.observable() == state.observable()
