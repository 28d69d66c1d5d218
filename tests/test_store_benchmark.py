"""The store benchmark runs end to end at a tiny size (its numbers are not checked)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import bench_stores


def test_store_benchmark_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "report.md"
    body = bench_stores.main(
        ["--sizes", "0.25", "--reps", "0.1", "--dir", str(tmp_path), "--no-mooncake",
         "--out", str(out)]
    )  # fmt: skip
    for row in (
        "| 256 KiB | `SharedDirFeatureStore`",
        "| 256 KiB | safetensors files",
        "| 256 KiB | `SharedDirFeatureStore`, checksums off",
    ):
        assert row in body
    assert "- checksum cost (put+get with checksums ÷ without" in body
    assert "256 KiB" in body.split("- checksum cost")[1] and "target ≤ 10%" in body
    assert "ours ÷ raw: 256 KiB" in body and "`LocalFeatureStore.get` µs" in body
    assert out.read_text() == f"## Benchmarks\n\n{body}\n"
    assert body in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # the files are cleaned up
