"""A damaged or hand-edited ledger: replay reports it, and nothing is leased on top of it.

Rows of a real SQLite ledger are rewritten with plain SQL, as a bad disk or an
operator's mistake would: ``verify()`` names each broken event with its seq, never
raises a library error, and ``lease`` refuses a commit it cannot trust before writing.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, CorruptLedgerError, Kind, Ledger, Producer, replay
from dataflow.cli import main
from dataflow.recorder._ledger import NewEvent
from dataflow.tools._inspect import summary
from stores import LocalFeatureStore

RUN = "run"


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


@pytest.fixture
def history(tmp_path: Path) -> tuple[Ledger, LocalFeatureStore, Path]:
    """Eight samples, two acked at each of steps 1-4, checkpoints at steps 2 and 4."""
    path = tmp_path / "ledger.db"
    led = Ledger.open(f"sqlite:///{path}")
    store = LocalFeatureStore()
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i}", _features(f"s{i}")) for i in range(8))
    producer.close()
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    for step in range(1, 5):
        cons.ack(cons.lease(2), step=step)
        if step % 2 == 0:
            (tmp_path / f"ckpt-{step}").mkdir()
            cons.checkpoint(step, str(tmp_path / f"ckpt-{step}"))
    assert replay(led, RUN).verify() == []
    return led, store, path


def _sql(path: Path, statement: str, *args: object) -> None:
    with sqlite3.connect(path) as db:
        db.execute(statement, args)


def _seq(led: Ledger, kind: str, sample_id: str) -> int:
    """The seq of the row of ``kind`` that names ``sample_id`` (a batch row may name more)."""
    return next(e.seq for e in led.events(RUN) if e.kind == kind and sample_id in e.sample_ids)


def test_an_ack_moved_before_a_checkpoint_is_reported(history) -> None:
    # s7 was trained into step 4; rewritten to step 1, a resume from step 2 would count it
    # trained although the step-2 weights never saw it: the resume warns.
    led, store, path = history
    seq = _seq(led, Kind.ACK, "s7")
    _sql(path, "UPDATE dataflow_events SET step = 1 WHERE seq = ?", seq)
    problems = replay(led, RUN).verify()
    assert any(p.startswith(f"seq {seq}: ack of 's7' at step 1") for p in problems), problems
    with pytest.warns(UserWarning, match=rf"fails verification .*the first: seq {seq}: ack of"):
        Consumer(led, store, run_id=RUN, consumer_id="again").resume(2)


def test_a_checkpoint_that_does_not_increase_is_reported(history) -> None:
    led, _, path = history
    seq = next(e.seq for e in led.events(RUN) if e.kind == Kind.CHECKPOINT and e.step == 4)
    _sql(path, "UPDATE dataflow_events SET step = 2 WHERE seq = ?", seq)
    problems = replay(led, RUN).verify()
    assert any(p.startswith(f"seq {seq}: checkpoint at step 2") for p in problems), problems


def test_a_commit_holding_another_samples_ref_is_reported_and_never_leased(
    tmp_path: Path,
) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    store = LocalFeatureStore()
    producer = Producer(led, store, run_id=RUN)
    producer.emit_many((f"s{i}", _features(f"s{i}")) for i in range(4))
    other = next(e.payload for e in led.events(RUN) if e.sample_id == "s3")
    seq = _seq(led, Kind.COMMIT, "s2")
    _sql(tmp_path / "ledger.db", "UPDATE dataflow_events SET payload = ? WHERE seq = ?",
         json.dumps(other, separators=(",", ":"), sort_keys=True), seq)  # fmt: skip
    assert any(
        f"seq {seq}: the commit of 's2' carries no ref" in p for p in replay(led, RUN).verify()
    )


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        (Kind.COMMIT, "{not json"),
        (Kind.RESUME, "{not json"),
        (Kind.RESUME, "[1, 2]"),
        (Kind.RESUME, '{"world_size": 0}'),
        (Kind.CHECKPOINT, "[]"),
    ],
)
def test_an_unreadable_payload_is_a_violation_with_its_seq(history, kind, payload) -> None:
    led, _, path = history
    seq = next(e.seq for e in led.events(RUN) if e.kind == kind)
    _sql(path, "UPDATE dataflow_events SET payload = ? WHERE seq = ?", payload, seq)
    problems = replay(led, RUN).verify()  # no library error escapes
    assert any(p.startswith(f"seq {seq}:") for p in problems), problems


def test_lease_refuses_an_unreadable_commit_before_leasing_anything(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    led = Ledger.open(f"sqlite:///{path}")
    store = LocalFeatureStore()
    Producer(led, store, run_id=RUN).emit_many((f"s{i}", _features(f"s{i}")) for i in range(4))
    seq = _seq(led, Kind.COMMIT, "s2")
    # Still names s2 (so the fold takes it), but no SampleRef can be made of it.
    _sql(path, "UPDATE dataflow_events SET payload = ? WHERE seq = ?", '{"sample_id":"s2"}', seq)
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    head = led.head_seq(RUN)
    with pytest.raises(
        CorruptLedgerError, match=r"the commit of 's2' in run 'run'.*cannot be read"
    ):
        cons.lease(4)
    assert led.head_seq(RUN) == head  # no lease written: nothing stranded
    assert [r.sample_id for r in cons.lease(2)] == ["s0", "s1"]  # the intact ones still lease


def test_a_data_epoch_started_while_a_sample_is_leased_is_reported(tmp_path: Path) -> None:
    # Consumer.start_data_epoch refuses this; a damaged or hand-made log may hold it.
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")

    def ref(sample_id: str) -> str:  # as a SampleRef writes its JSON
        fields = {"generation": 0, "metadata": {}, "sample_id": sample_id, "specs": {}}
        return json.dumps({**fields, "store": "x"}, separators=(",", ":"), sort_keys=True)

    with led.write("r", "raw") as tx:
        tx.append([
            NewEvent("commit", "p", "a", payload=ref("a"), revision=0),
            NewEvent("commit", "p", "b", payload=ref("b"), revision=0),
            NewEvent("resume", "c", epoch=1, payload=json.dumps({"world_size": 2})),
            NewEvent("lease", "c", "a", epoch=1),
            NewEvent("data_epoch", "c", epoch=1, payload=json.dumps({"data_epoch": 1, "seed": 1})),
            NewEvent("nack", "c", "a", epoch=1, payload=json.dumps({"retryable": True, "rank": 1})),
            NewEvent("lease", "c", "a", epoch=1),
        ])  # fmt: skip
    state = replay(led, "r")
    assert state.verify() == [
        "seq 5: data epoch 1 starts while 1 samples are leased (e.g. 'a'); they stay leased"
    ]
    assert state.pending == ["b"] and summary(state)["pending"] == 1


@pytest.mark.parametrize(
    "number", [10**30, -1, "2", True, 1.5], ids=["huge", "negative", "str", "bool", "float"]
)
def test_a_data_epoch_that_is_no_int64_is_a_violation(tmp_path: Path, number: object) -> None:
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    with led.write("r", "raw") as tx:
        tx.append([
            NewEvent("resume", "c", epoch=1, payload=json.dumps({"world_size": 1})),
            NewEvent("data_epoch", "c", epoch=1, payload=json.dumps({"data_epoch": number})),
        ])  # fmt: skip
    assert replay(led, "r").verify() == [
        f"seq 2: unreadable data_epoch event (ValueError: data_epoch {number!r} is no int from "
        "0 to 2**63-1)"
    ]
    assert main(["replay", "--ledger", led.url, "--run", "r", "--verify"]) == 1


@pytest.mark.parametrize("ts", [1e30, "abc", -1e300, b"\x00"], ids=["far", "str", "past", "blob"])
def test_a_damaged_time_is_a_violation_of_dataflow_replay_not_a_crash(
    history, ts, capsys: pytest.CaptureFixture[str]
) -> None:
    led, _, path = history
    seq = _seq(led, Kind.ACK, "s3")
    _sql(path, "UPDATE dataflow_events SET ts = ? WHERE seq = ?", ts, seq)
    assert main(["replay", "--ledger", led.url, "--run", RUN, "--verify"]) == 1
    out = capsys.readouterr()
    assert f"seq {seq}: ack event has no time" in out.out + out.err, out
    assert "unexpected" not in out.err


def test_a_snapshot_covers_what_it_folded_a_full_fold_audits_the_whole_log(history) -> None:
    # replay() starts from the newest snapshot and trusts what it covers; tampering with
    # an event before it shows in a full fold, which `dataflow replay --verify` always is.
    led, _, path = history
    assert led.save_snapshot(RUN, replay(led, RUN))
    seq = _seq(led, Kind.ACK, "s7")
    _sql(path, "UPDATE dataflow_events SET step = 1 WHERE seq = ?", seq)
    assert replay(led, RUN).verify() == []  # the snapshot's fold, from before the edit
    problems = replay(led, RUN, snapshots=False).verify()
    assert any(p.startswith(f"seq {seq}: ack of 's7' at step 1") for p in problems), problems
    assert main(["replay", "--ledger", led.url, "--run", RUN, "--verify"]) == 1
