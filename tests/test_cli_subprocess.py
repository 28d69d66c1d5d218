"""Every reading command and option of `dataflow`, run as the real console script.

tests/test_cli_inspect.py checks the outputs in detail in-process; here each command
runs as an operator runs it, a process of its own through the installed `dataflow`
script (or `python -m dataflow` where no script is installed), on one crashed run, and
the checks are what an operator reads: the exit status, the key lines, valid JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_cli_inspect import write_crashed_run

from dataflow import Ledger

_SCRIPT = Path(sys.executable).with_name("dataflow")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dataflow"]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_crashed_run(tmp_path_factory.mktemp("crashed"))


def dataflow(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``dataflow ARGS`` with the ledger from $DATAFLOW_LEDGER, as an operator sets it."""
    env = dict(os.environ, DATAFLOW_LEDGER=url)
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_replay_json_is_the_fold_for_scripts(crashed: str) -> None:
    report = json.loads(ok(dataflow(crashed, "replay", "--run", "r1", "--json")))
    assert report["committed"] == 12
    assert report["violations"] == []
    assert report["lineage"] == [1, 2]
    assert report["epochs"][1]["checkpoint_step"] == 2


def test_replay_time_travel_by_seq_step_and_time(crashed: str) -> None:
    with Ledger.open(crashed, create=False) as led:
        events = list(led.events("r1"))
    first_ack = [e for e in events if e.kind == "ack" and e.step == 1][-1]  # both of step 1
    by_seq = json.loads(
        ok(dataflow(crashed, "replay", "--run", "r1", "--upto", str(first_ack.seq), "--json"))
    )
    by_step = json.loads(ok(dataflow(crashed, "replay", "--run", "r1", "--at-step", "1", "--json")))
    # Halfway to the next step's first ack (at most 1 ms after the first's): the
    # isoformat's microseconds round, and on a fast machine the next step's acks came
    # within 1 ms.
    later = [e.ts for e in events if e.kind == "ack" and (e.step or 0) > 1]
    gap = min([0.002, *(ts - first_ack.ts for ts in later)])
    at = datetime.fromtimestamp(first_ack.ts + gap / 2, UTC).isoformat()
    by_time = json.loads(ok(dataflow(crashed, "replay", "--run", "r1", "--at", at, "--json")))
    assert by_seq["trained"] == 2
    assert by_step["trained"] == 2
    assert by_time["head_seq"] >= first_ack.seq and by_time["trained"] == 2


def test_replay_sample_history(crashed: str) -> None:
    out = ok(dataflow(crashed, "replay", "--run", "r1", "--sample", "s06"))
    assert out.startswith("sample 's06' of run 'r1'")
    kinds = [line.split()[2] for line in out.splitlines()[2:] if line.strip()]
    assert kinds[0] == "commit" and "lease" in kinds and "ack" in kinds


def test_replay_plan_resume_writes_nothing(crashed: str) -> None:
    with Ledger.open(crashed, create=False) as led:
        head = led.head_seq("r1")
    out = ok(dataflow(crashed, "replay", "--run", "r1", "--plan-resume", "2"))
    assert "from the checkpoint at step 2" in out and "(nothing is written)" in out
    with Ledger.open(crashed, create=False) as led:
        assert led.head_seq("r1") == head


def test_replay_verify_passes_on_a_clean_run(crashed: str) -> None:
    out = ok(dataflow(crashed, "replay", "--run", "r1", "--verify"))
    assert "nothing trained twice in the lineage" in out
    assert out.rstrip().endswith("verify: clean")


def test_replay_plot_writes_a_png(crashed: str, tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    ok(dataflow(crashed, "replay", "--run", "r1", "--plot", str(png)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_once_and_following(crashed: str) -> None:
    out = ok(dataflow(crashed, "status", "--run", "r1"))
    assert out.startswith("run 'r1': 33 events (newest at seq 33 of the ledger")
    assert "12 committed" in out
    follow = ok(
        dataflow(crashed, "status", "--run", "r1", "--follow", "--count", "2",
                 "--interval", "0.1", "--json")
    )  # fmt: skip
    refreshes = [json.loads(line) for line in follow.splitlines() if line.strip()]
    assert len(refreshes) == 2 and refreshes[0]["run_id"] == "r1"


def test_runs_and_a_usage_error(crashed: str) -> None:
    assert ok(dataflow(crashed, "runs")).split() == ["r1"]
    bad = dataflow(crashed, "replay", "--run", "r1", "--upto", "-1")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1
