"""`dataflow chaos` as a user runs it: real producer and rank processes, real SIGKILLs of
each target, restarts, and the checks (verify, each sample once, weights, orphans)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dataflow import Ledger, replay
from dataflow.demo import DemoOptions
from dataflow.demo._chaos import ChaosTrial, KillPlan, _same_weights, clean, format_table, summarize
from dataflow.demo._run import _Child
from dataflow.testing._postgres import find_bin_dir
from tests._cli import assert_one_line_exit_2
from tests._zygote import Popen, run_cli
from tests.conftest import unavailable


def _chaos(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("chaos", *args, cwd=cwd, timeout=600)


@pytest.mark.slow
def test_three_trials_kill_each_target_and_lose_nothing(tmp_path: Path) -> None:
    # Seed 7: a producer killed between its puts and their commit, one rank killed in an
    # offline trial (weights compared with the uninterrupted run), both ranks killed in
    # the middle of a checkpoint save.
    out = tmp_path / "chaos.json"
    workdir = tmp_path / "chaos"
    args = ("--quick", "--trials", "3", "--seed", "7", "--workdir", str(workdir))
    result = _chaos(*args, "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["trials"] == 3
    assert summary["kills"] == {"producer": 1, "rank": 1, "ranks": 1}
    for key in ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures"):
        assert summary[key] == 0, (key, summary)
    assert 0 < summary["recovery_s_p50"] <= summary["recovery_s_p99"]
    assert "verdict: clean" in result.stdout and "recovery p99" in result.stdout

    trials = summary["results"]
    assert [t["mode"] for t in trials] == ["streaming", "offline", "streaming"]
    assert trials[0]["kill"]["victims"] == ["producer-0"]
    assert "before its batch's commit" in trials[0]["plan"]
    assert trials[1]["mismatch"] is False  # torch.equal to the uninterrupted run
    assert trials[2]["kill"]["victims"] == ["rank0-attempt1", "rank1-attempt1"]
    assert "checkpoint save" in trials[2]["plan"]
    for n, trial in enumerate(trials):
        # The ledger says the same, folded again here: each committed sample trained once.
        with Ledger.open(f"sqlite:///{workdir}/trial-{n:03d}/ledger.db") as ledger:
            state = replay(ledger, trial["run_id"])
        assert state.verify() == []
        assert set(state.trained) == set(state.committed) and len(state.committed) == 128
        # A rank's kill ended an epoch and the restart resumed a new one; a producer's did not.
        assert len(state.plans) == (1 if trial["target"] == "producer" else 2)
        # The restarted processes wrote to the ledger after the kill.
        assert trial["recovery_s"] is not None


@pytest.mark.slow
@pytest.mark.mooncake
def test_a_killed_mooncake_master_loses_no_sample(tmp_path: Path, mooncake_installed: None) -> None:
    # One trial, its target the master (--targets; the other targets have a test of their
    # own): the fresh master holds nothing, the ranks report what they miss as lost and
    # regenerate it. Seed 1: the kill at 23% of the training, well before its end (the
    # watch looks every 0.2 s, and a quick run trains for a second or two). Offline: every
    # sample is committed before the ranks start, so about three quarters of the features
    # are in the master when it dies. Streaming, a loaded machine's producers could fall
    # behind the ranks, which had then read every committed sample before the kill, and
    # there was nothing to regenerate (the CI run of 2026-11-27 evening). A master killed
    # under streaming producers: tests/test_mooncake_restart.py.
    out = tmp_path / "chaos.json"
    args = ("--quick", "--trials", "1", "--seed", "1", "--mode", "offline")
    args += ("--store", "mooncake://")
    args += ("--targets", "mooncake_master")
    result = _chaos(*args, "--workdir", str(tmp_path / "w"), "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["kills"] == {"mooncake_master": 1}
    for key in ("lost", "duplicated", "orphans", "verify_failures", "failures"):
        assert summary[key] == 0, (key, summary)
    master = summary["results"][0]
    assert master["kill"]["victims"] == ["mooncake_master"] and "late" not in master["kill"]
    with Ledger.open(f"sqlite:///{tmp_path}/w/trial-000/ledger.db") as ledger:
        state = replay(ledger, master["run_id"])
        regenerated = [
            e for e in ledger.events(master["run_id"]) if e.actor.startswith("trainer-regenerate")
        ]
    assert state.verify() == [] and set(state.trained) == set(state.committed)
    assert regenerated  # what the master took with it was put back and trained once


def _need_server_binaries() -> None:
    try:
        find_bin_dir()
    except RuntimeError as exc:
        unavailable(f"no PostgreSQL server binaries for --start-postgres: {exc}")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_killed_postgres_server_loses_no_sample(tmp_path: Path) -> None:
    # --start-postgres: a durable server of chaos's own holds the ledger, and its postmaster
    # comes first in the rotation: trial 0 SIGKILLs it (offline: the weights must still be
    # torch.equal to the uninterrupted run's), starts it again (crash recovery), and
    # restarts what failed on the outage; trial 1 kills a producer.
    _need_server_binaries()
    out, workdir = tmp_path / "chaos.json", tmp_path / "w"
    args = ("--quick", "--trials", "2", "--seed", "0", "--mode", "offline", "--start-postgres")
    result = _chaos(*args, "--workdir", str(workdir), "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["kills"]["postgres"] >= 1, summary
    for key in ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures"):
        assert summary[key] == 0, (key, summary)
    killed = summary["results"][0]
    assert killed["kill"]["victims"] == ["postgres"] and killed["mismatch"] is False
    assert killed["recovery_s"] is not None and killed["kill"]["down_s"] > 0
    log = (workdir / "postgres.log").read_text()
    assert "automatic recovery in progress" in log  # the restart replayed the WAL


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trials", "0"], "--trials: must be from 1"),
        (["--trials", "x"], "--trials: expected an int"),
        (["--seed", "-1"], "--seed: must be from 0"),
        (["--store", "mem://x"], "pass dir:///PATH or mooncake://"),
        (["--json", "no/such/dir/out.json"], "does not exist"),
        (["--mode", "sometimes"], "invalid choice"),
        (["--start-postgres", "--ledger", "sqlite:///x.db"], "leave out --ledger"),
        (["--targets", "pods"], "--targets 'pods' is no target here; pass some of producer"),
        (["--targets", "mooncake_master"], "with --store mooncake:// only"),
        (["--targets", "rank", "postgres"], "with --start-postgres only"),
        (["--targets", "rank", "rank"], "names a target twice"),
        (["--targets"], "expected at least one argument"),
        (["--workdir", ""], "--workdir must be a directory path, got ''"),
        (["--store", "dir://relative/x"], "a dir:// URI names an absolute path"),
        (["--store", "dir:///"], "not the file system's root"),
        (["--store", "mooncake://127.0.0.1:notaport"], "with a port from 1 to 65535"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    assert_one_line_exit_2(_chaos(*args, cwd=tmp_path), expected)
    assert not (tmp_path / "dataflow-chaos").exists()  # nothing was started


def test_targets_are_taken_in_turn_in_the_order_given(tmp_path: Path) -> None:
    from dataflow.demo._chaos import Chaos, ChaosOptions

    every = ChaosOptions(workdir=str(tmp_path), store="mooncake://", start_postgres=True)
    assert every.available_targets() == ("postgres", "producer", "rank", "ranks", "mooncake_master")
    assert Chaos(every).targets == every.available_targets()
    assert ChaosOptions(workdir=str(tmp_path)).available_targets() == ("producer", "rank", "ranks")
    chosen = ChaosOptions(workdir=str(tmp_path), targets=("ranks", "producer"))
    assert Chaos(chosen).targets == ("ranks", "producer")
    with pytest.raises(ValueError, match="must name at least one target"):
        ChaosOptions(workdir=str(tmp_path), targets=())
    with pytest.raises(ValueError, match="must name at least one target"):
        ChaosOptions(workdir=str(tmp_path), targets="rank")  # type: ignore[arg-type]


def test_weights_that_differ_in_one_bit_are_a_mismatch(tmp_path: Path) -> None:
    weights = {"w": torch.arange(4, dtype=torch.float32)}
    torch.save(weights, tmp_path / "a.pt")
    torch.save({"w": weights["w"].clone()}, tmp_path / "b.pt")
    nudged = weights["w"].clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(10.0))
    torch.save({"w": nudged}, tmp_path / "c.pt")
    assert _same_weights(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert not _same_weights(str(tmp_path / "a.pt"), str(tmp_path / "c.pt"))


def test_any_lost_duplicated_mismatch_or_orphan_fails_the_run() -> None:
    ok = {"mode": "streaming", "target": "rank", "kill": {"victims": ["rank0"]}, "lost": 0}
    assert clean(summarize([ok], 1.0))
    for bad in ({"lost": 2}, {"duplicated": 1}, {"mismatch": True}, {"orphans": 3}):
        summary = summarize([ok, {**ok, **bad}], 1.0)
        assert not clean(summary)
        assert "verdict: FAILED" in format_table(summary)


@pytest.mark.parametrize("how", ["in-save", "moment"])
def test_a_peer_dying_right_after_the_watch_noticed_the_kill_is_no_failure(
    tmp_path: Path, how: str
) -> None:
    # The conductor's race (unit test of its logic; the children are stand-ins): rank 1 is
    # dead and noticed while rank 0 still runs; rank 0 dies (in its own save, or on its
    # next collective) before the same round of the watch looks for failed children.
    plan = KillPlan(
        target="ranks" if how == "in-save" else "rank",
        how=how,
        at=0.0,
        index=1,
        after_puts=0,
        step=2,
    )
    trial = ChaosTrial(
        DemoOptions(workdir=str(tmp_path)), plan=plan, streaming=True, size=(128, 2, 4)
    )
    trial.run_dir.mkdir(parents=True)
    log = tmp_path / "rank.log"
    log.write_text("rank: in the gloo group\n")
    ranks = [
        _Child(f"rank{r}-attempt1", SimpleNamespace(exitcode=None, pid=0), log)  # type: ignore[arg-type]
        for r in range(2)
    ]
    trial.children, trial.ranks, trial.attempt = list(ranks), list(ranks), 1
    trial._head = lambda: 0  # type: ignore[method-assign]
    ranks[1].process.exitcode = -9
    if how == "in-save":
        Path(f"{trial._markers}-rank1").write_text(repr(time.time()))
        assert trial._tick(SimpleNamespace(), time.monotonic()) is False  # noticed; waits
    else:
        ranks[1].killed = True  # the conductor's own kill
        assert trial._after_kill([ranks[1]], time.time(), time.monotonic()) is False
    assert trial.kill is not None and trial.kill["victims"] == ["rank1-attempt1"]
    ranks[0].process.exitcode = -9 if how == "in-save" else 1
    assert [c.failure() for c in trial.children] == [None, None]


@pytest.mark.parametrize("target", ["producer", "rank", "ranks"])
def test_a_kill_the_watch_sees_only_after_its_part_of_the_run_is_counted_as_late(
    tmp_path: Path, target: str
) -> None:
    # Unit test of the conductor's logic (stand-in state, children that are harmless real
    # processes): a quick run may be past its victim's part (all committed, or all
    # trained) before the watch sees the moment; the kill lands, and is reported late
    # (it was counted as a plain kill).
    plan = KillPlan(target=target, how="moment", at=0.5, index=0, after_puts=0, step=2)
    trial = ChaosTrial(
        DemoOptions(workdir=str(tmp_path)), plan=plan, streaming=True, size=(128, 2, 4)
    )
    everything = {f"s{i:03d}": 1 for i in range(128)}
    state = SimpleNamespace(committed=everything, trained=everything)
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        log = tmp_path / "child.log"
        log.write_text("")
        live = [
            _Child(name, sleeper, log)  # type: ignore[arg-type]
            for name, sleeper in zip(
                ["producer-0", "rank0-attempt1", "rank1-attempt1"], sleepers, strict=True
            )
        ]
        for child in live:  # Popen as the process: exitcode and join() as Process has them
            child.process.exitcode = None  # type: ignore[attr-defined]
            child.process.join = child.process.wait  # type: ignore[attr-defined]
        trial.children, trial.ranks, trial.attempt = list(live), live[1:], 1

        def after(victims, wall, now):  # the kill record, without restarting anything
            trial.kill = {"target": target, "victims": [v.name for v in victims]}
            return True

        trial._after_kill = after  # type: ignore[method-assign]
        assert trial._kill_at_moment(state, plan) is True  # type: ignore[arg-type]
        assert trial.kill is not None and trial.kill["late"] == {"committed": 128, "trained": 128}
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    summary = summarize([{"target": target, "mode": "streaming", "kill": trial.kill}], 1.0)
    assert summary["late"] == 1 and summary["kills"][target] == 1 and summary["missed"] == 0
    assert "1 late: after the victim's part of the run" in format_table(summary)


def _postgres_processes(under: Path) -> set[tuple[int, str]]:
    """The postgres processes of the servers whose data directory lies under ``under``
    (the postmaster names it in its command line; its children are its children), each as
    (pid, start time): a pid reused later by another process is not taken for one of them."""
    found: dict[int, tuple[int, str]] = {}  # pid: (parent, start time)
    ours: set[int] = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "comm").read_text().strip() != "postgres":
                continue
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            found[int(proc.name)] = (int(stat[1]), stat[19])  # ppid, starttime
            if str(under) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                ours.add(int(proc.name))
        except OSError:
            continue
    return {(pid, start) for pid, (parent, start) in found.items() if {pid, parent} & ours}


def _alive(processes: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Those of ``processes`` still running (an orphan too, whose parent is gone)."""
    alive = set()
    for pid, start in processes:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[19] == start and stat[0] != "Z":
            alive.add((pid, start))
    return alive


@pytest.fixture
def servers() -> Iterator[Path]:
    """A directory for chaos's PostgreSQL server (its TMPDIR): the server's processes are
    told from those of other tests' servers by it. Short, because the server's Unix socket
    lives there (at most 107 bytes); readable by the postgres user."""
    directory = Path(tempfile.mkdtemp(prefix="dfchaos-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_sigterm_stops_chaos_and_the_server_it_started(tmp_path: Path, servers: Path) -> None:
    # It only failed the trial it came in (chaos went on with the next), and one that came
    # outside a trial left the --start-postgres server running.
    _need_server_binaries()
    workdir = tmp_path / "w"
    args = ["--quick", "--trials", "3", "--mode", "streaming", "--targets", "producer"]
    args += ["--start-postgres", "--workdir", str(workdir)]
    process = Popen(  # forked warm, as every chaos command here
        [sys.executable, "-m", "dataflow.cli", "chaos", *args],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(servers)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (workdir / "trial-000").exists() and process.poll() is None:
            assert time.monotonic() < deadline, "trial 0 never started"
            time.sleep(0.1)
        started = _postgres_processes(servers)  # the server is up before the first trial
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1 and "stopped by SIGTERM" in err, err
    assert not (workdir / "trial-001").exists()  # no trial after it
    assert started, "no server of chaos's own was found running during trial 0"
    deadline = time.monotonic() + 30
    while (_alive(started) or _postgres_processes(servers)) and time.monotonic() < deadline:
        time.sleep(0.2)  # the server's processes exit after its postmaster
    assert not _alive(started) | _postgres_processes(servers), (
        "the server chaos started is still running"
    )
