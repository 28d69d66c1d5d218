"""A SQLite ledger on a read-only mount (a backup or snapshot, no -wal or -shm beside it).

Before the fix ``dataflow runs``, ``replay`` and ``status`` all exited 1 with "unable to open
database file", though they only read: SQLite's ``mode=rw`` (and even ``mode=ro``) needs a
``-shm`` it can create. The reading commands now open it in SQLite's immutable read-only mode
and say so on stderr; ``Ledger.open(url, read_only=True)`` does the same from Python.

A real read-only mount: a tmpfs of this test's own, the ledger of a real run copied into it
(checkpointed by its close, so no -wal or -shm), then remounted read-only. Needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_cli_inspect import write_crashed_run
from test_cli_subprocess import dataflow, ok

from dataflow import (
    Kind,
    Ledger,
    NotALedgerError,
    Producer,
    ReadOnlyLedgerError,
    replay,
)
from stores import LocalFeatureStore
from tests.conftest import unavailable

SAYS_SO = "is on a read-only file system"


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def _read_only_mount(tmp_path: Path, files: list[Path]) -> Iterator[Path]:
    """A tmpfs of the test's own holding copies of ``files``, remounted read-only."""
    mount = tmp_path / "ro"
    mount.mkdir()
    made = _mount("-t", "tmpfs", "-o", "size=8m", "df-sqlite-ro", str(mount))
    if made.returncode != 0:
        unavailable(f"cannot mount a tmpfs (root needed): {made.stderr.strip()}")
    try:
        for file in files:
            shutil.copy(file, mount / file.name)
        remount = _mount("-o", "remount,ro", str(mount))
        assert remount.returncode == 0, remount.stderr
        assert not os.access(mount, os.W_OK)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def read_only_ledger(tmp_path: Path) -> Iterator[str]:
    """The URL of a finished run's ledger on a read-only tmpfs."""
    write_crashed_run(tmp_path)
    assert not list(tmp_path.glob("ledger.db-*"))  # the close folded the WAL into the file
    with _read_only_mount(tmp_path, [tmp_path / "ledger.db"]) as mount:
        yield f"sqlite:///{mount}/ledger.db"


def test_the_reading_commands_read_a_ledger_on_a_read_only_mount(read_only_ledger: str) -> None:
    runs = dataflow(read_only_ledger, "runs")
    assert ok(runs).split() == ["r1"]
    assert SAYS_SO in runs.stderr and "immutable" in runs.stderr

    verify = dataflow(read_only_ledger, "replay", "--run", "r1", "--verify")
    assert ok(verify).rstrip().endswith("verify: clean")
    assert SAYS_SO in verify.stderr

    status = dataflow(read_only_ledger, "status", "--run", "r1")
    assert ok(status).startswith("run 'r1': 33 events") and "12 committed" in ok(status)

    events = [json.loads(line) for line in ok(dataflow(read_only_ledger, "events", "--run", "r1"))
              .splitlines()]  # fmt: skip
    assert sum(e["kind"] == "commit" for e in events) == 12

    out = Path(read_only_ledger.removeprefix("sqlite:///")).parent.parent / "r1.parquet"
    assert "wrote 43 events of run 'r1'" in ok(
        dataflow(read_only_ledger, "export", "--run", "r1", str(out))
    )

    path = read_only_ledger.removeprefix("sqlite:///")
    assert sorted(os.listdir(os.path.dirname(path))) == ["ledger.db"]


def test_a_ledger_on_a_read_only_mount_opens_read_only_from_python(read_only_ledger: str) -> None:
    with Ledger.open(read_only_ledger, read_only=True) as ledger:
        assert ledger.immutable and ledger.read_only
        assert ledger.runs() == ["r1"]
        assert sum(e.kind == Kind.COMMIT for e in ledger.events("r1")) == 12
        assert replay(ledger, "r1").verify() == []
        with pytest.raises(ReadOnlyLedgerError, match=r"opened read-only.*nothing was written"):
            Producer(ledger, LocalFeatureStore(), run_id="r1", producer_id="p0").emit(
                "late", {"x": torch.zeros(2)}
            )
        with pytest.raises(ReadOnlyLedgerError, match="opened read-only"):
            ledger.save_snapshot("r1", replay(ledger, "r1"))
    # Opened to write, it says why it cannot be, not SQLite's "unable to open database file".
    with pytest.raises(ReadOnlyLedgerError, match=r"read-only file system.*read_only=True"):
        Ledger.open(read_only_ledger)


def test_read_only_on_a_writable_ledger_sees_live_writes_and_writes_nothing(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    with Ledger.open(url) as writer, Ledger.open(url, read_only=True) as reader:
        assert not reader.immutable  # the live ledger, WAL and all: no frozen snapshot
        producer = Producer(writer, LocalFeatureStore(), run_id="r")
        producer.emit("a", {"x": torch.zeros(2)})
        assert [e.sample_id for e in reader.events("r") if e.kind == "commit"] == ["a"]
        with pytest.raises(ReadOnlyLedgerError), reader.write("r", "commit"):
            pass
    with pytest.raises(NotALedgerError, match="no ledger"):
        Ledger.open(f"sqlite:///{tmp_path}/missing.db", read_only=True)
    assert not (tmp_path / "missing.db").exists()


def test_a_snapshot_taken_with_its_wal_on_a_read_only_mount_is_read_with_it(
    tmp_path: Path,
) -> None:
    """-wal and -shm copied beside it (a live ledger's files): mode=ro reads the WAL too."""
    url = f"sqlite:///{tmp_path}/ledger.db"
    with Ledger.open(url) as writer:
        producer = Producer(writer, LocalFeatureStore(), run_id="r")
        for i in range(5):
            producer.emit(f"s{i}", {"x": torch.zeros(2)})
        files = [tmp_path / f"ledger.db{suffix}" for suffix in ("", "-wal", "-shm")]
        with _read_only_mount(tmp_path, files) as mount:
            status = dataflow(f"sqlite:///{mount}/ledger.db", "status", "--run", "r")
            assert "5 committed" in ok(status) and SAYS_SO not in status.stderr
            with Ledger.open(f"sqlite:///{mount}/ledger.db", read_only=True) as reader:
                assert not reader.immutable
                assert [e.sample_id for e in reader.events("r") if e.kind == "commit"] == [
                    f"s{i}" for i in range(5)
                ]
