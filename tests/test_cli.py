"""The dataflow command line, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dataflow import Consumer, Ledger, Producer
from stores import LocalFeatureStore

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataflow.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture
def run_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/ledger.db"
    led = Ledger.open(url)
    store = LocalFeatureStore()
    prod = Producer(led, store, run_id="r1")
    for i in range(5):
        prod.emit(f"s{i}", {"x": torch.zeros(2)})
    cons = Consumer(led, store, run_id="r1", consumer_id="c")
    cons.resume()
    cons.ack(cons.lease(3), step=1)
    cons.checkpoint(step=1, path="ck1")
    led.close()
    return url


def test_replay_reports_and_verifies(run_url: str) -> None:
    result = _cli("replay", "--ledger", run_url, "--run", "r1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["committed"] == 5 and report["trained"] == 3 and report["pending"] == 2
    assert report["violations"] == [] and report["checkpoints"][0]["step"] == 1
    text = _cli("replay", "--ledger", run_url, "--run", "r1")
    assert "verify: clean" in text.stdout


def test_replay_shows_digests_and_removed_checkpoints(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    with Ledger.open(url) as led:
        cons = Consumer(led, LocalFeatureStore(), run_id="r1", consumer_id="c")
        cons.resume()
        first = cons.checkpoint(step=1, path="ck1", digest="ab" * 32)
        cons.checkpoint(step=2, path="ck2")
        cons.remove_checkpoints([first], reason="retention")
    report = json.loads(_cli("replay", "--ledger", url, "--run", "r1", "--json").stdout)
    assert [(c["step"], c["digest"], c["removed"]) for c in report["checkpoints"]] == [
        (1, "ab" * 32, "retention"),
        (2, None, None),
    ]
    assert report["violations"] == []
    text = _cli("replay", "--ledger", url, "--run", "r1").stdout
    assert "step 1 (epoch 1) ck1 [removed: retention]" in text
    assert "step 2 (epoch 1) ck2\n" in text


def test_replay_upto_folds_a_prefix(run_url: str) -> None:
    report = json.loads(
        _cli("replay", "--ledger", run_url, "--run", "r1", "--upto", "5", "--json").stdout
    )
    assert report["head_seq"] == 5 and report["committed"] == 5 and report["trained"] == 0


def test_replay_exits_1_on_violations(run_url: str) -> None:
    import sqlite3

    path = run_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:  # forge an ack of a sample nobody leased
        conn.execute(
            "INSERT INTO dataflow_events (run_id, kind, sample_id, epoch, step, actor, ts)"
            " VALUES ('r1', 'ack', 's4', 1, 2, 'c', 0)"
        )
    result = _cli("replay", "--ledger", run_url, "--run", "r1")
    assert result.returncode == 1
    assert "did not lease it" in result.stdout


def test_unknown_run_and_bad_url_are_clear_errors(run_url: str) -> None:
    result = _cli("replay", "--ledger", run_url, "--run", "nope")
    assert result.returncode == 2 and "'nope'" in result.stderr and "r1" in result.stderr
    result = _cli("replay", "--ledger", "mysql://x/y", "--run", "r1")
    assert result.returncode == 2 and "mysql://x/y" in result.stderr


def test_runs_events_and_export(run_url: str, tmp_path: Path) -> None:
    assert _cli("runs", "--ledger", run_url).stdout.split() == ["r1"]
    lines = _cli("events", "--ledger", run_url, "--run", "r1", "--after", "4").stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(5, 5 + len(events)))
    assert events[0]["kind"] == "commit" and events[1]["kind"] == "resume"
    out = tmp_path / "events.parquet"
    assert _cli("export", "--ledger", run_url, "--run", "r1", "--out", str(out)).returncode == 0
    table = pq.read_table(out)
    assert table.num_rows == len(events) + 4
    assert table.column("kind").to_pylist()[:5] == ["commit"] * 5


def test_demo_runs_clean(tmp_path: Path) -> None:
    result = _cli("demo", "--dir", str(tmp_path / "demo"), "--samples", "24")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: clean" in result.stdout
    check = _cli(
        "replay",
        "--ledger",
        f"sqlite:///{tmp_path / 'demo' / 'ledger.db'}",
        "--run",
        "demo",
        "--json",
    )
    report = json.loads(check.stdout)
    assert report["trained"] == report["committed"] == 24


def test_quickstart_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "violations: []" in result.stdout
