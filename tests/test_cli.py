"""The dataflow command line, run as a real process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dataflow import Consumer, Ledger, Producer
from stores import LocalFeatureStore
from tests._zygote import run_cli  # forked warm: the imports cost more than a command

ROOT = Path(__file__).resolve().parent.parent


def ckpt(root: Path, name: str) -> str:
    """Checkpoint directory ``root/name``, made (checkpoint paths must exist)."""
    (root / name).mkdir()
    return str(root / name)


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd)  # no $DATAFLOW_LEDGER: the default ledger


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
    cons.checkpoint(step=1, path=ckpt(tmp_path, "ck1"))
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
        first = cons.checkpoint(step=1, path=ckpt(tmp_path, "ck1"), digest="ab" * 32)
        cons.checkpoint(step=2, path=ckpt(tmp_path, "ck2"))
        cons.remove_checkpoints([first], reason="retention")
    report = json.loads(_cli("replay", "--ledger", url, "--run", "r1", "--json").stdout)
    assert [(c["step"], c["digest"], c["removed"]) for c in report["checkpoints"]] == [
        (1, "ab" * 32, "retention"),
        (2, None, None),
    ]
    assert report["violations"] == []
    text = _cli("replay", "--ledger", url, "--run", "r1").stdout
    assert f"step 1 (epoch 1) {tmp_path}/ck1 [removed: retention]" in text
    assert f"step 2 (epoch 1) {tmp_path}/ck2\n" in text


def test_replay_upto_folds_a_prefix(run_url: str) -> None:
    report = json.loads(
        _cli("replay", "--ledger", run_url, "--run", "r1", "--upto", "6", "--json").stdout
    )
    assert report["head_seq"] == 6 and report["committed"] == 5 and report["trained"] == 0


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
    assert result.returncode == 1 and "'nope'" in result.stderr and "'r1'" in result.stderr
    result = _cli("replay", "--ledger", "mysql://x/y", "--run", "r1")
    assert result.returncode == 2 and "mysql://x/y" in result.stderr


def test_runs_events_and_export(run_url: str, tmp_path: Path) -> None:
    assert _cli("runs", "--ledger", run_url).stdout.split() == ["r1"]
    lines = _cli("events", "--ledger", run_url, "--run", "r1", "--after", "5").stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(6, 6 + len(events)))
    assert events[0]["kind"] == "commit" and events[1]["kind"] == "resume"
    out = tmp_path / "events.parquet"
    assert _cli("export", "--ledger", run_url, "--run", "r1", "--out", str(out)).returncode == 0
    table = pq.read_table(out)
    # One row per event of one sample: a batch row as the rows of one sample it stands for.
    assert table.num_rows == sum(len(e["payload"].get("samples", [None])) for e in events) + 5
    assert table.column("kind").to_pylist()[:6] == ["claim"] + ["commit"] * 5
    samples = pq.read_table(tmp_path / "events.samples.parquet")  # beside it: one row a sample
    assert samples.column("state").to_pylist() == ["trained"] * 3 + ["pending"] * 2


def test_quickstart_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "violations: []" in result.stdout


# -- errors: one line on stderr with a hint; 2 for usage, 1 for failures; nothing created ------


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["runs"], id="runs"),
        pytest.param(["replay", "--run", "r1"], id="replay"),
        pytest.param(["events", "--run", "r1"], id="events"),
        pytest.param(["export", "--run", "r1", "--out", "{tmp}/r1.parquet"], id="export"),
        pytest.param(["status", "--run", "r1"], id="status"),
    ],
)
def test_inspecting_a_mistyped_ledger_path_fails_and_creates_nothing(
    tmp_path: Path, args: list[str]
) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    typo = f"sqlite:///{tmp_path}/tpyo/ledger.db"
    result = _cli(*args, "--ledger", typo)
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"dataflow: error: no ledger at {tmp_path}/tpyo/ledger.db: the file does not exist "
        "(nothing was created); check the path\n"
    )
    assert result.stdout == ""
    default = _cli(*args, cwd=tmp_path)  # the default ledger, ./dataflow.db: a usage error
    assert default.returncode == 2 and "no ledger at ./dataflow.db" in default.stderr
    assert "pass --ledger URL or set DATAFLOW_LEDGER" in default.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_ledger_is_reported_not_reopened_as_an_empty_one(run_url: str) -> None:
    path = Path(run_url.removeprefix("sqlite:///"))
    path.write_bytes(b"")  # lost its data
    for args in (["runs"], ["replay", "--run", "r1"]):
        result = _cli(*args, "--ledger", run_url)
        assert result.returncode == 1
        assert "is an empty file (0 bytes), not a ledger" in result.stderr
        assert "known runs: none" not in result.stderr + result.stdout
    assert path.stat().st_size == 0


def test_events_of_an_unknown_run_fail_and_name_the_known_runs(run_url: str) -> None:
    result = _cli("events", "--ledger", run_url, "--run", "nosuch")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        f"dataflow: error: run 'nosuch' has no events in {run_url}; known runs: 'r1' "
        "(check --run)\n"
    )
    waiting = _cli("events", "--ledger", run_url, "--run", "nosuch", "--follow", "--timeout", "0.2")
    assert waiting.returncode == 0 and waiting.stdout == ""
    assert "run 'nosuch' has no events" in waiting.stderr and "'r1'" in waiting.stderr


# (id, arguments ({url}: a ledger with run r1, {tmp}: a directory), exit status, stderr says)
CLI_ERRORS = [
    ("upto-overflow", ["replay", "--run", "r1", "--upto", "9" * 23], 2, "--upto: must be from 0"),
    ("upto-negative", ["replay", "--run", "r1", "--upto", "-1"], 2, "--upto: must be from 0"),
    ("after-not-int", ["events", "--run", "r1", "--after", "x"], 2, "--after: expected an int"),
    ("timeout-nan", ["events", "--run", "r1", "--timeout", "nan"], 2, "--timeout: expected"),
    ("run-control", ["replay", "--run", "r\x01"], 2, r"--run: run id 'r\\x01' holds the control"),
    ("run-unknown", ["replay", "--run", "nosuch"], 1, "known runs: 'r1' \\(check --run\\)"),
    ("export-no-dir", ["export", "--run", "r1", "--out", "{tmp}/no/r1.parquet"], 2, "create it"),
    ("export-onto-dir", ["export", "--run", "r1", "--out", "{tmp}"], 2, "is a directory; name"),
    ("export-file-onto-dir", ["export", "--run", "r1", "{tmp}"], 2, "is a directory; name"),
    ("status-window", ["status", "--run", "r1", "--window", "-1"], 2, "--window: expected"),
    ("ledger-scheme", ["runs", "--ledger", "mysql://x/y"], 2, "unsupported ledger URL"),
    ("ledger-memory", ["runs", "--ledger", "sqlite://"], 2, "in-memory SQLite"),
    ("ledger-missing", ["runs", "--ledger", "sqlite:///{tmp}/no.db"], 1, "no ledger at"),
    ("demo-samples", ["demo", "--samples", "3"], 2, "--samples: must be from 64"),
    ("demo-seed", ["demo", "--seed", str(2**64)], 2, "--seed: must be from 0"),
    (
        "demo-dir-in-proc",
        ["demo", "--workdir", "/proc/dataflow-demo", "--quick"],
        1,
        "cannot make the demo's work directory /proc/dataflow-demo: .*pass --workdir",
    ),
]


@pytest.mark.parametrize(
    ("args", "code", "match"), [pytest.param(*row[1:], id=row[0]) for row in CLI_ERRORS]
)
def test_every_cli_error_is_one_line_with_a_hint(
    run_url: str, tmp_path: Path, args: list[str], code: int, match: str
) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    if args[0] != "demo" and "--ledger" not in args:
        args += ["--ledger", run_url]
    before = sorted(tmp_path.rglob("*"))
    result = _cli(*args)
    assert result.returncode == code, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dataflow"), result.stderr
    assert re.search(match, result.stderr), result.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    result = _cli("--debug", "runs", "--ledger", f"sqlite:///{tmp_path}/no.db")
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback") and "NotALedgerError" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("dataflow: error: no ledger at")
