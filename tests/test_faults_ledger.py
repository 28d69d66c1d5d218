"""The ledger's database failing under a producer: a SQLite file locked by another process,
a PostgreSQL server restarted (``pg_ctl restart``) in the middle of appends.

Real processes only: the lock holder is a second Python process in ``BEGIN EXCLUSIVE``,
the producer a child process, the server a throw-away PostgreSQL cluster of this test's own
(so restarting it disturbs no other test).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, Kind, Ledger, OperationalError, Producer, replay
from dataflow.testing._postgres import PostgresServer
from stores import LocalFeatureStore, SharedDirFeatureStore
from tests import _zygote
from tests.conftest import unavailable
from training import FeatureLoader, LoaderConfig

RUN = "run"

HOLD_EXCLUSIVE = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.read()
    """
)


def _commits(ledger: Ledger) -> list[str]:
    return [e.sample_id for e in ledger.events(RUN) if e.kind == Kind.COMMIT]


def test_a_sqlite_ledger_locked_by_another_process_fails_the_emit_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    with (
        Ledger.open(f"sqlite:///{path}", busy_timeout=0.5) as ledger,
        SharedDirFeatureStore(tmp_path / "store") as store,
    ):
        producer = Producer(ledger, store, run_id=RUN)
        producer.emit("before", {"x": torch.ones(4)})
        events = len(list(ledger.events(RUN)))
        holder = _zygote.Popen(
            [sys.executable, "-c", HOLD_EXCLUSIVE, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            with pytest.raises(OperationalError, match=r"database is locked.*busy_timeout"):
                producer.emit("during", {"x": torch.ones(4)})
            assert len(list(ledger.events(RUN))) == events
            assert [o.sample_id for o in store.scan()] == ["before"]  # its features were deleted
            assert not os.listdir(tmp_path / "store" / "tmp")
        finally:
            holder.send_signal(signal.SIGKILL)  # dies holding the lock: SQLite lets it go
            holder.wait()
        assert producer.emit("during", {"x": torch.ones(4)}) is not None
        assert _commits(ledger) == ["before", "during"]
        assert replay(ledger, RUN).verify() == []


def test_a_writer_waits_for_the_lock_another_process_releases_within_busy_timeout(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    with (
        Ledger.open(f"sqlite:///{path}", busy_timeout=30) as ledger,
        SharedDirFeatureStore(tmp_path / "store") as store,
    ):
        producer = Producer(ledger, store, run_id=RUN)
        producer.emit("before", {"x": torch.ones(4)})
        holder = _zygote.Popen(
            [sys.executable, "-c", HOLD_EXCLUSIVE, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        # The holder lets go (its stdin closes, it exits) while the emit below polls.
        releaser = threading.Timer(0.3, holder.communicate)
        releaser.start()
        try:
            assert producer.emit("during", {"x": torch.ones(4)}) is not None
        finally:
            releaser.join()
            holder.wait()
        assert holder.returncode == 0  # it held the lock to the end: the emit waited for it
        assert _commits(ledger) == ["before", "during"]
        with ledger._engine.connect() as conn:  # the polling left the busy timeout as set
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


PRODUCE = textwrap.dedent(
    """
    import os, sys, time, torch
    from dataflow import Ledger, OperationalError, Producer
    from stores import LocalFeatureStore, SharedDirFeatureStore

    url, root, stop = sys.argv[1:4]
    failures = 0
    with Ledger.open(url, busy_timeout=2) as ledger:
        producer = Producer(ledger, SharedDirFeatureStore(root), run_id="run")
        i = 0
        while not os.path.exists(stop):
            while True:  # retry the same id until it is committed (None: it already was)
                try:
                    producer.emit(f"s-{i}", {"x": torch.full((4,), float(i))})
                    break
                except OperationalError:
                    failures += 1
                    time.sleep(0.05)
            print(i, flush=True)
            i += 1
    print(f"failures {failures}", flush=True)
    """
)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer()
        server.start()
    except (RuntimeError, OSError) as exc:
        unavailable(f"no PostgreSQL server to restart: {exc}")
    try:
        yield server
    finally:
        server.stop()


def _pg_ctl_restart(server: PostgresServer, mode: str) -> None:
    assert server.directory is not None
    as_user: dict[str, object] = {}
    if os.geteuid() == 0:
        import pwd

        account = pwd.getpwnam("postgres")
        as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": [], "cwd": "/"}
    # Output to a log file, not to pipes: the restarted server would hold them open forever.
    subprocess.run(
        [
            str(server.bin_dir / "pg_ctl"),
            "restart",
            "-D",
            str(server.directory / "data"),
            "-m",
            mode,
            "-w",
            "-l",
            str(server.directory / "restart.log"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
        timeout=120,
        **as_user,  # type: ignore[arg-type]
    )


@pytest.mark.postgres
def test_a_postgres_restart_mid_appends_loses_nothing_and_commits_nothing_twice(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    url = own_postgres.create_database("faults")
    Ledger.open(url).close()  # the schema, before the producer races the restarts
    stop = tmp_path / "stop"
    producer = _zygote.Popen(
        [sys.executable, "-c", PRODUCE, url, str(tmp_path / "store"), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert producer.stdout is not None
    try:
        done = -1
        for mode in ("fast", "immediate"):
            target = done + 10
            while done < target:  # a few commits, then the restart lands among the next
                done = int(producer.stdout.readline())
            _pg_ctl_restart(own_postgres, mode)
        target = done + 10
        while done < target:  # and the producer carries on after both
            done = int(producer.stdout.readline())
        stop.touch()
        tail = producer.stdout.read()
        assert producer.wait(timeout=60) == 0
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    emitted = done + 1 + len(tail.splitlines()) - 1
    with Ledger.open(url) as ledger, SharedDirFeatureStore(tmp_path / "store") as store:
        per_sample = collections.Counter(_commits(ledger))
        assert per_sample == {f"s-{i}": 1 for i in range(emitted)}
        run = replay(ledger, RUN)
        assert run.verify() == []
        # Every committed ref's features are stored: no failed append deleted a commit's.
        refs = [run.ref(f"s-{i}") for i in range(emitted)]
        assert all(store.exists(ref) for ref in refs)


def _down(server: PostgresServer) -> bool:
    """Whether nothing answers on the server's port (it stopped, not yet started again)."""
    assert server.port is not None
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", server.port)) != 0


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_loader_rides_out_a_postgres_restart_and_trains_each_sample_once(
    own_postgres: PostgresServer, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server restarts while a FeatureLoader (prefetch, acks with its leases) works
    through the run: its leases and acks fail with OperationalError until the server is
    back, and are made again (LoaderConfig.ledger_timeout); training goes on."""

    url = own_postgres.create_database(f"loader_{mode}")
    ids = [f"s{i:02d}" for i in range(24)]
    with Ledger.open(url) as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id=RUN)
        producer.emit_many((sid, {"x": torch.full((2,), i)}) for i, sid in enumerate(ids))
        producer.close()
        consumer = Consumer(ledger, store, run_id=RUN, consumer_id="trainer")
        consumer.resume()
        loader = FeatureLoader(
            consumer, config=LoaderConfig(batch_size=2, prefetch=2, ledger_timeout=60)
        )
        trained: list[str] = []
        restart = threading.Thread(target=_pg_ctl_restart, args=(own_postgres, mode))
        with caplog.at_level("WARNING", logger="training"):
            while (batch := loader.next_batch()) is not None:
                trained += batch.sample_ids
                loader.ack(batch.refs, step=len(trained) // 2)
                if len(trained) == 6:  # the server goes down before the next lease ahead
                    restart.start()
                    while restart.is_alive() and not _down(own_postgres):
                        restart.join(0.01)
            loader.flush()
        restart.join()
        loader.close()
        assert sorted(trained) == ids  # each once
        assert any("making it again" in r.getMessage() for r in caplog.records)
        acked = [s for e in ledger.events(RUN) if e.kind == Kind.ACK for s in e.sample_ids]
        assert sorted(acked) == ids
        assert replay(ledger, RUN).verify() == []
