"""Restart telemetry on hand-built ledgers with exact expected numbers: what each resume kept,
requeued, sent to regeneration and threw away, and how long the ranks stood still; in
``replay --json``, in ``replay``'s text and as Prometheus metrics.

A "crash" here is a consumer left as it is and a new one resuming (the resume fences it
off); tests/test_diff.py has a real SIGKILLed run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from dataflow import Consumer, Kind, Ledger, Producer, RunMetrics, replay
from dataflow.cli import main
from dataflow.tools import restart_costs
from stores import LocalFeatureStore

RUN = "run"
IDS = tuple("abcdefgh")


@pytest.fixture
def led(sqlite_url: str) -> Iterator[Ledger]:
    with Ledger.open(sqlite_url) as ledger:
        yield ledger


@pytest.fixture
def store() -> Iterator[LocalFeatureStore]:
    with LocalFeatureStore() as feature_store:
        yield feature_store


def _train(consumer: Consumer, count: int, step: int) -> list[str]:
    refs = consumer.lease(count)
    consumer.ack(refs, step=step)
    return [r.sample_id for r in refs]


def _checkpoint(consumer: Consumer, step: int, tmp_path: Path) -> None:
    path = tmp_path / f"ckpt-{consumer.consumer_id}-{step}"
    path.mkdir()
    consumer.record_checkpoint(step, str(path))


def _history(led: Ledger, store: LocalFeatureStore, tmp_path: Path) -> None:
    """Four epochs of one rank over a..h (features released at each checkpoint):

    1. trains a, b (step 1), c, d (step 2), checkpoints step 2, trains e, f (step 3),
       leases g, and crashes;
    2. resumes from step 2: trains e (step 3), checkpoints step 3, trains f (step 4),
       leases g, and crashes;
    3. resumes from epoch 1's step 2 again (an older checkpoint), leases nothing;
    4. resumes from scratch.
    """
    Producer(led, store, run_id=RUN).emit_many(
        (sid, {"x": torch.tensor([ord(sid)])}) for sid in IDS
    )

    def consumer(name: str) -> Consumer:
        return Consumer(led, store, run_id=RUN, consumer_id=name)

    first = consumer("first")
    first.resume()
    assert _train(first, 2, 1) == ["a", "b"]
    assert _train(first, 2, 2) == ["c", "d"]
    _checkpoint(first, 2, tmp_path)
    assert _train(first, 2, 3) == ["e", "f"]
    assert [r.sample_id for r in first.lease(1)] == ["g"]

    second = consumer("second")
    assert second.resume().checkpoint_step == 2
    assert _train(second, 1, 3) == ["e"]
    _checkpoint(second, 3, tmp_path)
    assert _train(second, 1, 4) == ["f"]
    assert [r.sample_id for r in second.lease(1)] == ["g"]

    third = consumer("third")
    older = next(c for c in replay(led, RUN).checkpoints if c.epoch == 1)
    assert third.resume(older).checkpoint_step == 2

    consumer("fourth").resume(None)


def _seq_ts(led: Ledger, kind: str, epoch: int, which: int) -> tuple[int, float]:
    rows = [(e.seq, e.ts) for e in led.events(RUN) if e.kind == kind and e.epoch == epoch]
    return rows[which]


def _last_event(led: Ledger, epoch: int) -> tuple[int, float]:
    rows = [
        (e.seq, e.ts)
        for e in led.events(RUN)
        if e.epoch == epoch and (e.kind in Kind.FENCED or e.kind == Kind.RESUME)
    ]
    return rows[-1]


def _replay_json(url: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["replay", "--ledger", url, "--run", RUN, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_restart_s_cost_is_exact(
    led: Ledger,
    store: LocalFeatureStore,
    tmp_path: Path,
    sqlite_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _history(led, store, tmp_path)
    state = replay(led, RUN)
    assert state.verify() == []
    checkpoints = {(c.epoch, c.step): c.seq for c in state.checkpoints}
    resumes = _replay_json(sqlite_url, capsys)["resumes"]
    picked = [
        {k: r[k] for k in ("epoch", "previous_epoch", "checkpoint", "kept")}
        | {k: r[k] for k in ("requeued", "regenerated", "redone_sample_steps")}
        for r in resumes
    ]
    assert picked == [
        # From step 2: a-d kept; e, f (trained at step 3) and g (leased) requeued; 2 redone.
        {
            "epoch": 2,
            "previous_epoch": 1,
            "checkpoint": {"seq": checkpoints[1, 2], "step": 2},
            "kept": 4,
            "requeued": 3,
            "regenerated": 0,
            "redone_sample_steps": 2,
        },
        # Back to epoch 1's step 2 from epoch 2: e (step 3) and f (step 4) of epoch 2 are
        # thrown away, g was leased; epoch 1's own e, f after step 2 were no part of the
        # lineage that crashed. Epoch 2's checkpoint at step 3 released e's features: e
        # is regenerated, f and g are requeued.
        {
            "epoch": 3,
            "previous_epoch": 2,
            "checkpoint": {"seq": checkpoints[1, 2], "step": 2},
            "kept": 4,
            "requeued": 2,
            "regenerated": 1,
            "redone_sample_steps": 2,
        },
        # From scratch: a-d (trained at steps 1 and 2 of the lineage) are redone, and their
        # features were released at the checkpoint: they must be regenerated.
        {
            "epoch": 4,
            "previous_epoch": 3,
            "checkpoint": None,
            "kept": 0,
            "requeued": 0,
            "regenerated": 4,
            "redone_sample_steps": 4,
        },
    ]
    # Seconds: from the crashed epoch's last event to the new epoch's first lease.
    first_lease = _seq_ts(led, Kind.LEASE, 2, 0)
    last = _last_event(led, 1)
    assert last[0] == _seq_ts(led, Kind.LEASE, 1, -1)[0]  # the lease of g
    assert (resumes[0]["last_event_seq"], resumes[0]["first_lease_seq"]) == (
        last[0],
        first_lease[0],
    )
    assert resumes[0]["seconds"] == pytest.approx(first_lease[1] - last[1], abs=1e-6)
    # Epochs 3 and 4 leased nothing: no first lease, no seconds.
    assert [(r["first_lease_seq"], r["seconds"]) for r in resumes[1:]] == [(None, None)] * 2
    assert resumes[2]["last_event_seq"] == _last_event(led, 3)[0]  # epoch 3's resume itself


def test_replay_text_and_metrics_say_the_same(
    led: Ledger,
    store: LocalFeatureStore,
    tmp_path: Path,
    sqlite_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _history(led, store, tmp_path)
    assert main(["replay", "--ledger", sqlite_url, "--run", RUN]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    restarts = [line for line in lines if line.startswith("restart:")]
    assert len(restarts) == 3
    assert "epoch 2 from the checkpoint at step 2" in restarts[0]
    assert "kept 4, requeued 3, regenerated 0, redone 2 sample-steps" in restarts[0]
    assert "s from the last event of epoch 1 to the first lease" in restarts[0]
    assert "epoch 4 from scratch" in restarts[2] and "no lease since" in restarts[2]
    assert "kept 0, requeued 0, regenerated 4, redone 4 sample-steps" in restarts[2]

    # The exporter's fold starts from a snapshot (as after a restart of its own): the
    # restarts come from the snapshot's lineage and a read of the rows.
    assert led.save_snapshot(RUN, replay(led, RUN))
    registry = CollectorRegistry()
    metrics = RunMetrics(led, RUN, registry=registry)
    try:
        scraped = generate_latest(registry).decode()
    finally:
        metrics.close()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith("dataflow_") and f'run="{RUN}"' in line and "resume" in line
    }
    resumes = _replay_json(sqlite_url, capsys)["resumes"]
    assert values == {
        "dataflow_events_total": 4.0,  # kind="resume": the first one too
        "dataflow_resumes_total": 3.0,
        "dataflow_resume_requeued_samples_total": 5.0,
        "dataflow_resume_regenerated_samples_total": 5.0,
        "dataflow_resume_redone_sample_steps_total": 8.0,
        "dataflow_resume_seconds_total": pytest.approx(resumes[0]["seconds"], abs=1e-6),
        "dataflow_last_resume_kept_samples": 0.0,
        "dataflow_last_resume_checkpoint_step": -1.0,
    }  # no dataflow_last_resume_seconds: the newest restart has leased nothing


def test_a_run_never_restarted_has_no_resumes(
    led: Ledger, store: LocalFeatureStore, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Producer(led, store, run_id=RUN).emit("a", {"x": torch.ones(1)})
    consumer = Consumer(led, store, run_id=RUN, consumer_id="only")
    consumer.resume()
    _train(consumer, 1, 1)
    assert _replay_json(sqlite_url, capsys)["resumes"] == []
    registry = CollectorRegistry()
    metrics = RunMetrics(led, RUN, registry=registry)
    try:
        scraped = generate_latest(registry).decode()
    finally:
        metrics.close()
    assert f'dataflow_resumes_total{{run="{RUN}"}} 0.0' in scraped
    assert "dataflow_last_resume_kept_samples{" not in scraped


# -- property: each restart's cost against a model of the lineage --------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("train"), st.integers(1, 3)),
        st.tuples(st.just("lease"), st.integers(1, 2)),
        st.tuples(st.just("checkpoint"), st.just(0)),
        st.tuples(st.just("restart"), st.integers(-1, 4)),  # -1: scratch, else a checkpoint
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_restart_costs_match_a_model_of_the_lineage(tmp_path_factory, ops) -> None:
    # One rank, nothing ever released (release_policy="never": nothing to regenerate). The
    # model keeps the lineage's trainings as (sample, step) in order, and each checkpoint's
    # copy of them; a restart abandons what the crashed lineage holds beyond its checkpoint.
    workdir = tmp_path_factory.mktemp("prop")
    with Ledger.open(f"sqlite:///{workdir}/l.db") as led, LocalFeatureStore() as store:
        Producer(led, store, run_id=RUN).emit_many(
            (f"s{i:02d}", {"x": torch.ones(1)}) for i in range(40)
        )
        n = 0

        def consumer() -> Consumer:
            nonlocal n
            n += 1
            return Consumer(led, store, run_id=RUN, consumer_id=f"c{n}", release_policy="never")

        rank = consumer()
        rank.resume()
        lineage: list[tuple[str, int]] = []
        leased: set[str] = set()
        saved: list[tuple[int, list[tuple[str, int]]]] = []  # step, lineage at it
        step = 0
        expected = []
        for op, arg in ops:
            if op == "train":
                refs = rank.lease(arg)
                if refs:
                    step += 1
                    rank.ack(refs, step=step)
                    lineage += [(r.sample_id, step) for r in refs]
            elif op == "lease":
                leased |= {r.sample_id for r in rank.lease(arg)}
            elif op == "checkpoint" and step > max([-1] + [s for s, _ in saved]):
                path = workdir / f"ckpt-{rank.consumer_id}-{step}"
                path.mkdir()
                rank.record_checkpoint(step, str(path))
                saved.append((step, list(lineage)))
            elif op == "restart":
                back = saved[arg] if 0 <= arg < len(saved) else None
                kept = [] if back is None else back[1]
                abandoned = [t for t in lineage if t not in set(kept)]
                kept_ids = {sid for sid, _ in kept}
                expected.append(
                    (
                        None if back is None else back[0],
                        len(kept_ids),
                        len(({s for s, _ in abandoned} | leased) - kept_ids),
                        len(abandoned),
                    )
                )
                rank = consumer()
                target = None
                if back is not None:
                    target = next(c for c in replay(led, RUN).checkpoints if c.step == back[0])
                rank.resume(target)
                lineage, leased = list(kept), set()
                step = 0 if back is None else back[0]
                saved = [s for s in saved if s[0] <= step] if back is not None else []
        state = replay(led, RUN)
        assert state.verify() == []
        costs = restart_costs(led, state)
        got = [(c.checkpoint_step, c.kept, c.requeued, c.redone) for c in costs]
        assert got == expected
        assert all(c.regenerated == 0 for c in costs)
