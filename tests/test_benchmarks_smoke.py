"""The benchmarks run end to end at tiny sizes (numbers are not checked, only that they come)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import _report, bench_ledger


def test_ledger_benchmark_runs_and_reports(tmp_path, capsys):
    body = bench_ledger.main(
        ["--batches", "2", "--batch-size", "50", "--events", "3000", "--repeats", "1",
         "--dir", str(tmp_path)]
    )  # fmt: skip
    assert "| dataflow `Producer.commit`" in body
    assert "| eventsourcing `SQLiteAggregateRecorder`" in body
    assert "| dataflow `replay` (read + fold)" in body
    assert "replay of 3,000 events" in body
    assert body in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # the databases are cleaned up


def test_synthetic_run_folds_clean(tmp_path):
    # A resume, 1,024 commits, 32 steps of 32 leases and 32 acks, a checkpoint, 26 commits.
    shape = bench_ledger.build_run(tmp_path / "run.db", 3100)
    assert (shape.events, shape.commits, shape.leases, shape.acks, shape.checkpoints) == (
        3100,
        1050,
        1024,
        1024,
        1,
    )
    with bench_ledger.Ledger.open(f"sqlite:///{tmp_path / 'run.db'}") as led:
        bench_ledger.check_fold(bench_ledger.replay(led, bench_ledger.RUN_ID), shape)


def test_write_section_replaces_only_its_own_section(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nintro\n\n## Ledger\n\nold\n\n## Stores\n\nstores table\n")
    _report.write_section("Ledger", "new table", page)
    _report.write_section("Streams", "streams table", page)
    assert page.read_text() == (
        "# Benchmarks\n\nintro\n\n## Ledger\n\nnew table\n\n## Stores\n\nstores table\n\n"
        "## Streams\n\nstreams table\n"
    )


def test_markdown_table_right_aligns_numbers():
    table = _report.markdown_table(["what", "events/s"], [("a", "1,000"), ("bb", "20")])
    assert table.splitlines() == [
        "| what | events/s |",
        "| ---- | -------: |",
        "| a    |    1,000 |",
        "| bb   |       20 |",
    ]


def test_ledger_rows_for_the_runner(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAFLOW_BENCH_TINY", "1")  # below --quick: only that it runs
    rows = bench_ledger.rows(tmp_path, quick=True)
    assert [(r.name, r.target) for r in rows] == [
        ("ledger append (SQLite): Producer.commit", ">= 0.7"),
        ("ledger append (SQLite): Producer.commit vs eventsourcing", None),
        ("replay of 10^4 events", ">= 0.4"),
    ]
    assert all(r.value > 0 and r.baseline_value and r.ratio > 0 for r in rows)
    assert [r.met is None for r in rows] == [False, True, False]
    assert list(tmp_path.iterdir()) == []  # the databases are cleaned up
