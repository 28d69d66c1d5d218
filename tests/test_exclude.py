"""Excluding samples from a run (``Consumer.exclude``/``include``): every documented
behaviour and each bad input, on a real SQLite ledger (and PostgreSQL where marked)."""

from __future__ import annotations

import pytest
import torch

from dataflow import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidSampleIdError,
    Ledger,
    Producer,
    StaleEpochError,
    UnknownSampleError,
    replay,
)
from dataflow.live._exclusions import write_exclusions
from dataflow.model._events import MAX_REASON_CHARS, Kind, check_payload
from dataflow.streams import MemoryStream
from dataflow.tools._samples import sample_history, sample_row

CKPT = "s3://bucket/step-{}"


def _ids(refs) -> list[str]:
    return [r.sample_id for r in refs]


def _train(consumer, step: int, n: int) -> list[str]:
    got = _ids(consumer.lease(n))
    consumer.ack(got, step=step)
    return got


def _drain(consumer, step: int) -> list[str]:
    got: list[str] = []
    while refs := consumer.lease(100):
        got += _ids(refs)
        consumer.ack(_ids(refs), step=step)
    return got


@pytest.fixture
def started(emit, producer, make_consumer):
    """Six committed samples s0..s5 (the producer closed), a consumer resumed from scratch
    (features kept: a resume from scratch needs no regeneration)."""
    emit(*(f"s{i}" for i in range(6)))
    producer.close()
    consumer = make_consumer(release_policy="never")
    consumer.resume(None)
    return consumer


def test_an_excluded_sample_is_never_leased_and_replay_names_its_reason(
    started, ledger, run_id
) -> None:
    assert started.exclude(["s1", "s4"], reason="bad labels") == ["s1", "s4"]
    assert _drain(started, 1) == ["s0", "s2", "s3", "s5"]
    state = replay(ledger, run_id)
    assert state.excluded == {"s1": "bad labels", "s4": "bad labels"}
    assert state.verify() == []
    assert sample_row(state, "s1")["state"] == "excluded"
    assert sample_row(state, "s1")["excluded"] == "bad labels"
    rows = [e for e in ledger.events(run_id) if e.kind == Kind.EXCLUDE]
    assert len(rows) == 1 and rows[0].sample_id is None  # one row names the batch
    assert rows[0].payload == {"samples": ["s1", "s4"], "reason": "bad labels"}
    assert rows[0].sample_ids == ["s1", "s4"]  # as a batch lease or ack names its samples


def test_an_exclusion_after_a_checkpoint_holds_when_a_resume_goes_back_to_it(
    started, ledger, run_id
) -> None:
    assert _train(started, 1, 2) == ["s0", "s1"]
    started.record_checkpoint(1, CKPT.format(1))
    assert _train(started, 2, 2) == ["s2", "s3"]
    started.exclude(["s3", "s4"], reason="loss spike at step 2")
    started.resume(1)  # before the exclusion, and before s3 trained
    assert _drain(started, 2) == ["s2", "s5"]
    state = replay(ledger, run_id)
    assert state.verify() == []
    assert set(state.trained) == {"s0", "s1", "s2", "s5"}
    started.resume(None)  # from scratch, older still: the exclusion holds
    assert _drain(started, 1) == ["s0", "s1", "s2", "s5"]
    assert replay(ledger, run_id).verify() == []


def test_a_sample_trained_before_its_exclusion_stays_trained(started, ledger, run_id) -> None:
    _train(started, 1, 2)
    started.record_checkpoint(1, CKPT.format(1))
    started.exclude(["s0"], reason="duplicate")
    state = replay(ledger, run_id)
    assert state.trained["s0"] == 1 and sample_row(state, "s0")["state"] == "trained"
    assert state.verify() == []
    started.resume(1)  # the checkpoint holds it trained
    assert "s0" in started.state.trained
    started.resume(None)  # from scratch: untrained now, and not leased again
    assert "s0" not in _drain(started, 1)
    assert replay(ledger, run_id).verify() == []


def test_a_leased_sample_that_gets_excluded_trains_on_its_ack(started, ledger, run_id) -> None:
    leased = _ids(started.lease(2))
    started.exclude(leased, reason="late decision")
    started.ack(leased, step=1)  # the exclusion takes effect at the next lease
    state = replay(ledger, run_id)
    assert set(leased) <= set(state.trained) and state.verify() == []


def test_a_leased_sample_that_gets_excluded_is_not_requeued_by_a_nack(
    started, ledger, run_id
) -> None:
    leased = _ids(started.lease(1))
    started.exclude(leased, reason="bad")
    started.nack(leased, reason="oom")
    assert leased[0] not in _drain(started, 1)
    state = replay(ledger, run_id)
    assert sample_row(state, leased[0])["state"] == "excluded"
    assert state.verify() == []


def test_include_puts_an_excluded_sample_back_to_pending(started, ledger, run_id) -> None:
    started.exclude(["s2"], reason="suspect")
    assert not started.state.is_pending("s2")
    assert started.include(["s2"], reason="checked: fine") == ["s2"]
    assert started.state.is_pending("s2") and "s2" not in started.state.excluded
    assert sorted(_drain(started, 1)) == [f"s{i}" for i in range(6)]
    history = sample_history(ledger, run_id, "s2")
    kinds = [(e["kind"], e["detail"]) for e in history["events"]]
    assert ("exclude", "excluded: suspect") in kinds
    assert ("include", "included: checked: fine") in kinds
    assert replay(ledger, run_id).verify() == []


def test_include_of_a_sample_that_is_not_excluded_is_refused_and_writes_nothing(
    started, ledger, run_id
) -> None:
    head = ledger.head_seq(run_id)
    with pytest.raises(UnknownSampleError, match=r"'s3'.*not excluded"):
        started.include(["s3"], reason="undo")
    assert ledger.head_seq(run_id) == head


def test_excluding_again_keeps_the_first_reason(started, ledger, run_id) -> None:
    started.exclude(["s1"], reason="first")
    assert started.exclude(["s1", "s2"], reason="second") == ["s2"]
    assert replay(ledger, run_id).excluded == {"s1": "first", "s2": "second"}
    assert replay(ledger, run_id).excluded_total == 2


@pytest.mark.parametrize(
    ("ids", "reason", "error", "match"),
    [
        (["nope"], "why", UnknownSampleError, "'nope'.*never committed"),
        (["s0", "x1", "x2"], "why", UnknownSampleError, "'x1', 'x2'"),
        ([], "why", InvalidArgumentError, "names no sample"),
        ("s0", "why", ArgumentTypeError, "iterable of sample ids"),
        (["../x"], "why", InvalidSampleIdError, "must not contain"),
        (["s0"], "", InvalidArgumentError, "must say why"),
        (["s0"], "   ", InvalidArgumentError, "must say why"),
        (["s0"], "x" * (MAX_REASON_CHARS + 1), InvalidArgumentError, "at most 1000"),
        (["s0"], 3, ArgumentTypeError, "reason must be a str"),
    ],
)
def test_bad_input_is_refused_with_its_name_and_nothing_is_written(
    started, ledger, run_id, ids, reason, error, match
) -> None:
    head = ledger.head_seq(run_id)
    with pytest.raises(error, match=match):
        started.exclude(ids, reason=reason)
    assert ledger.head_seq(run_id) == head
    assert replay(ledger, run_id).excluded == {}


def test_an_uncommitted_sample_is_refused_from_outside_too(ledger, run_id, emit) -> None:
    emit("a")
    with pytest.raises(UnknownSampleError, match="'b'"):
        write_exclusions(ledger, run_id, ["a", "b"], reason="why")
    assert replay(ledger, run_id).excluded == {}


def test_a_fenced_consumer_cannot_exclude(started, make_consumer) -> None:
    newer = make_consumer("trainer-2")
    newer.resume(None)
    with pytest.raises(StaleEpochError):
        started.exclude(["s0"], reason="why")


def test_an_exclusion_from_outside_uses_the_current_epoch_and_fences_nobody(
    started, ledger, run_id
) -> None:
    report = write_exclusions(ledger, run_id, ["s5"], reason="from the CLI")
    assert report.epoch == started.epoch and report.changed == ("s5",)
    assert "s5" not in _drain(started, 1)  # the live consumer goes on, and skips it
    assert replay(ledger, run_id).verify() == []


def test_an_exclusion_before_the_first_resume_holds(ledger, run_id, emit, make_consumer) -> None:
    emit("a", "b", "c")
    report = write_exclusions(ledger, run_id, ["b"], reason="known bad")
    assert report.epoch == 0
    consumer = make_consumer()
    consumer.resume(None)
    assert _ids(consumer.lease(10)) == ["a", "c"]


def test_a_new_data_epoch_leaves_excluded_samples_out(
    ledger, run_id, emit, producer, make_consumer
) -> None:
    emit("a", "b", "c")
    producer.close()
    consumer = make_consumer(release_policy="never")
    consumer.resume(None)
    consumer.exclude(["b"], reason="bad")
    assert sorted(_drain(consumer, 1)) == ["a", "c"]
    consumer.start_data_epoch()
    assert sorted(_drain(consumer, 2)) == ["a", "c"]
    assert replay(ledger, run_id).verify() == []


def test_a_lost_excluded_sample_is_not_regenerated(
    ledger, store, run_id, emit, make_consumer
) -> None:
    emit("a", "b")
    consumer = make_consumer()
    consumer.resume(None)
    leased = _ids(consumer.lease(1))
    consumer.exclude(leased, reason="bad")
    consumer.lost(leased, reason="features gone")
    state = replay(ledger, run_id)
    assert leased[0] not in state.regenerate and state.verify() == []
    again = Producer(ledger, store, run_id=run_id, producer_id="regen")
    again.regenerate(leased[0], {"x": torch.zeros(1)})  # features back: still excluded
    state = replay(ledger, run_id)
    assert not state.is_pending(leased[0]) and state.verify() == []


def test_a_streamed_ref_of_an_excluded_sample_is_not_leased(
    ledger, store, run_id, make_consumer
) -> None:
    stream = MemoryStream(window=8)
    producer = Producer(ledger, store, run_id=run_id, stream=stream.sender())
    consumer = make_consumer(stream=stream.receiver())
    consumer.resume(None)
    producer.emit_many((s, {"x": torch.zeros(1)}) for s in ("a", "b", "c"))
    write_exclusions(ledger, run_id, ["b"], reason="bad")
    producer.close()
    got: list[str] = []
    while refs := consumer.lease(10, timeout=5):
        got += _ids(refs)
        consumer.ack(_ids(refs), step=1)
    assert got == ["a", "c"]
    assert replay(ledger, run_id).verify() == []


def test_a_snapshot_keeps_the_exclusions(started, ledger, run_id) -> None:
    started.exclude(["s1"], reason="bad")
    started.exclude(["s2"], reason="bad too")
    started.include(["s2"], reason="fine")
    assert ledger.save_snapshot(run_id, replay(ledger, run_id, snapshots=False))
    restored = replay(ledger, run_id)
    full = replay(ledger, run_id, snapshots=False)
    assert restored.observable() == full.observable()
    assert restored.excluded_total == full.excluded_total == 2


@pytest.mark.parametrize(
    "payload",
    [
        '{"samples":[],"reason":"x"}',
        '{"samples":["a"],"reason":""}',
        '{"samples":["a"]}',
        '{"samples":["a"],"reason":"x","extra":1}',
        '{"samples":"a","reason":"x"}',
        '{"samples":["a"],"reason":"' + "x" * (MAX_REASON_CHARS + 1) + '"}',
    ],
)
def test_a_forged_exclusion_payload_is_refused(payload) -> None:
    with pytest.raises(InvalidArgumentError, match="exclude"):
        check_payload(Kind.EXCLUDE, payload)


def test_a_forged_exclusion_row_is_a_violation_not_a_crash(tmp_path) -> None:
    from dataflow.model._fold import RunState

    state = RunState("r")
    rows = [
        (1, Kind.EXCLUDE, None, None, 0, None, "x", '{"samples":["ghost"],"reason":"r"}', 0.0),
        (2, Kind.INCLUDE, None, None, 0, None, "x", '{"samples":["ghost"],"reason":"r"}', 0.0),
        (3, Kind.EXCLUDE, None, None, 0, None, "x", None, 0.0),
        (4, Kind.EXCLUDE, None, None, 7, None, "x", '{"samples":["g"],"reason":"r"}', 0.0),
    ]
    state.apply_rows(rows)
    problems = "\n".join(state.verify())
    assert "seq 1: exclusion of 'ghost', never committed" in problems
    assert "seq 2: inclusion of 'ghost', which is not excluded" in problems
    assert "seq 3: unreadable exclude event" in problems
    assert "seq 4: exclude by 'x' with stale epoch 7" in problems


def test_metrics_count_exclusions(started, ledger, run_id) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dataflow import RunMetrics

    registry = CollectorRegistry()
    metrics = RunMetrics(ledger, run_id, registry=registry)
    try:
        started.exclude(["s0", "s1"], reason="bad")
        started.include(["s1"], reason="fine")
        text = generate_latest(registry).decode()
    finally:
        metrics.close()
    assert 'dataflow_excluded_samples_total{run="run"} 2.0' in text
    assert 'dataflow_excluded_refs{run="run"} 1.0' in text
    assert 'dataflow_backlog_refs{run="run"} 5.0' in text  # the excluded one is out


def test_postgres_too(ledger_url) -> None:
    """The same fold on each backend (the postgres param runs where PostgreSQL is)."""
    from stores import LocalFeatureStore

    led = Ledger.open(ledger_url)
    with LocalFeatureStore() as store:
        producer = Producer(led, store, run_id="pg")
        producer.emit_many((s, {"x": torch.zeros(1)}) for s in ("a", "b"))
        write_exclusions(led, "pg", ["a"], reason="bad")
        assert replay(led, "pg").excluded == {"a": "bad"}
    led.close()


def test_export_writes_the_exclusions(started, ledger, run_id, tmp_path) -> None:
    import pyarrow.parquet as pq

    from dataflow.tools._export import export_parquet

    started.exclude(["s1"], reason="bad labels")
    export_parquet(ledger, run_id, tmp_path / "e.parquet", samples_path=tmp_path / "s.parquet")
    rows = {r["sample_id"]: r for r in pq.read_table(tmp_path / "s.parquet").to_pylist()}
    assert rows["s1"]["state"] == "excluded" and rows["s1"]["excluded"] == "bad labels"
    assert rows["s0"]["state"] == "pending" and rows["s0"]["excluded"] is None
    events = pq.read_table(tmp_path / "e.parquet").to_pylist()
    assert [e["kind"] for e in events].count("exclude") == 1


def test_in_a_seeded_order_an_included_sample_goes_back_to_its_place(
    ledger, run_id, emit, producer, make_consumer
) -> None:
    emit(*(f"s{i}" for i in range(6)))
    producer.close()
    consumer = make_consumer(order_seed=3)
    consumer.resume(None)
    order = consumer.state.pending
    consumer.exclude([order[1]], reason="suspect")
    consumer.include([order[1]], reason="fine")
    assert [r.sample_id for r in consumer.lease(6)] == order
