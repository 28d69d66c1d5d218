"""Hand-written rows: nothing crashes replay, resume or the CLI, and nothing is trusted silently.

Rows of a real ledger (SQLite file, PostgreSQL server) are written with plain SQL, as an
operator's mistake or an attacker with write access would: a payload nested 10^5 levels,
a commit row with a negative seq, a seq of 2**63-1, a deleted runs row. Each is either a
violation ``verify`` names with its seq or a clear error before anything is written.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, text

from dataflow import Consumer, CorruptLedgerError, Kind, Ledger, Producer, replay
from dataflow.cli import main
from stores import LocalFeatureStore

RUN = "run"
MAX_SEQ = 2**63 - 1


def _features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


def _sql(url: str, statement: str, **params: object) -> None:
    """One statement in its own transaction, from outside the library."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


@pytest.fixture
def run(ledger: Ledger, store: LocalFeatureStore) -> tuple[Producer, Consumer]:
    """Four samples committed, a consumer in epoch 1 holding a lease, one sample acked."""
    producer = Producer(ledger, store, run_id=RUN, producer_id="p")
    producer.emit_many((f"s{i}", _features(f"s{i}")) for i in range(4))
    consumer = Consumer(ledger, store, run_id=RUN, consumer_id="rank0")
    consumer.resume()
    consumer.ack(consumer.lease(1), step=1)
    consumer.lease(1)
    assert replay(ledger, RUN).verify() == []
    return producer, consumer


def _seq(ledger: Ledger, kind: str) -> int:
    return next(e.seq for e in ledger.events(RUN) if e.kind == kind)


def test_a_payload_nested_100000_levels_is_a_violation_not_a_recursion_error(
    ledger: Ledger, store: LocalFeatureStore, run, capsys: pytest.CaptureFixture[str]
) -> None:
    seq = _seq(ledger, Kind.RESUME)
    deep = '{"world_size":' + "[" * 100_000 + "]" * 100_000 + "}"
    _sql(ledger.url, "UPDATE dataflow_events SET payload = :p WHERE seq = :seq", p=deep, seq=seq)
    problems = replay(ledger, RUN).verify()
    assert (
        f"seq {seq}: unreadable resume event (ValueError: payload nested deeper than 64 levels)"
        in problems
    )
    assert main(["replay", "--ledger", ledger.url, "--run", RUN, "--verify"]) == 1
    out = capsys.readouterr()
    assert f"seq {seq}: unreadable resume event" in out.out and "unexpected" not in out.err
    # A new consumer resumes over it (warned: the log fails verification) instead of crashing.
    with pytest.warns(UserWarning, match=rf"fails verification .*seq {seq}: unreadable resume"):
        plan = Consumer(ledger, store, run_id=RUN, consumer_id="rank0-again").resume(None)
    assert plan.epoch == 2


def test_a_flat_payload_under_the_bounds_still_reads(ledger: Ledger, run) -> None:
    # The depth scan runs on long payloads with many brackets; a string of brackets is no
    # nesting, and 64 levels are allowed.
    seq = _seq(ledger, Kind.RESUME)
    payload = {"world_size": 1, "note": "[{" * 500, "nest": json.loads("[" * 63 + "]" * 63)}
    _sql(ledger.url, "UPDATE dataflow_events SET payload = :p WHERE seq = :seq",
         p=json.dumps(payload), seq=seq)  # fmt: skip
    assert replay(ledger, RUN).verify() == []


def test_a_commit_row_no_fold_reads_never_passes_for_a_commit(
    ledger: Ledger, store: LocalFeatureStore, run
) -> None:
    producer, _ = run
    ref = json.dumps(
        {"generation": 0, "metadata": {}, "sample_id": "ghost", "specs": {}, "store": "x"},
        separators=(",", ":"),
        sort_keys=True,
    )
    _sql(
        ledger.url,
        "INSERT INTO dataflow_events (seq, run_id, kind, sample_id, revision, epoch, actor, "
        "payload, ts) VALUES (-7, :run, 'commit', 'ghost', 0, 0, 'p', :ref, :ts)",
        run=RUN,
        ref=ref,
        ts=time.time(),
    )
    assert any(
        p.startswith("seq -7: commit event of 'ghost' has a seq below 1")
        for p in replay(ledger, RUN).verify()
    )
    head, stored = ledger.head_seq(RUN), len(list(store.scan()))
    with pytest.raises(
        CorruptLedgerError, match=r"commit of 'ghost' .* blocked by a commit row with seq -7"
    ):
        producer.emit_many([("fresh", _features("fresh")), ("ghost", _features("ghost"))])
    assert ledger.head_seq(RUN) == head  # nothing committed, not even the fresh sample
    assert len(list(store.scan())) == stored  # and their features are gone again
    assert ledger.commits(RUN, ["ghost"]) == {}


def test_a_seq_of_2_63_minus_1_refuses_appends_instead_of_losing_them(
    ledger: Ledger, store: LocalFeatureStore, run
) -> None:
    producer, _ = run
    head = ledger.head_seq(RUN)
    _sql(
        ledger.url,
        "UPDATE dataflow_events SET seq = :big WHERE seq = :head",
        big=MAX_SEQ,
        head=head,
    )
    with pytest.raises(CorruptLedgerError, match=rf"holds an event with seq {MAX_SEQ}, above"):
        producer.emit("late", _features("late"))
    with pytest.raises(CorruptLedgerError, match=rf"seq {MAX_SEQ}"):  # never a raw KeyError
        Consumer(ledger, store, run_id=RUN, consumer_id="rank0-again").resume()
    assert ledger.head_seq(RUN) == MAX_SEQ
    assert [e.seq for e in ledger.events(RUN)][-1] == MAX_SEQ  # nothing slipped in below it
    assert main(["replay", "--ledger", ledger.url, "--run", RUN, "--verify"]) == 0


def test_a_deleted_runs_row_is_listed_and_restored_at_its_epoch(
    ledger: Ledger, store: LocalFeatureStore, run, capsys: pytest.CaptureFixture[str]
) -> None:
    _, consumer = run
    _sql(ledger.url, "DELETE FROM dataflow_runs WHERE run_id = :run", run=RUN)
    assert ledger.runs() == [RUN] and ledger.unlisted_runs() == [RUN]
    assert main(["runs", "--ledger", ledger.url]) == 0
    out = capsys.readouterr()
    assert out.out == f"{RUN}\n"
    assert "1 runs have events but no row in the runs table" in out.err and repr(RUN) in out.err
    # The live consumer of epoch 1 writes on: the row comes back at epoch 1, not 0.
    consumer.ack(list(replay(ledger, RUN).leased), step=2)
    assert ledger.unlisted_runs() == []
    assert replay(ledger, RUN).verify() == []


# -- control characters ------------------------------------------------------------------

EVIL = [
    "\x1b]0;pwned\x07",  # OSC: the terminal's title
    "\x1b[2J",  # clear the screen
    "ok\r         verify: clean",  # overwrite the line
    "one\nverify: clean",  # a line of its own
    "\u202eevil",  # right-to-left override
    "\x9b31m\x7f",  # C1 CSI, DEL
]


def _printable_lines(text_out: str) -> None:
    for line in text_out.split("\n"):
        assert line.isprintable(), repr(line)
        assert not line.lstrip().startswith("verify: clean") or line == "         verify: clean"


@pytest.mark.parametrize("reason", EVIL)
def test_control_characters_in_reasons_and_paths_are_escaped_on_print(
    sqlite_url: str, tmp_path: Path, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger.open(sqlite_url)
    store = LocalFeatureStore()
    producer = Producer(ledger, store, run_id=RUN, producer_id="p")
    producer.emit_many((f"s{i}", _features(f"s{i}")) for i in range(3))
    consumer = Consumer(ledger, store, run_id=RUN, consumer_id="rank0")
    consumer.resume()
    consumer.nack(consumer.lease(1), retryable=False, reason=reason)  # s0: dead
    consumer.lost(consumer.lease(1), reason=reason)  # s1: lost
    consumer.checkpoint(1, str(tmp_path))
    # The API refuses such a path (InvalidCheckpointPathError); a hand-written row holds one.
    path = json.dumps({"path": f"{tmp_path}/ckpt{reason}"})
    _sql(sqlite_url, "UPDATE dataflow_events SET payload = :p WHERE kind = 'checkpoint'", p=path)
    for args in (["--sample", "s0"], ["--sample", "s1"], [], ["--verify"]):
        main(["replay", "--ledger", sqlite_url, "--run", RUN, *args])
        out = capsys.readouterr()
        _printable_lines(out.out)
        _printable_lines(out.err)
    main(["status", "--ledger", sqlite_url, "--run", RUN])
    _printable_lines(capsys.readouterr().out)
    # --json stays exact JSON, in ASCII
    assert main(["replay", "--ledger", sqlite_url, "--run", RUN, "--sample", "s0", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.isascii()
    assert reason in next(e["detail"] for e in json.loads(out)["events"] if e["kind"] == "nack")


def test_a_control_character_in_a_hand_written_actor_is_escaped(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The API refuses such ids (InvalidIdError); a hand-written row may still hold one.
    ledger = Ledger.open(sqlite_url)
    Producer(ledger, LocalFeatureStore(), run_id=RUN, producer_id="p").emit("s0", _features("s0"))
    _sql(sqlite_url, "UPDATE dataflow_events SET actor = :a", a="p\x1b[2J\n")
    for args in (["replay", "--sample", "s0"], ["status"], ["replay"]):
        main([args[0], "--ledger", sqlite_url, "--run", RUN, *args[1:]])
        _printable_lines(capsys.readouterr().out)


# -- status -----------------------------------------------------------------------------


def test_status_counts_the_runs_events_beside_the_ledgers_global_seq(
    ledger: Ledger, store: LocalFeatureStore, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = Producer(ledger, store, run_id=RUN, producer_id="p")
    other = Producer(ledger, store, run_id="other", producer_id="p")
    for i in range(3):  # interleaved: the run's seqs skip the other run's
        mine.emit(f"s{i}", _features("x"))
        other.emit(f"s{i}", _features("x"))
    head = ledger.head_seq(RUN)
    # each producer's claim, then the commits (PostgreSQL's seqs count transactions: above)
    assert head == 7 if ledger.backend == "sqlite" else head > 7
    assert main(["status", "--ledger", ledger.url, "--run", RUN]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"run {RUN!r}: 4 events (newest at seq {head} of the ledger"), first
    assert main(["status", "--ledger", ledger.url, "--run", RUN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["events"], report["head_seq"]) == (4, head)


def test_a_snapshot_nested_100000_levels_is_skipped_not_a_recursion_error(
    ledger: Ledger, store: LocalFeatureStore, run
) -> None:
    # A snapshot row written by hand, with a digest that matches its body.
    from dataflow.model import _snapshot

    header = zlib.compress(b"[" * 100_000 + b"]" * 100_000)
    body = _snapshot._MAGIC + _snapshot._LENGTH.pack(len(header)) + header
    _sql(
        ledger.url,
        "INSERT INTO dataflow_snapshots (run_id, seq, format, digest, body, ts) "
        "VALUES (:run, :seq, :format, :digest, :body, 0)",
        run=RUN,
        seq=ledger.head_seq(RUN),
        format=_snapshot.FORMAT,
        digest=_snapshot.digest(body),
        body=body,
    )
    with pytest.warns(UserWarning, match=r"is skipped: it cannot be read \(RecursionError"):
        state = replay(ledger, RUN)
    assert state.verify() == [] and len(state.trained) == 1
    with pytest.warns(UserWarning, match=r"is skipped"):
        Consumer(ledger, store, run_id=RUN, consumer_id="rank0-again").resume()


def test_a_samples_history_shows_an_unreadable_payload_instead_of_failing(
    ledger: Ledger, run, capsys: pytest.CaptureFixture[str]
) -> None:
    _, consumer = run
    (sid,) = replay(ledger, RUN).leased
    consumer.nack([sid], reason="bad")
    seq = next(e.seq for e in ledger.events(RUN) if e.kind == Kind.NACK)
    deep = "[" * 100_000 + "]" * 100_000
    _sql(ledger.url, "UPDATE dataflow_events SET payload = :p WHERE seq = :seq", p=deep, seq=seq)
    assert main(["replay", "--ledger", ledger.url, "--run", RUN, "--sample", sid]) == 0
    out = capsys.readouterr()
    assert "nack" in out.out and "unreadable payload (payload nested deeper than 64" in out.out
    assert out.err == ""
