"""The rows of issue #37 (PostgreSQL targets, the load run, rows per trained sample) run at
tiny sizes and come with their names, units and targets; the load run loses nothing.

The numbers are not checked (a shared machine moves them), only that they come, and
the load run's own check (0 lost, 0 duplicated) where it is a property of the library.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import _pg_profile, _runner, bench_demo, bench_load, bench_pg
from dataflow import Consumer, Ledger, Producer
from dataflow.testing._postgres import find_bin_dir
from stores import LocalFeatureStore
from tests.conftest import unavailable
from tests.test_benchmarks_rows import check


@pytest.fixture
def postgres_tools() -> None:
    try:
        find_bin_dir()
    except RuntimeError as exc:
        unavailable(str(exc))


def test_the_configs_carry_the_issue_targets():
    targets = {(c.writers, c.mode, c.consumer): (c.target, c.p99_target) for c in bench_pg.CONFIGS}
    one = bench_pg.ONE_RUN
    assert targets[8, one, True] == (">= 0.8", "<= 2")
    assert targets[8, one, False] == (">= 0.5", None)
    assert targets[1, one, False] == (">= 0.6", None)
    assert targets[32, one, True] == (">= 0.7", None)
    # The rows measured before #37 are still there, under their names.
    for n, mode in ((1, one), (4, one), (4, bench_pg.OWN_RUNS), (8, bench_pg.OWN_RUNS)):
        assert (n, mode, True) in targets


def test_pg_rows_with_targets_and_cpu(postgres_tools, tmp_path):
    # One measurement that takes every path: targets, no consumer, the lock, the CPU.
    configs = (
        bench_pg.Config(2, consumer=False, target=">= 0.5", p99_target="<= 2", lock=True, cpu=True),
    )
    rows = bench_pg.rows(tmp_path, quick=True, seconds=0.3, configs=configs)
    where = "2 writers, one run, no consumer"
    expected: dict[str, tuple[str, str | None]] = {
        f"pg ledger commit, {where}": ("events/s", ">= 0.5"),
        f"pg ledger commit p50 latency, {where}": ("ms", None),
        f"pg ledger commit p99 latency, {where}": ("ms", "<= 2"),
        f"pg raw executemany + per-run row lock, {where}": ("events/s", None),
        f"pg writer CPU per commit event, {where}": ("us", None),
        f"pg server CPU per event, {where}": ("us", None),
    }
    check(rows, expected)
    assert not list(tmp_path.iterdir())


def test_profile_table(postgres_tools, tmp_path):
    text = _pg_profile.report(tmp_path, seconds=0.3)
    assert "| where the CPU goes" in text
    assert "**all** (plain run, no profiler)" in text
    assert "dataflow.recorder" in text
    assert not list(tmp_path.iterdir())


def test_load_run_loses_nothing(postgres_tools, tmp_path):
    rows = bench_load.rows(tmp_path, quick=True, seconds=1.0, producers=2, consumers=2)
    names = [r.name.split(",")[0] for r in rows]
    assert names == [
        "load: sample events/s",
        "load: commit p50 latency",
        "load: lease p50 latency",
        "load: consumer resident set at the end",
        "load: samples lost + duplicated",
    ]
    assert all(r.baseline_value and r.baseline_value > 0 for r in rows)
    lost = rows[-1]
    assert lost.value == 0, lost.note
    assert "0 violations" in lost.note
    assert "steepest slope" in rows[3].note
    assert not list(tmp_path.iterdir())


def test_histogram_quantiles():
    h = bench_load.Histogram()
    for ms in range(1, 101):
        h.add(ms / 1000)
    assert h.quantile(0.5) == pytest.approx(0.050, rel=0.03)
    assert h.quantile(0.99) == pytest.approx(0.099, rel=0.03)


def test_rows_per_trained_sample_counts_the_table(tmp_path):
    path = tmp_path / "ledger.db"
    with Ledger.open(f"sqlite:///{path}") as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="r", producer_id="p")
        refs = [bench_pg.bench_ref(f"s{i}") for i in range(10)]
        producer.commit(refs)
        producer.close()
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c", release_policy="never")
        consumer.resume()
        leased = consumer.lease(10)
        consumer.ack(leased, step=1)
        consumer.close()
        head = ledger.head_seq("r")
    rows, trained = bench_demo.rows_per_trained_sample(path, "r")
    assert trained == 10
    assert rows == head  # every row of the run: its sequence numbers run 1..head


def test_load_is_not_run_by_default(monkeypatch, tmp_path):
    ran: list[str] = []

    def fake(names, workdir, *, quick, registry):
        ran.extend(names)
        return _runner.Outcome([], [], 0.0, (0.0, 0.0))

    monkeypatch.setattr(_runner, "run_modules", fake)
    monkeypatch.setenv(_runner.LOAD_SECONDS_ENV, "")  # main() sets it: undone after the test
    assert _runner.main(["--dir", str(tmp_path)]) == 0
    assert "load" not in ran and "demo" in ran
    ran.clear()
    assert _runner.main(["--only", "load", "--load-seconds", "5", "--dir", str(tmp_path)]) == 0
    assert ran == ["load"]
    assert bench_load.seconds_for(quick=False) == 5.0
