"""``dataflow diff``: the final lineages of two runs compared (committed, trained, order).

A real SIGKILLed, resumed offline run of the demo against its uninterrupted twin (the
chaos harness runs both: the same seeded data, their weights compared with torch.equal),
then hand-built runs that differ in order, ranks, committed and trained sets, across two
ledger files, and bad input.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from dataflow import Consumer, InvalidArgumentError, Kind, Ledger, Producer, RunMetrics, replay
from dataflow.cli import main
from dataflow.tools import diff_runs
from stores import LocalFeatureStore
from tests._cli import run_cli

KEYS = (
    "same_committed",
    "same_trained",
    "same_order",
    "first_divergence_step",
    "only_in_a",
    "only_in_b",
)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One chaos trial, offline (the seeded order), rank 0 SIGKILLed partway and the ranks
    restarted, and the uninterrupted reference run, both in one ledger."""
    workdir = tmp_path_factory.mktemp("chaos")
    url = f"sqlite:///{workdir}/ledger.db"
    args = ("--quick", "--trials", "1", "--seed", "7", "--mode", "offline", "--targets", "rank")
    out = workdir / "chaos.json"
    result = run_cli(
        "chaos", *args, "--workdir", str(workdir / "w"), "--ledger", url, "--json", str(out)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    trial = json.loads(out.read_text())["results"][0]
    assert trial["mismatch"] is False  # torch.equal weights: the chaos harness's own check
    with Ledger.open(url, create=False) as ledger:
        runs = ledger.runs()
    assert len(runs) == 2 and trial["run_id"] in runs
    reference = next(r for r in runs if r != trial["run_id"])
    return {"url": url, "reference": reference, "resumed": trial["run_id"], "trial": trial}


def _diff(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["diff", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_sigkill_resumed_run_and_its_uninterrupted_twin_are_identical(
    twins: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    url, a, b = twins["url"], twins["reference"], twins["resumed"]
    with Ledger.open(url, create=False) as ledger:
        resumed = replay(ledger, b)
    assert len(resumed.plans) == 2 and resumed.verify() == []  # a real restart, clean
    code, report = _diff(capsys, "--ledger", url, "--run", a, "--other-run", b)
    assert code == 0
    assert {k: report[k] for k in KEYS} == {
        "same_committed": True,
        "same_trained": True,
        "same_order": True,
        "first_divergence_step": None,
        "only_in_a": 0,
        "only_in_b": 0,
    }
    assert report["trained_a"] == report["trained_b"] == 128
    # As an operator runs it: the text, and the exit status.
    result = run_cli("diff", "--ledger", url, "--run", a, "--other-run", b)
    assert result.returncode == 0, result.stderr
    assert "order: same (step, rank, sample)" in result.stdout
    assert "verdict: identical" in result.stdout


def test_the_restart_s_cost_of_the_sigkilled_run(
    twins: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checked against the ledger's events, read here on their own.
    url, run = twins["url"], twins["resumed"]
    assert main(["replay", "--ledger", url, "--run", run, "--json"]) == 0
    (resume,) = json.loads(capsys.readouterr().out)["resumes"]
    with Ledger.open(url, create=False) as ledger:
        state = replay(ledger, run)
        events = list(ledger.events(run))
    # The kill is timed by the wall clock: the restart's checkpoint may be any (or none).
    ckpt = state.plans[2].checkpoint
    cut = -1 if ckpt is None else ckpt.step
    assert resume["checkpoint"] == (None if ckpt is None else {"seq": ckpt.seq, "step": cut})
    acked_at = {
        s: e.step for e in events if e.kind == Kind.ACK and e.epoch == 1 for s in e.sample_ids
    }
    kept = {s for s, step in acked_at.items() if step <= cut}
    redone = {s for s, step in acked_at.items() if step > cut}
    leased = {s for e in events if e.kind == Kind.LEASE and e.epoch == 1 for s in e.sample_ids}
    in_flight = leased - set(acked_at)
    assert resume["kept"] == len(kept) == len(state.plans[2].trained)
    assert resume["redone_sample_steps"] == len(redone)
    assert resume["requeued"] + resume["regenerated"] == len(redone | in_flight)
    fenced = [e for e in events if e.epoch == 1 and e.kind in Kind.FENCED]
    first_lease = next(e for e in events if e.kind == Kind.LEASE and e.epoch == 2)
    assert (resume["last_event_seq"], resume["first_lease_seq"]) == (
        fenced[-1].seq,
        first_lease.seq,
    )
    assert resume["seconds"] == pytest.approx(first_lease.ts - fenced[-1].ts, abs=1e-6)
    with Ledger.open(url, create=False) as ledger:
        registry = CollectorRegistry()
        metrics = RunMetrics(ledger, run, registry=registry)
        try:
            scraped = generate_latest(registry).decode()
        finally:
            metrics.close()
    assert f'dataflow_resumes_total{{run="{run}"}} 1.0' in scraped
    redone_line = f'dataflow_resume_redone_sample_steps_total{{run="{run}"}} {len(redone)}.0'
    assert redone_line in scraped


# -- hand-built runs ---------------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[LocalFeatureStore]:
    with LocalFeatureStore() as feature_store:
        yield feature_store


Build = Callable[..., None]


@pytest.fixture
def build(store: LocalFeatureStore) -> Build:
    """``build(url, run, commit_order, steps, ranks=1)``: commit the ids in that order, then
    train ``steps`` (each step: how many samples every rank leases and acks)."""

    def run(url: str, run_id: str, order: str, steps: list[int], ranks: int = 1) -> None:
        with Ledger.open(url) as ledger:
            Producer(ledger, store, run_id=run_id).emit_many(
                (sid, {"x": torch.tensor([ord(sid)])}) for sid in order
            )
            consumers = [
                Consumer(
                    ledger, store, run_id=run_id, consumer_id=f"r{r}", rank=r, world_size=ranks
                )
                for r in range(ranks)
            ]
            for consumer in consumers:  # rank 0 first
                consumer.resume()
            for step, count in enumerate(steps, 1):
                for consumer in consumers:
                    refs = consumer.lease(count)
                    consumer.ack(refs, step=step)

    return run


def test_two_runs_in_another_order_diverge_at_the_step_where_they_differ(
    sqlite_url: str, build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    build(sqlite_url, "a", "abcdef", [2, 2, 2])  # steps: ab, cd, ef
    build(sqlite_url, "b", "abcedf", [2, 2, 2])  # steps: ab, ce, df
    code, report = _diff(capsys, "--ledger", sqlite_url, "--run", "a", "--other-run", "b")
    assert code == 1
    assert {k: report[k] for k in KEYS} == {
        "same_committed": True,
        "same_trained": True,
        "same_order": False,
        "first_divergence_step": 2,
        "only_in_a": 0,
        "only_in_b": 0,
    }
    assert report["divergence"] == {"step": 2, "a": [[0, "c"], [0, "d"]], "b": [[0, "c"], [0, "e"]]}
    # The same steps in another order of acks within a step are the same order.
    build(sqlite_url, "c", "abdcfe", [2, 2, 2])  # steps: ab, dc, fe
    code, report = _diff(capsys, "--ledger", sqlite_url, "--run", "a", "--other-run", "c")
    assert code == 0 and report["same_order"] and report["first_divergence_step"] is None
    # In text.
    assert main(["diff", "--ledger", sqlite_url, "--run", "a", "--other-run", "b"]) == 1
    out = capsys.readouterr().out
    assert "order: DIFFERENT from step 2" in out and "verdict: the runs differ" in out
    assert "rank 0: c, rank 0: d" in out and "rank 0: c, rank 0: e" in out


def test_the_same_samples_at_a_step_on_other_ranks_are_another_order(
    sqlite_url: str, build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    build(sqlite_url, "a", "abcd", [1, 1], ranks=2)  # rank 0: a, c; rank 1: b, d
    build(sqlite_url, "b", "bacd", [1, 1], ranks=2)  # rank 0: b, c; rank 1: a, d
    code, report = _diff(capsys, "--ledger", sqlite_url, "--run", "a", "--other-run", "b")
    assert code == 1
    assert (report["same_trained"], report["same_order"]) == (True, False)
    assert report["divergence"] == {"step": 1, "a": [[0, "a"], [1, "b"]], "b": [[0, "b"], [1, "a"]]}


def test_different_committed_and_trained_sets(
    sqlite_url: str, build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    build(sqlite_url, "a", "abcdef", [2, 2, 2])
    build(sqlite_url, "more", "abcdefgh", [2, 2, 2])  # g, h committed, not trained
    code, report = _diff(capsys, "--ledger", sqlite_url, "--run", "a", "--other-run", "more")
    assert code == 0  # the trained sets and orders are the same
    assert (report["same_committed"], report["same_trained"], report["same_order"]) == (
        False,
        True,
        True,
    )
    assert (report["committed_only_in_a"], report["committed_only_in_b"]) == (0, 2)

    build(sqlite_url, "less", "abcdef", [2, 2, 1])  # f never trained
    code, report = _diff(capsys, "--ledger", sqlite_url, "--run", "a", "--other-run", "less")
    assert code == 1
    assert {k: report[k] for k in KEYS} == {
        "same_committed": True,
        "same_trained": False,
        "same_order": False,
        "first_divergence_step": 3,
        "only_in_a": 1,
        "only_in_b": 0,
    }
    assert report["only_in_a_samples"] == ["f"] and report["only_in_b_samples"] == []
    assert main(["diff", "--ledger", sqlite_url, "--run", "a", "--other-run", "less"]) == 1
    out = capsys.readouterr().out
    assert "trained: DIFFERENT (A 6, B 5; 1 only in A, 0 only in B)" in out
    assert "only in A: f" in out


def test_runs_in_two_ledger_files(
    tmp_path: Path, build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = f"sqlite:///{tmp_path}/one.db", f"sqlite:///{tmp_path}/two.db"
    build(first, "run", "abcdef", [2, 2, 2])
    build(second, "run", "abcdef", [2, 2, 2])
    build(second, "other", "abcdef", [3, 3])
    same = ("--ledger", first, "--run", "run", "--other-run", "run", "--other-ledger", second)
    code, report = _diff(capsys, *same)
    assert code == 0 and report["same_order"] and report["same_trained"]
    code, report = _diff(
        capsys, "--ledger", first, "--run", "run", "--other-ledger", second, "--other-run", "other"
    )
    assert code == 1 and report["first_divergence_step"] == 1
    # The library call says the same.
    with Ledger.open(first, create=False) as a, Ledger.open(second, create=False) as b:
        diff = diff_runs(a, "run", "other", other_ledger=b)
        with pytest.raises(InvalidArgumentError, match="run 'nope' has no events"):
            diff_runs(a, "run", "nope")
    assert (diff.identical, diff.first_divergence_step, diff.trained_b) == (False, 1, 6)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ["--run", "nope", "--other-run", "a"], "run 'nope' has no events", id="unknown-run"
        ),
        pytest.param(
            ["--run", "a", "--other-run", "nope"], "run 'nope' has no events", id="unknown-other"
        ),
        pytest.param(
            ["--run", "a", "--other-run", "a", "--other-ledger", "sqlite:///{tmp}/missing.db"],
            "missing.db",
            id="other-ledger-missing",
        ),
        pytest.param(["--run", "a"], "--other-run", id="no-other-run"),
        pytest.param(
            ["--run", "a", "--other-run", "a", "--other-ledger", "nosuch://x"],
            "--other-ledger",
            id="other-ledger-url",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, sqlite_url: str, build: Build, args: list[str], says: str
) -> None:
    build(sqlite_url, "a", "ab", [1])
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_cli("diff", "--ledger", sqlite_url, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dataflow") and says in line
