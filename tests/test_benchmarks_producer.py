"""The producer data-plane CPU row: it runs end to end, and both sides move the same samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_producer
from benchmarks._runner import TINY_ENV


@pytest.mark.slow
def test_the_producer_row_measures_ours_and_the_raw_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TINY_ENV, "1")  # the numbers mean nothing: a check that it runs
    got = bench_producer.rows(tmp_path, quick=True)
    ledgers = ["SQLite", "PostgreSQL"][: len(got)]  # PostgreSQL where its server is installed
    assert [r.name for r in got] == [bench_producer.ROW.format(ledger=x) for x in ledgers]
    for measured in got:
        assert measured.target == "<= 1.3" and isinstance(measured.met, bool)
        assert measured.value > 0 and measured.baseline_value > 0
        assert "batches of 64" in measured.note
