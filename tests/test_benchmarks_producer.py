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
    (got,) = bench_producer.rows(tmp_path, quick=True)
    assert got.name == bench_producer.ROW and got.target == "<= 1.3"
    assert got.value > 0 and got.baseline_value > 0 and isinstance(got.met, bool)
    assert "batches of 64" in got.note
