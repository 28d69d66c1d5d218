"""`dataflow chaos --hosts` as a user runs it: the demo pipeline on a simulated cluster (a
network namespace per host), every fault kind injected, and the checks (nothing lost or
trained twice, the weights of offline trials, orphans after gc). The run needs root
(network namespaces): skipped elsewhere, failed under CI=true."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataflow.cli import main
from dataflow.demo._chaos_hosts import (
    clean_hosts,
    format_hosts_table,
    mooncake_available,
    summarize_hosts,
)
from dataflow.demo._chaos_hosts_plan import (
    AMBIENT,
    BUSY_TIMEOUT_S,
    FAULTS,
    PRODUCER_HOLDS,
    QUICK_HOLD_SHARE,
    STREAM_ONLY,
    HostsChaosOptions,
    assign,
    plan_faults,
    streaming,
)
from dataflow.testing import cluster_unavailable
from tests._cli import assert_one_line_exit_2, run_cli
from tests.conftest import unavailable


def _chaos(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("chaos", *args, cwd=cwd, timeout=900)


def _hosts_available() -> None:
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)


def _run_hosts(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "chaos.json"
    workdir = tmp_path / "chaos"
    result = _chaos("--hosts", "--seed", "0", "--workdir", str(workdir), *args, "--json",
                    str(out), cwd=tmp_path)  # fmt: skip
    assert out.exists(), result.stdout + result.stderr[-3000:]
    return result, json.loads(out.read_text())


# Every kind but clock-skew (its own tests below) and latency: a trial at 100 ms a round
# trip takes minutes; tests/test_hosts_latency.py runs a whole run under it on every link,
# and the full `dataflow chaos --hosts --trials 6` (docs/reliability.md) injects it too.
# In an order that spreads them over three --quick trials (kind j goes to trial j mod 3)
# so that each fault finds its target at work: a streaming trial's producers commit for
# about 7 s, room for one producer's cut, after which the server's restart and the gloo
# cut (each resumes the ranks from a checkpoint); the offline trial takes the lost reply
# (armed from the start) and the stalls; the other streaming one the Mooncake cut and a
# rank's cut from PostgreSQL (with --seed 0 drawn shorter than its timeouts: the longer
# one is tests/test_hosts_ledger_ranks.py's, and the full run's). The offline trial's
# stalls come once the lost reply's producer is back, while its commits and training
# still run (each recovered 0.1-1.4 s after the heal in seven runs, one at load 11).
NETWORK_KINDS = (
    "partition",
    "pg-cut-producer",
    "mooncake-cut",
    "pg-restart",
    "stall-reset",
    "pg-cut-rank",
    "gloo-cut",
)
# On the shared directory a quick trial trains in seconds, too short for faults in a row:
# the default size (768 samples), two kinds a trial.
WITHOUT_MOONCAKE = ("partition", "pg-cut-producer", "gloo-cut", "pg-cut-rank", "stall-reset",
                    "pg-restart")  # fmt: skip


@pytest.mark.slow
def test_every_network_fault_kind_across_hosts_loses_nothing(tmp_path: Path) -> None:
    _hosts_available()
    # Three trials, two or three kinds each, one of them offline (its weights compared
    # with an uninterrupted run on a cluster of its own); Mooncake where installed.
    assert set(NETWORK_KINDS) == set(FAULTS) - {"clock-skew", "latency"}
    assert set(WITHOUT_MOONCAKE) == set(NETWORK_KINDS) - {"mooncake-cut"}
    kinds, size = (NETWORK_KINDS, ["--quick"]) if mooncake_available() else (WITHOUT_MOONCAKE, [])
    result, summary = _run_hosts(tmp_path, "--trials", "3", "--faults", ",".join(kinds), *size)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert set(summary["faults"]) == set(kinds)
    for key in ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures"):
        assert summary[key] == 0, (key, summary)
    assert summary["unexercised"] == [] and summary["payloads_lost"] == 0
    for kind, figures in summary["faults"].items():
        assert figures["trials"] >= 1, kind
        for key in ("lost", "duplicated", "mismatches", "orphans"):
            assert figures[key] == 0, (kind, key)
        if kind not in AMBIENT:  # a fault that ended: the run went on after it
            assert figures["recovery_p50_s"] is not None, kind
            assert figures["recovery_p50_s"] <= figures["recovery_p99_s"]
    trials = summary["results"]
    assert [t["mode"] for t in trials] == ["streaming", "offline", "streaming"]
    assert trials[1]["mismatch"] is False  # torch.equal to the uninterrupted run
    records = [f for t in trials for f in t["faults"]]
    lost_reply = next(f for f in records if f["kind"] == "pg-cut-producer")
    assert lost_reply["caught"]["reply_bytes_held"] > 0  # committed, the reply held
    gloo = next(f for f in records if f["kind"] == "gloo-cut")
    assert len(gloo["rank_errors"]) == 2  # both ranks stopped, each with its error
    assert "verdict: clean" in result.stdout


@pytest.mark.slow
def test_a_producer_host_hours_ahead_loses_nothing_on_the_shared_dir(tmp_path: Path) -> None:
    _hosts_available()
    # --quick (384 samples): a fault of the whole run, there is no moment to miss.
    result, summary = _run_hosts(
        tmp_path, "--trials", "1", "--faults", "clock-skew", "--store", "dir://", "--quick"
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert summary["faults"]["clock-skew"]["trials"] == 1
    for key in ("lost", "duplicated", "orphans", "failures"):
        assert summary[key] == 0, (key, summary)


@pytest.mark.slow
@pytest.mark.mooncake
def test_a_producer_host_hours_ahead_leaves_no_orphans_on_mooncake(
    tmp_path: Path, mooncake_installed: None
) -> None:
    _hosts_available()
    _, summary = _run_hosts(
        tmp_path, "--trials", "1", "--faults", "clock-skew", "--store", "mooncake://", "--quick"
    )
    assert summary["lost"] == summary["duplicated"] == summary["failures"] == 0
    assert summary["orphans"] == 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--hosts", "--faults", "partition,bogus"], "'bogus' is no fault kind; pass some of"),
        (["--hosts", "--faults", "latency,latency"], "names a kind twice: latency,latency"),
        (["--faults", "latency"], "injected with --hosts only: add --hosts"),
        (["--hosts", "--ledger", "sqlite:///x.db"], "--ledger does not go with --hosts"),
        (["--hosts", "--start-postgres"], "--start-postgres does not go with --hosts"),
        (["--hosts", "--mode", "offline"], "--mode does not go with --hosts"),
        (["--hosts", "--store", "dir:///tmp/x"], "with --hosts, pass mooncake://"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    assert_one_line_exit_2(_chaos(*args, cwd=tmp_path), expected)
    assert not (tmp_path / "dataflow-chaos").exists()  # nothing was started


def test_without_namespaces_hosts_exits_2_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataflow.testing._netns as netns

    monkeypatch.setattr(netns, "cluster_unavailable", lambda: "no CAP_NET_ADMIN (not root)")
    workdir = tmp_path / "chaos"
    assert main(["chaos", "--hosts", "--workdir", str(workdir), "--store", "dir://"]) == 2
    err = capsys.readouterr().err
    assert "--hosts needs network namespaces: no CAP_NET_ADMIN (not root)" in err
    assert not workdir.exists()


def test_the_help_lists_every_fault_kind() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dataflow.cli", "chaos", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "2000"},  # no line breaks inside a kind's name
    )
    assert result.returncode == 0
    for kind, what in FAULTS.items():
        assert f"{kind}: {what}" in result.stdout, kind


@pytest.mark.parametrize("trials", [1, 2, 3, 5, 6, 9, 10, 20])
def test_the_trials_cover_every_kind_and_a_partition_always_streams(trials: int) -> None:
    kinds = tuple(FAULTS)
    plan = assign(trials, kinds)
    assert len(plan) == trials
    assert {k for slot in plan for k in slot} == set(kinds)
    for i, slot in enumerate(plan):
        assert streaming(i, slot) == (i % 2 == 0 or any(k in STREAM_ONLY for k in slot))
        assert len(set(slot)) == len(slot)
    if trials >= len(kinds):  # one kind per trial, in turn
        assert all(len(slot) == 1 for slot in plan)


def test_six_trials_spread_the_nine_kinds_as_documented() -> None:
    assert assign(6, tuple(FAULTS)) == [
        ("partition", "latency"),
        ("pg-cut-producer", "clock-skew"),
        ("gloo-cut", "mooncake-cut"),
        ("pg-cut-rank",),
        ("stall-reset",),
        ("pg-restart",),
    ]


def test_a_trial_injects_the_producers_faults_before_the_ranks() -> None:
    plans = plan_faults(3, ("gloo-cut", "latency", "mooncake-cut", "pg-restart"))
    assert [p.kind for p in plans] == ["mooncake-cut", "pg-restart", "gloo-cut"]
    assert plan_faults(3, ("gloo-cut", "mooncake-cut")) == plan_faults(
        3, ("gloo-cut", "mooncake-cut")
    )
    rank_cuts = [plan_faults(seed, ("pg-cut-rank",))[0] for seed in range(40)]
    assert {p.long for p in rank_cuts} == {True, False}  # shorter and longer than timeouts


def _trial(kinds: list[str], **figures: object) -> dict:
    faults = [{"kind": k, "recovery_s": 1.0} for k in kinds if k not in AMBIENT]
    return {"kinds": kinds, "faults": faults, "mode": "streaming", **figures}


def test_any_loss_or_a_kind_never_injected_fails_the_run() -> None:
    kinds = ("partition", "latency")
    good = summarize_hosts([_trial(["partition", "latency"])], kinds, 1.0)
    assert clean_hosts(good)
    assert good["faults"]["partition"]["recovery_p50_s"] == 1.0
    assert good["faults"]["latency"]["recovery_p50_s"] is None
    assert "verdict: clean" in format_hosts_table(good)
    for key in ("lost", "duplicated", "orphans"):
        bad = summarize_hosts([_trial(["partition", "latency"], **{key: 1})], kinds, 1.0)
        assert not clean_hosts(bad) and bad["faults"]["partition"][key] == 1
    missed = _trial(["partition", "latency"])
    missed["faults"] = [{"kind": "partition", "missed": True}]
    summary = summarize_hosts([missed], kinds, 1.0)
    assert summary["unexercised"] == ["partition"] and not clean_hosts(summary)
    assert "never injected: partition" in format_hosts_table(summary)


def test_a_skewed_host_reads_its_wall_clock_that_far_off_and_its_monotonic_clock_not() -> None:
    code = (
        "import time; from dataflow.demo._hosts import skew_clock; "
        "w, m = time.time(), time.monotonic(); skew_clock(3 * 3600.0); "
        "print(round(time.time() - w), round(time.time_ns() / 1e9 - w), "
        "round(time.monotonic() - m))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["10800", "10800", "0"]


def test_the_conductor_imports_no_torch_and_names_producers_as_the_demo_does() -> None:
    code = (
        "import sys; import dataflow.demo._chaos_hosts, dataflow.demo._chaos_hosts_trial; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["False"], result.stderr  # its children import torch
    from dataflow.demo._chaos_hosts_trial import producer_id
    from dataflow.demo._model import producer_id as demo_producer_id

    assert [producer_id(i) for i in range(3)] == [demo_producer_id(i) for i in range(3)]


def test_quick_is_the_suites_size_and_the_default_run_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = HostsChaosOptions()
    assert (default.size, default.gloo_timeout_s) == ((768, 8, 8), 20.0)
    quick = HostsChaosOptions(quick=True)
    assert (quick.size, quick.gloo_timeout_s) == ((384, 4, 8), 10.0)
    import dataflow.demo._chaos_hosts as chaos_hosts

    seen = []
    totals = dict.fromkeys(
        ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures"), 0
    )
    monkeypatch.setattr(
        chaos_hosts,
        "run_hosts_chaos",
        lambda options: seen.append(options) or {**totals, "unexercised": []},
    )
    workdir = str(tmp_path / "chaos")
    assert main(["chaos", "--hosts", "--quick", "--workdir", workdir]) == 0
    assert main(["chaos", "--hosts", "--workdir", workdir]) == 0
    assert [options.quick for options in seen] == [True, False]


def test_quick_trials_cut_the_producers_shorter_and_keep_every_other_draw() -> None:
    kinds = ("partition", "pg-cut-producer", "mooncake-cut", "pg-cut-rank", "pg-restart")
    for seed in range(20):
        full, quick = plan_faults(seed, kinds), plan_faults(seed, kinds, quick=True)
        for f, q in zip(full, quick, strict=True):
            assert (f.kind, f.at, f.index, f.peer, f.long) == (
                q.kind,
                q.at,
                q.index,
                q.peer,
                q.long,
            )
            if f.kind in PRODUCER_HOLDS:
                low, high = PRODUCER_HOLDS[f.kind]
                assert low <= q.hold_s <= low + (high - low) * QUICK_HOLD_SHARE + 0.01
                assert q.hold_s <= f.hold_s
            else:
                assert q.hold_s == f.hold_s
    lost_reply = plan_faults(0, ("pg-cut-producer",), quick=True)[0]
    assert lost_reply.hold_s >= BUSY_TIMEOUT_S  # still outlasts the ledger's dead-peer bound


def test_a_fault_waits_for_no_recovery_once_what_it_hit_has_finished(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from dataflow.demo._chaos_hosts_trial import RECOVERY_WAIT_S, HostsTrial
    from dataflow.demo._options import DemoOptions
    from dataflow.model import RunState

    trial = HostsTrial(
        DemoOptions(workdir=str(tmp_path), quick=True),
        cluster=None, postgres=None, master=None, faults=[], ambient=(),
        streaming=True, size=(384, 4, 8), seed=0,
    )  # fmt: skip
    state, healed = RunState("run"), 100.0
    assert not trial._settled({"actors": "producer-0"}, state, healed)  # not healed yet
    producer = {"actors": "producer-0", "healed_mono": healed}
    assert not trial._settled(producer, state, healed + 1)  # its recovery may come
    assert trial._settled(producer, state, healed + RECOVERY_WAIT_S + 1)  # waited enough
    state.closed.add("producer-0")  # the producer finished: nothing left to recover
    assert trial._settled(producer, state, healed + 1) and producer["target_finished"]
    ranks = {"actors": "ranks", "healed_mono": healed}
    done, running = (SimpleNamespace(process=SimpleNamespace(exitcode=c)) for c in (0, None))
    trial.ranks = [done, running]
    assert not trial._settled(ranks, state, healed + 1)
    trial.ranks = [done, done]
    assert trial._settled(ranks, state, healed + 1)
    anyone = {"actors": None, "healed_mono": healed}  # a server-wide fault: anyone recovers
    assert not trial._settled(anyone, state, healed + 1)
    assert trial._settled({**anyone, "recovery_s": 0.2}, state, healed + 1)
