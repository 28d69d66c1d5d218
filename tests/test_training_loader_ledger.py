"""The loader rides out a ledger that fails for a while (LoaderConfig.ledger_timeout).

A lease or an ack that fails with OperationalError (a SQLite write lock held past the
busy timeout by another real process, a PostgreSQL COMMIT whose outcome is unknown) is
made again, the same call, as docs/reliability.md tells a rank to, until it goes
through or ``ledger_timeout`` runs out: every sample is still handed out once and
acked once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataflow import (
    Consumer,
    InvalidArgumentError,
    Kind,
    Ledger,
    OperationalError,
    Producer,
    replay,
)
from stores import LocalFeatureStore
from training import FeatureLoader, LoaderConfig

RUN = "run"
RETRIED = "making it again"


class _LockHolder:
    """A real process that holds a SQLite ledger's write lock (BEGIN IMMEDIATE) until it
    is told to let go (a line on its stdin) or killed."""

    def __init__(self, path: Path) -> None:
        script = textwrap.dedent(
            f"""
            import sqlite3, sys
            conn = sqlite3.connect({str(path)!r}, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            print("held", flush=True)
            sys.stdin.readline()
            conn.execute("ROLLBACK")
            """
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None and self.process.stdout.readline() == "held\n"

    def release(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        assert self.process.wait(30) == 0

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@pytest.fixture
def sqlite_ledger(tmp_path: Path) -> Iterator[tuple[Ledger, Path]]:
    """A SQLite ledger whose writers wait 0.2 s for the write lock, and its file."""
    path = tmp_path / "ledger.db"
    led = Ledger.open(f"sqlite:///{path}", busy_timeout=0.2)
    yield led, path
    led.close()


def _emit(led: Ledger, store: LocalFeatureStore, count: int) -> list[str]:
    ids = [f"s{i:02d}" for i in range(count)]
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((sid, {"x": torch.full((2,), i)}) for i, sid in enumerate(ids))
    producer.close()
    return ids


def _loader(led: Ledger, store: LocalFeatureStore, **config: object) -> FeatureLoader:
    consumer = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    consumer.resume()
    return FeatureLoader(consumer, config=LoaderConfig(batch_size=2, **config))


def _retried(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if RETRIED in r.getMessage()]


def test_a_lease_refused_while_another_process_holds_the_lock_is_made_again(
    sqlite_ledger, caplog
) -> None:
    led, path = sqlite_ledger
    with LocalFeatureStore() as store:
        ids = _emit(led, store, 4)
        loader = _loader(led, store)
        holder = _LockHolder(path)
        try:
            with caplog.at_level("WARNING", logger="training"):
                # The holder lets go once the loader has failed and logged it.
                caplog.handler.emit = _on_first_retry(caplog.handler.emit, holder.release)
                first = loader.next_batch()
        finally:
            holder.kill()
        second = loader.next_batch()
        assert first.sample_ids + second.sample_ids == ids
        [message] = _retried(caplog)
        assert "lease() of consumer 'trainer'" in message
        assert "LoaderConfig.ledger_timeout" in message and "locked" in message
        loader.ack(first.refs, step=1)
        loader.ack(second.refs, step=2)
        assert loader.next_batch() is None
        loader.close()
        assert replay(led, RUN).verify() == []


def _on_first_retry(emit, then):
    """``emit`` of a log handler that also calls ``then()`` after the first retry's line."""
    done = []

    def emitting(record):
        emit(record)
        if RETRIED in record.getMessage() and not done:
            done.append(True)
            then()

    return emitting


@pytest.mark.parametrize("patience", [0, 0.3])
def test_a_ledger_locked_longer_than_ledger_timeout_raises_with_a_note(
    sqlite_ledger, caplog, patience: float
) -> None:
    led, path = sqlite_ledger
    with LocalFeatureStore() as store:
        _emit(led, store, 2)
        loader = _loader(led, store, ledger_timeout=patience)
        holder = _LockHolder(path)
        try:
            with (
                caplog.at_level("WARNING", logger="training"),
                pytest.raises(OperationalError, match="locked") as raised,
            ):
                loader.next_batch()
        finally:
            holder.kill()
        notes = getattr(raised.value, "__notes__", [])
        expected = (
            "the loader made lease() of consumer 'trainer' again for 0.3s "
            "(LoaderConfig.ledger_timeout) and the ledger did not take it"
        )
        assert (expected in notes) == (patience > 0)
        assert len(_retried(caplog)) == (1 if patience else 0)
        assert [e for e in led.events(RUN) if e.kind == Kind.LEASE] == []  # nothing leased
        loader.close()


def test_an_ack_refused_while_the_lock_is_held_is_made_again(sqlite_ledger, caplog) -> None:
    led, path = sqlite_ledger
    with LocalFeatureStore() as store:
        ids = _emit(led, store, 2)
        loader = _loader(led, store)
        batch = loader.next_batch()
        holder = _LockHolder(path)
        try:
            with caplog.at_level("WARNING", logger="training"):
                caplog.handler.emit = _on_first_retry(caplog.handler.emit, holder.release)
                loader.ack(batch.refs, step=1)
        finally:
            holder.kill()
        [message] = _retried(caplog)
        assert "ack() of consumer 'trainer'" in message
        acked = [s for e in led.events(RUN) if e.kind == Kind.ACK for s in e.sample_ids]
        assert acked == ids
        loader.close()


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "rolled-back"])
def test_a_lease_ahead_with_acks_in_doubt_is_settled_and_each_sample_trained_once(
    ledger, store, producer, emit, failing_commits, unreadable, caplog, landed: bool
) -> None:
    """The loader's thread writes the acks of the steps before with its next lease
    (ack_and_lease); its COMMIT fails with the outcome unknown. The loader makes the same
    call again, which settles it: no sample is acked twice, none is stranded in a lease
    no one holds, and training goes on."""
    ids = [f"s{i:02d}" for i in range(12)]
    emit(*ids)
    producer.close()  # the run ends with these
    consumer = Consumer(ledger, store, run_id="run", consumer_id="trainer")
    consumer.resume()
    loader = FeatureLoader(consumer, config=LoaderConfig(batch_size=2, prefetch=2))
    trained: list[str] = []
    step = 0
    with caplog.at_level("WARNING", logger="training"):
        while (batch := loader.next_batch()) is not None:
            trained += batch.sample_ids
            step += 1
            loader.ack(batch.refs, step=step)
            if step == 2:  # the next lease ahead carries the acks of steps 1 and 2
                failing_commits(1, landed=landed)
                unreadable(consumer)
        loader.flush()
    loader.close()
    assert sorted(trained) == ids and len(trained) == len(ids)
    acked = [s for e in ledger.events("run") if e.kind == Kind.ACK for s in e.sample_ids]
    assert sorted(acked) == ids and len(acked) == len(ids)
    assert any("ack_and_lease() of consumer 'trainer'" in m for m in _retried(caplog))
    assert replay(ledger, "run").verify() == []


@pytest.mark.parametrize(
    ("value", "match"),
    [(-1, "ledger_timeout must be a number of seconds >= 0, got -1"),
     (float("nan"), "got nan"), ("60", "got '60'"), (True, "got True")],
)  # fmt: skip
def test_a_bad_ledger_timeout_is_refused(value: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        LoaderConfig(ledger_timeout=value)  # type: ignore[arg-type]
