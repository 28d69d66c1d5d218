"""`dataflow demo` as a user runs it: a real process starting real producer and rank
processes, a real SIGKILL of both ranks, a resume through the ledger, and the report."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dataflow import Ledger, replay
from tests._zygote import run_cli  # forked warm: the demo imports torch

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _demo(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("demo", *args, cwd=cwd)


def _report(workdir: Path, result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((workdir / "report.json").read_text())


def _check_clean(workdir: Path, report: dict[str, Any]) -> None:
    assert report["committed"] == report["trained"] > 0
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["verify"] == []
    # The report's counts are the ledger's: fold it again, here.
    with Ledger.open(report["ledger_url"]) as ledger:
        state = replay(ledger, report["run_id"])
    assert state.verify() == []
    assert set(state.trained) == set(state.committed) and len(state.committed) == report["trained"]
    assert not state.pending and not state.leased and not state.dead
    metrics = report["final_metrics"]
    assert 0 < metrics["eval/simulated_acc_len"] <= 3 and "eval/acceptance_rate_2" in metrics
    assert report["samples_per_s"] > 0 and report["wall_s"] > 0
    if HAS_MATPLOTLIB:
        assert (workdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert report["timeline"] == str(workdir / "timeline.png")
    else:
        assert "matplotlib is not installed" in report["timeline_note"]


@pytest.mark.slow
def test_quick_demo_survives_a_sigkill_of_both_ranks(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    # 1,024 samples, not --quick's 384: on a loaded machine the ranks could train all 384
    # before the conductor's watch saw the kill's share and its delay go by (no crash).
    result = _demo("--quick", "--samples", "1024", "--workdir", str(workdir), "--seed", "3")
    report = _report(workdir, result)
    _check_clean(workdir, report)
    assert report["resumes"] >= 1
    kill = report["kill"]
    assert kill["exit_codes"] == [-signal.SIGKILL] * 2  # a real SIGKILL, of both ranks
    assert 0 < kill["trained"] < report["committed"]  # partway through
    out = result.stdout
    assert "SIGKILL rank 0" in out and "resumed from" in out
    assert "$ dataflow replay --ledger" in out and "verify: clean" in out  # the replay report
    logs = workdir / "runs" / report["run_id"] / "logs"
    assert {p.name for p in logs.iterdir()} >= {
        "producer-0.log",
        "producer-1.log",
        "rank0-attempt1.log",
        "rank1-attempt1.log",
        "rank0-attempt2.log",
        "rank1-attempt2.log",
    }


@pytest.mark.slow
def test_no_crash_trains_everything_without_a_resume(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = _demo("--quick", "--no-crash", "--samples", "128", "--workdir", str(workdir))
    report = _report(workdir, result)
    _check_clean(workdir, report)
    assert report["committed"] == 128
    assert report["resumes"] == 0 and report["kill"] is None
    assert "SIGKILL rank" not in result.stdout and "resumed from" not in result.stdout


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        pytest.param(
            ["--workdir", "{file}"], 2, "is a file, not a directory; pass a directory", id="file"
        ),
        pytest.param(
            ["--start-mooncake-master"],
            2,
            "--start-mooncake-master starts the master of a mooncake:// store",
            id="master-without-mooncake",
        ),
        pytest.param(
            ["--store", "mem://features"], 2, "lives in one process", id="store-in-memory"
        ),
        pytest.param(
            ["--store", "s3://bucket"], 2, "no store is registered for 's3'", id="store-unknown"
        ),
        pytest.param(["--samples", "10"], 2, "--samples: must be from 64", id="few-samples"),
        pytest.param(
            ["--store", "dir://relative/x"],
            2,
            "a dir:// URI names an absolute path",
            id="store-dir-relative",
        ),
        pytest.param(
            ["--store", "mooncake://127.0.0.1:99999"],
            2,
            "with a port from 1 to 65535",
            id="store-port",
        ),
        pytest.param(["--ledger", "sqlite://"], 2, "in-memory SQLite", id="ledger-in-memory"),
    ],
)
def test_bad_inputs_are_one_line_and_start_nothing(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a directory\n")
    result = _demo(*[a.format(file=file) for a in args], cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dataflow"), result.stderr
    assert says in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # no ./dataflow-demo made


def test_the_report_counts_acks_of_the_final_lineage_only() -> None:
    from dataflow import Event, Kind
    from dataflow.demo._report import lineage_report

    def ev(seq: int, kind: str, sid: str | None, epoch: int, step: int | None, **p: Any) -> Event:
        return Event(seq, "r", kind, sid, epoch, step, "rank0", p, float(seq))

    events = [
        ev(1, Kind.RESUME, None, 1, None, checkpoint_seq=None),
        ev(2, Kind.ACK, "s1", 1, 1),
        ev(3, Kind.CHECKPOINT, None, 1, 1),
        ev(4, Kind.ACK, "s2", 1, 2),  # after the checkpoint: abandoned by the resume below
        ev(5, Kind.RESUME, None, 2, 1, checkpoint_seq=3),
        ev(6, Kind.ACK, "s2", 2, 2),
        ev(7, Kind.ACK, "s3", 2, 3),
    ]
    lineage = lineage_report(events)
    assert lineage.acks == {"s1": 1, "s2": 1, "s3": 1}
    assert lineage.resume_ts == [1.0, 5.0] and lineage.checkpoints == [(3.0, 1)]
    twice = lineage_report([*events, ev(8, Kind.ACK, "s1", 2, 4)])
    assert twice.acks["s1"] == 2  # trained again in the same lineage: counted, not hidden


def test_ranks_that_finish_before_the_kill_is_due_are_reported_not_skipped_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Unit test of the conductor's logic (the children are stand-ins): on a fast machine
    # the ranks may finish before the SIGKILL is due; the run says it had no crash, and
    # the watch stops trying (it kept resetting its stall timer on every later tick).
    import time
    from types import SimpleNamespace

    from dataflow.demo import DemoOptions
    from dataflow.demo._run import Demo, _Child
    from dataflow.model._fold import RunState

    demo = Demo(DemoOptions(workdir=str(tmp_path), quick=True))
    demo.started, demo.kill_at, demo.kill_delay = time.monotonic(), 0, 0.0
    demo.attempt = 1  # the ranks of the first start
    log = tmp_path / "rank.log"
    log.write_text("")
    demo.ranks = [
        _Child(f"rank{r}-attempt1", SimpleNamespace(exitcode=0, pid=0), log)  # type: ignore[arg-type]
        for r in range(2)
    ]
    state = RunState("r")
    assert demo._tick(state, time.monotonic()) is False  # due at once, but nothing to kill
    assert demo._tick(state, time.monotonic()) is False
    assert demo.timeline.kill is None
    assert "the ranks finished before the SIGKILL was due" in capsys.readouterr().out


def test_a_child_that_dies_while_the_tick_looks_is_the_tick_s_to_notice_next_round(
    tmp_path: Path,
) -> None:
    # Unit test of the conductor's logic (stand-in children): a producer that SIGKILLs
    # itself at its planned point just after the tick looked was taken for a failure.
    import time
    from types import SimpleNamespace

    from dataflow.demo import DemoError, DemoOptions
    from dataflow.demo._run import Demo, _Child
    from dataflow.model._fold import RunState

    demo = Demo(DemoOptions(workdir=str(tmp_path), quick=True, crash=False))
    log = tmp_path / "producer.log"
    log.write_text("")
    child = _Child("producer-0", SimpleNamespace(exitcode=None, pid=0), log)  # type: ignore[arg-type]
    demo.children = [child]

    def dies_meanwhile(state: RunState, now: float) -> bool:
        child.process.exitcode = -signal.SIGKILL  # its own planned kill, not seen yet
        return False

    demo._tick = dies_meanwhile  # type: ignore[method-assign]
    assert demo._tick_and_check(RunState("r"), time.monotonic()) is False  # not this round
    demo._tick = lambda state, now: False  # type: ignore[method-assign]
    with pytest.raises(DemoError, match="producer-0 was killed by signal 9"):
        demo._tick_and_check(RunState("r"), time.monotonic())  # next round: nobody claimed it
