"""Producers that batch: emit_many puts through put_many, fsyncs each directory once, and
hands the stream its refs in one send_many.

Real SQLite ledger files, a real shared-directory store on disk, the in-process
stream (whose windows are the ZeroMQ stream's). The fsync counts patch ``os.fsync``
to count its calls: a unit test of our logic, not of the disk.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from dataflow import BackpressureError, Ledger, Producer, SampleRef
from dataflow.interfaces import RefSender
from dataflow.streams import MemoryStream
from stores import SharedDirFeatureStore

RUN = "run"


@pytest.fixture
def led(tmp_path: Path) -> Ledger:
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    yield ledger
    ledger.close()


@pytest.fixture
def shared_dir(tmp_path: Path) -> SharedDirFeatureStore:
    store = SharedDirFeatureStore(tmp_path / "features")
    yield store
    store.close()


def _samples(start: int, count: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    return [(f"s{i}", {"x": torch.full((16,), float(i))}) for i in range(start, start + count)]


def test_emit_many_puts_its_batch_with_one_put_many_and_one_fsync_per_directory(
    led: Ledger, shared_dir: SharedDirFeatureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = Producer(led, shared_dir, run_id=RUN, producer_id="p")
    producer.emit_many(_samples(0, 4))  # some samples exist: the batch below puts the rest
    put_many_calls = []
    put_many = shared_dir.put_many

    def counted_put_many(items):  # type: ignore[no-untyped-def]
        put_many_calls.append(len(items))
        return put_many(items)

    fsynced: list[tuple[bool, int]] = []  # (a directory?, inode) per fsync
    real_fsync = os.fsync

    def counted_fsync(fd: int) -> None:
        info = os.fstat(fd)
        fsynced.append((stat.S_ISDIR(info.st_mode), info.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(shared_dir, "put_many", counted_put_many)
    monkeypatch.setattr(os, "fsync", counted_fsync)
    refs = producer.emit_many(_samples(0, 64))
    monkeypatch.undo()

    assert put_many_calls == [60]  # one call, the ids the ledger lacked
    assert refs[:4] == [None] * 4 and all(ref is not None for ref in refs[4:])
    folders = {os.stat(shared_dir.path_for(sid).parent).st_ino for sid, _ in _samples(4, 60)}
    directories = [inode for is_dir, inode in fsynced if is_dir]
    assert sorted(directories) == sorted(folders)  # each directory once, no other
    assert sum(not is_dir for is_dir, _ in fsynced) == 60  # each file before its rename
    for ref in refs[4:]:
        assert shared_dir.get(ref)["x"][0] == int(ref.sample_id[1:])


def test_a_single_put_still_fsyncs_its_directory(
    shared_dir: SharedDirFeatureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    directories = []
    real_fsync = os.fsync

    def counted_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            directories.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted_fsync)
    shared_dir.put("one", {"x": torch.ones(2)})
    assert directories == [os.stat(shared_dir.path_for("one").parent).st_ino]


def test_a_failing_put_many_leaves_nothing_and_commits_nothing(
    led: Ledger, shared_dir: SharedDirFeatureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = Producer(led, shared_dir, run_id=RUN, producer_id="p")
    links = 0
    real_link = os.link

    def failing_link(src: str, dst: str, **kwargs: object) -> None:
        nonlocal links
        links += 1  # a new sample's file is linked into place
        if links == 5:
            raise OSError(5, "Input/output error")
        real_link(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", failing_link)
    with pytest.raises(OSError, match="Input/output"):
        producer.emit_many(_samples(0, 8))
    monkeypatch.undo()
    assert list(shared_dir.scan()) == []
    assert led.commits(RUN, [sid for sid, _ in _samples(0, 8)]) == {}


class _BatchingSender(RefSender):
    """A stream end whose ``send_many`` takes what the window has room for, as one call,
    and says in BackpressureError's ``sent`` how many it sent (as a batching sender does)."""

    def __init__(self, inner: RefSender, *, tell_sent: bool = True) -> None:
        self.inner = inner
        self.tell_sent = tell_sent
        self.batches: list[int] = []

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        self.inner.send(ref, timeout=timeout)

    def send_many(self, refs: Sequence[SampleRef], *, timeout: float | None = None) -> None:
        self.batches.append(len(refs))
        for sent, ref in enumerate(refs):
            try:
                self.inner.send(ref, timeout=timeout)
            except BackpressureError as exc:
                if self.tell_sent:
                    exc.sent = sent  # type: ignore[attr-defined]
                raise

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("tell_sent", [True, False], ids=["sent-told", "sent-untold"])
def test_the_outbox_sends_a_batch_in_one_send_many_and_keeps_what_the_window_refuses(
    led: Ledger, shared_dir: SharedDirFeatureStore, tell_sent: bool
) -> None:
    stream = MemoryStream(window=8, send_timeout=0.01)
    receiver = stream.receiver(0)
    sender = _BatchingSender(stream.sender("p"), tell_sent=tell_sent)
    producer = Producer(led, shared_dir, run_id=RUN, producer_id="p", stream=sender)
    producer.emit_many(_samples(0, 6))
    assert sender.batches == [6]
    producer.emit_many(_samples(6, 6))  # the window takes 2: 4 wait for credit
    assert sender.batches[1] == 6
    got = receiver.receive(64, timeout=1)
    assert [ref.sample_id for ref in got] == [f"s{i}" for i in range(8)]
    receiver.credit(len(got))
    producer.emit_many(_samples(12, 2))  # first the 4 kept back, then these, in order
    got = receiver.receive(64, timeout=1)
    receiver.credit(len(got))
    ids = [ref.sample_id for ref in got]
    if tell_sent:
        assert ids == [f"s{i}" for i in range(8, 14)]
    else:  # unknown how many went: those sent go again, and a consumer leases each once
        assert ids[-6:] == [f"s{i}" for i in range(8, 14)]
        assert set(ids[:-6]) <= {"s6", "s7"}
    producer.close()
