"""`dataflow gc` and `collect_garbage` on a real SQLite ledger and a real shared directory.

The store holds what a run left behind: a put whose producer died before the commit,
features the release policy freed whose delete never happened, and a fresh put whose
commit may still come. Only the first two go; live features and young puts stay.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, GcReport, Ledger, Producer, collect_garbage, replay
from stores import SharedDirFeatureStore
from tests._zygote import run_cli  # forked warm: the store's module imports torch

RUN = "run"
HOUR = 3600.0


class _DeleteFails(SharedDirFeatureStore):
    """A trainer's store handle whose deletes never happen (a crash after the release)."""

    def _delete(self, ref: object) -> None:
        pass


def _age(store: SharedDirFeatureStore, sample_id: str, seconds: float) -> None:
    path = store._file(sample_id)
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def leftovers(tmp_path: Path) -> tuple[Ledger, SharedDirFeatureStore, dict[str, int]]:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = SharedDirFeatureStore(tmp_path / "features")
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i}", {"x": torch.full((256,), float(i))}) for i in range(4))
    producer.close()
    trainer = Consumer(led, _DeleteFails(tmp_path / "features"), run_id=RUN, consumer_id="trainer")
    trainer.resume()
    trainer.ack(trainer.lease(2), step=1)  # s0 and s1
    (tmp_path / "ckpt-1").mkdir()
    trainer.checkpoint(1, str(tmp_path / "ckpt-1"))  # releases s0, s1: their files stay
    orphan = store.put("orphan", {"x": torch.zeros(1024)})  # a producer died before commit
    store.put("fresh", {"x": torch.zeros(8)})  # a commit may still come
    for sample_id in ("s0", "s1", "s2", "s3", "orphan"):
        _age(store, sample_id, HOUR)
    assert set(replay(led, RUN).released) == {"s0", "s1"}
    sizes = {o.sample_id: o.nbytes for o in store.scan()}
    assert sizes["orphan"] == orphan.specs["x"].nbytes
    return led, store, sizes


def test_gc_removes_orphans_and_released_leftovers_only(leftovers) -> None:
    led, store, sizes = leftovers
    dry = collect_garbage(led, store, grace=60, dry_run=True)
    gone = ("orphan", "s0", "s1")
    assert dry == GcReport(
        removed=3, bytes=sum(sizes[s] for s in gone), kept=2, young=1, dry_run=True
    )
    assert {o.sample_id for o in store.scan()} == set(sizes)  # a dry run removes nothing
    report = collect_garbage(led, store, grace=60)
    assert (report.removed, report.bytes, report.dry_run) == (3, dry.bytes, False)
    assert {o.sample_id for o in store.scan()} == {"s2", "s3", "fresh"}
    state = replay(led, RUN)
    for sample_id in ("s2", "s3"):  # live features still load
        assert store.get(state.ref(sample_id))["x"][0] == int(sample_id[1])
    assert collect_garbage(led, store, grace=60).removed == 0  # nothing left to collect


def test_a_generous_grace_keeps_everything_recent_but_released_leftovers(leftovers) -> None:
    led, store, sizes = leftovers
    report = collect_garbage(led, store, grace=2 * HOUR)
    # s0 and s1 were committed, then released: no put of them is on its way, whatever
    # their age (their writer's clock may run ahead of this host's)
    assert (report.removed, report.kept, report.young) == (2, 2, 2)
    assert {o.sample_id for o in store.scan()} == set(sizes) - {"s0", "s1"}


def test_released_leftovers_of_a_writer_hours_ahead_go_and_its_orphan_waits(leftovers) -> None:
    led, store, _ = leftovers
    for sample_id in ("s0", "orphan"):
        _age(store, sample_id, -3 * HOUR)  # put by a host whose clock is 3 h ahead
    report = collect_garbage(led, store, grace=60)
    assert (report.removed, report.young) == (2, 2)  # s0, s1 go; orphan and fresh wait
    assert {o.sample_id for o in store.scan()} == {"s2", "s3", "orphan", "fresh"}


@pytest.mark.parametrize("grace", [-1, float("nan"), float("inf"), "60", True])
def test_a_bad_grace_is_refused(leftovers, grace) -> None:
    led, store, _ = leftovers
    with pytest.raises(ValueError, match="grace must be a number of seconds"):
        collect_garbage(led, store, grace=grace)  # type: ignore[arg-type]


def test_a_store_reached_by_another_path_is_not_collected(leftovers, tmp_path: Path) -> None:
    # The ledger's refs name the store by its URI; the same directory, moved, is named by
    # none of them, and everything it holds would look like garbage.
    led, store, _ = leftovers
    store.close()
    (tmp_path / "features").rename(tmp_path / "moved")
    moved = SharedDirFeatureStore(tmp_path / "moved")
    with pytest.raises(ValueError, match=r"keeps alive in store dir://.*/features, and no ref"):
        collect_garbage(led, moved, grace=60)
    assert {"s2", "s3"} <= {o.sample_id for o in moved.scan()}  # what it keeps alive stays


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=120)


def test_the_gc_command(leftovers, tmp_path: Path) -> None:
    led, store, sizes = leftovers
    where = ["--ledger", led.url, "--run", RUN, "--store", store.uri, "--grace", "60"]
    dry = _cli("gc", *where, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["removed"] == 3
    assert len(list(store.scan())) == len(sizes)
    done = _cli("gc", *where, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["removed"] == 3 and report["bytes"] == sizes["orphan"] + sizes["s0"] + sizes["s1"]
    text = _cli("gc", *where)
    assert text.returncode == 0 and text.stdout.startswith("removed 0 stored generations")


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        ({"--run": "nosuch"}, 1, "run 'nosuch' has no events"),
        ({"--store": "dir:///nonexistent/features"}, 1, "no shared-directory store at"),
        ({"--grace": "-1"}, 2, "--grace: expected a number of seconds"),
        ({"--store": "nosuch://x"}, 1, "nosuch"),
        ({"--store": "mem://x"}, 1, "mem://x is an in-process store"),
        ({"--store": "dir://tmp/x"}, 1, "is not a dir:// URI; use dir:///ABSOLUTE/PATH"),
        ({"--store": "dir://{tmp}/notes"}, 1, "notes is no shared-directory store"),
    ],
)
def test_gc_bad_input_is_one_line(leftovers, tmp_path: Path, change, code, message) -> None:
    led, store, sizes = leftovers
    notes = tmp_path / "notes"  # a directory that is no store: gc must not lay one out there
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    change = {key: value.format(tmp=tmp_path) for key, value in change.items()}
    options = {"--ledger": led.url, "--run": RUN, "--store": store.uri} | change
    result = _cli("gc", *(x for pair in options.items() for x in pair))
    assert result.returncode == code, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert len(list(store.scan())) == len(sizes)  # nothing removed
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


# -- the store found from the run (no --store) ---------------------------------------------


def test_gc_without_store_collects_every_store_the_runs_producers_recorded(
    leftovers, tmp_path: Path
) -> None:
    led, store, sizes = leftovers
    other = SharedDirFeatureStore(tmp_path / "other")  # a restarted producer wrote elsewhere
    Producer(led, other, run_id=RUN, producer_id="other").emit("o0", {"x": torch.ones(4)})
    stray = other.put("stray", {"x": torch.ones(64)})  # it died before this commit
    for sample_id in ("o0", "stray"):
        _age(other, sample_id, HOUR)
    report = json.loads(_cli("replay", "--ledger", led.url, "--run", RUN, "--json").stdout)
    assert report["stores"] == [store.uri, other.uri]
    status = _cli("status", "--ledger", led.url, "--run", RUN).stdout
    assert f"stores: {store.uri!r}, {other.uri!r}" in status

    done = _cli("gc", "--ledger", led.url, "--run", RUN, "--grace", "60", "--json")
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["store"], r["removed"]) for r in reports] == [(store.uri, 3), (other.uri, 1)]
    assert {o.sample_id for o in store.scan()} == {"s2", "s3", "fresh"}
    assert [o.sample_id for o in other.scan()] == ["o0"] and not other.exists(stray)
    assert sizes  # the fixture's store held more before


def test_gc_store_overrides_the_recorded_stores(leftovers, tmp_path: Path) -> None:
    led, store, _sizes = leftovers
    other = SharedDirFeatureStore(tmp_path / "other")
    Producer(led, other, run_id=RUN, producer_id="other").emit("o0", {"x": torch.ones(4)})
    _age(other, "o0", HOUR)
    stray = other.put("stray", {"x": torch.ones(4)})
    _age(other, "stray", HOUR)
    done = _cli("gc", "--ledger", led.url, "--run", RUN, "--store", store.uri, "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["store"] for line in done.stdout.splitlines()] == [store.uri]
    assert other.exists(stray)  # not named: left alone


def test_gc_without_store_on_a_run_that_recorded_none_says_to_name_it(leftovers) -> None:
    import sqlite3

    led, store, sizes = leftovers
    with sqlite3.connect(led.url.removeprefix("sqlite:///")) as conn:  # a schema-2 run's log
        conn.execute("DELETE FROM dataflow_events WHERE kind = 'claim'")
    result = _cli("gc", "--ledger", led.url, "--run", RUN)
    assert result.returncode == 1
    assert "records no store" in result.stderr and "--store" in result.stderr
    assert len(list(store.scan())) == len(sizes)


def test_gc_without_store_finds_a_mooncake_store_and_its_admin_address(
    mooncake_master, tmp_path: Path
) -> None:
    from stores import MooncakeFeatureStore

    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = MooncakeFeatureStore(
        mooncake_master.master_address,
        metadata=mooncake_master.metadata_url,
        namespace=f"gc{os.getpid()}",
        admin=mooncake_master.admin_address,
        segment_size=64 << 20,
    )
    try:
        producer = Producer(led, store, run_id=RUN)
        kept = producer.emit_many((f"s{i}", {"x": torch.full((16,), float(i))}) for i in range(3))
        producer.close()
        orphan = store.put("orphan", {"x": torch.zeros(16)})  # its producer died before commit
        recorded = json.loads(_cli("replay", "--ledger", led.url, "--run", RUN, "--json").stdout)
        assert recorded["stores"] == [mooncake_master.store_uri(namespace=store.namespace)]

        done = _cli("gc", "--ledger", led.url, "--run", RUN, "--grace", "0", "--json")
        assert done.returncode == 0, done.stderr
        (report,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert (report["removed"], report["kept"]) == (1, 3)
        assert not store.exists(orphan) and all(store.exists(ref) for ref in kept)
    finally:
        store.close()
        led.close()
