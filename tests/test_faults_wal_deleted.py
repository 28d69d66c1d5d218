"""A SQLite ledger's -wal and -shm deleted (or its file replaced) while processes hold it open.

SQLite keeps what was committed since the last checkpoint in ``ledger.db-wal`` and finds it
through ``ledger.db-shm``. Before the fix, a process B that opened the ledger after both were
deleted under a process A made new ones and committed 40 samples into them; A's clean close
then folded A's own (deleted) WAL into the database and unlinked B's by path: every emit had
returned normally and all 40 commits and B's close were gone, with ``verify`` clean. Now B's
open is refused, and a write through a connection whose files were deleted raises.

Real processes only: each holder is a child Python process driven line by line on its stdin.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataflow import Kind, Ledger, LedgerFilesReplacedError, Producer, replay
from stores import SharedDirFeatureStore
from tests import _zygote

RUN = "run"

#: Opens the ledger, then runs "emit PREFIX COUNT" and "close" from stdin; prints one line
#: per emit ("ok ID" or "err TYPE: MESSAGE", stopping at the first error).
HOLDER = textwrap.dedent(
    """
    import sys, torch
    from dataflow import Ledger, Producer
    from stores import SharedDirFeatureStore

    path, store_dir, producer_id = sys.argv[1:]
    try:
        ledger = Ledger.open(f"sqlite:///{path}")
        producer = Producer(ledger, SharedDirFeatureStore(store_dir), run_id="run",
                            producer_id=producer_id)
    except Exception as exc:
        print(f"err {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print("open", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "emit":
            prefix, count = args[0], int(args[1])
            for i in range(count):
                try:
                    producer.emit(f"{prefix}{i}", {"x": torch.ones(2)})
                except Exception as exc:
                    print(f"err {type(exc).__name__}: {exc}", flush=True)
                    break
                print(f"ok {prefix}{i}", flush=True)
            print("done", flush=True)
        elif command == "close":
            try:
                producer.close()
            except Exception as exc:
                print(f"err {type(exc).__name__}: {exc}", flush=True)
            ledger.close()
            print("closed", flush=True)
            break
    """
)


class Holder:
    """A child process holding the ledger open."""

    def __init__(self, tmp_path: Path, producer_id: str) -> None:
        # forked from the test zygote: a process of its own, without torch imported anew
        self.proc = _zygote.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path / "ledger.db"), str(tmp_path / "store"),
             producer_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []

    def read_until(self, *ends: str) -> list[str]:
        assert self.proc.stdout is not None
        got = []
        while True:
            line = self.proc.stdout.readline().strip()
            got.append(line)
            if not line or line.split(" ", 1)[0] in ends:
                self.lines += got
                return got

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def emit(self, prefix: str, count: int) -> list[str]:
        self.send(f"emit {prefix} {count}")
        return self.read_until("done")

    def acknowledged(self) -> set[str]:
        """The samples whose emit returned normally."""
        return {line.split()[1] for line in self.lines if line.startswith("ok ")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def _start(holders: list[Holder], tmp_path: Path, producer_id: str) -> Holder:
    holder = Holder(tmp_path, producer_id)
    holders.append(holder)
    return holder


def _delete_wal(path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        os.unlink(f"{path}{suffix}")


def _checkpoint(path: Path) -> None:
    """Fold the WAL into the database file, so that it alone holds every commit so far."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()[0] == 0  # not busy
    finally:
        conn.close()


def _committed(path: Path) -> set[str]:
    with Ledger.open(f"sqlite:///{path}", create=False) as ledger:
        assert replay(ledger, RUN).verify() == []
        return {e.sample_id for e in ledger.events(RUN) if e.kind == Kind.COMMIT}


def test_a_process_opening_the_ledger_after_its_wal_was_deleted_under_another_is_refused(
    tmp_path: Path, holders: list[Holder]
) -> None:
    path = tmp_path / "ledger.db"
    a = _start(holders, tmp_path, "a")
    assert a.read_until("open", "err") == ["open"]
    assert a.emit("a", 1) == ["ok a0", "done"]
    _delete_wal(path)

    b = _start(holders, tmp_path, "b")
    b_said = b.read_until("open", "err")
    if b_said == ["open"]:  # the code before the fix opened it: B emits its 40 samples
        b_said += b.emit("b", 40)
        b.send("close")
        b.read_until("closed")
    b.proc.wait(timeout=60)
    a_said = a.emit("a-after", 1)
    a.send("close")
    a.read_until("closed")
    assert a.proc.wait(timeout=60) == 0

    # Nothing acknowledged is lost: A's clean close folded its own WAL into the database.
    committed = _committed(path)
    lost = sorted((a.acknowledged() | b.acknowledged()) - committed)
    assert not lost, f"{len(lost)} emits returned normally but are not in the ledger: {lost}"
    assert "a0" in committed
    # ... because B was refused, and A's own files are gone: its next write raised.
    assert any("LedgerFilesReplacedError" in line and "deleted" in line for line in b_said), (
        f"B was not refused: {b_said[:3]} ... {b_said[-3:]}"
    )
    assert b.proc.returncode != 0 and not b.acknowledged()
    assert a_said[0].startswith("err LedgerFilesReplacedError:"), a_said


def test_processes_holding_the_ledger_when_its_wal_is_deleted_cannot_write(
    tmp_path: Path, holders: list[Holder]
) -> None:
    """Their commits would go to deleted files: a crash then loses them though emit returned."""
    path = tmp_path / "ledger.db"
    a, b = _start(holders, tmp_path, "a"), _start(holders, tmp_path, "b")
    for holder, prefix in ((a, "a"), (b, "b")):
        assert holder.read_until("open", "err") == ["open"]
        assert holder.emit(prefix, 1)[0] == f"ok {prefix}0"
    _checkpoint(path)
    _delete_wal(path)

    for holder, prefix in ((a, "a-after"), (b, "b-after")):
        said = holder.emit(prefix, 20)
        assert said[0].startswith("err LedgerFilesReplacedError:"), said[:3]
        assert "was deleted while this connection had it open" in said[0]
    for holder in (a, b):
        holder.stop()  # SIGKILL: whatever only the deleted WAL held is gone now

    committed = _committed(path)
    assert {"a0", "b0"} <= committed
    assert a.acknowledged() | b.acknowledged() <= committed


def test_a_ledger_file_replaced_while_open_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with (
        Ledger.open(f"sqlite:///{path}") as ledger,
        SharedDirFeatureStore(tmp_path / "store") as store,
    ):
        producer = Producer(ledger, store, run_id=RUN)
        producer.emit("before", {"x": torch.ones(2)})
        _checkpoint(path)
        shutil.copy(path, tmp_path / "copy.db")
        os.replace(tmp_path / "copy.db", path)  # e.g. a backup restored over a live ledger
        with pytest.raises(LedgerFilesReplacedError, match=r"ledger\.db was replaced"):
            producer.emit("after", {"x": torch.ones(2)})


def test_files_sqlite_itself_removes_and_makes_again_are_no_fault(tmp_path: Path) -> None:
    """The last connection to close removes the -wal and -shm; the next makes new ones."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    with SharedDirFeatureStore(tmp_path / "store") as store:
        first, second = Ledger.open(url), Ledger.open(url)
        Producer(first, store, run_id=RUN, producer_id="p1").emit("a", {"x": torch.ones(2)})
        Producer(second, store, run_id=RUN, producer_id="p2").emit("b", {"x": torch.ones(2)})
        first.close()
        second.close()  # the last: folds the WAL into the file and removes both
        assert not list(tmp_path.glob("ledger.db-*"))
        for n, ledger in enumerate((first, second, first)):  # closed ledgers connect again
            Producer(ledger, store, run_id=RUN, producer_id=f"q{n}").emit(
                f"c{n}", {"x": torch.ones(2)}
            )
        first.close()
        second.close()
    assert _committed(path) == {"a", "b", "c0", "c1", "c2"}
