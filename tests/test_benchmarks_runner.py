"""``python -m benchmarks``: the table, the JSON rows, unknown names, a module that fails."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed

from benchmarks import _runner  # noqa: E402
from benchmarks._rows import row  # noqa: E402

KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target", "met", "note"}


def _benchmarks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_e2e_and_memory_print_one_table_and_write_the_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    # --tiny: below --quick, so that the test stays short (the numbers mean nothing).
    result = _benchmarks(
        "--quick", "--tiny", "--only", "e2e", "memory", "--json", str(out), "--dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    header = "| metric "
    assert result.stdout.count(header) == 1
    for name in ("end to end, trainer side", "end to end: 2 producers", "full window"):
        assert name in result.stdout
    assert "per committed sample" in result.stdout
    assert "benchmarks" in result.stderr  # the progress bar
    items = json.loads(out.read_text())
    assert len(items) == 4
    for item in items:
        assert set(item) == KEYS
        assert item["value"] > 0 and item["baseline_value"] > 0
    # Both end-to-end rows: the committed dataset (the trainer side), then streaming.
    assert [item["target"] for item in items[:2]] == [">= 0.95", ">= 0.85"]
    assert all(isinstance(item["met"], bool) for item in items[:2])
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # the work dir is gone


def test_an_unknown_name_is_exit_2_with_the_list() -> None:
    result = _benchmarks("--only", "e2e", "nonesuch")
    assert result.returncode == 2
    assert "'nonesuch'" in result.stderr
    for name in _runner.REGISTRY:
        assert name in result.stderr


def test_a_failing_module_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def good_rows(workdir: Path, *, quick: bool) -> list:
        assert workdir.is_dir() and quick
        return [row("fake figure", 90.0, "x/s", "fake peer", 100.0, target=">= 0.95")]

    def bad_rows(workdir: Path, *, quick: bool) -> list:
        raise RuntimeError("the fake benchmark broke")

    modules = {
        "fake_bench_bad": types.SimpleNamespace(rows=bad_rows),
        "fake_bench_good": types.SimpleNamespace(rows=good_rows),
        "fake_bench_none": types.SimpleNamespace(),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    registry = {"bad": "fake_bench_bad", "none": "fake_bench_none", "good": "fake_bench_good"}
    out = tmp_path / "rows.json"
    argv = ["--quick", "--json", str(out), "--dir", str(tmp_path)]
    assert _runner.main(argv, registry=registry) == 1
    printed = capsys.readouterr()
    assert "the fake benchmark broke" in printed.out
    assert "module fake_bench_none has no rows() yet" in printed.out
    assert "fake figure" in printed.out and "**missed**" in printed.out
    items = json.loads(out.read_text())
    assert [i["name"] for i in items] == ["fake figure", "bad", "none"]
    assert all(set(i) == KEYS for i in items)
    assert items[1]["note"].startswith("failed: RuntimeError: the fake benchmark broke")

    only_good = ["--quick", "--only", "good", "--dir", str(tmp_path)]
    assert _runner.main(only_good, registry=registry) == 0
