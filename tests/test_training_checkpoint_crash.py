"""A real SIGKILL at every durable call of a checkpoint save: the old checkpoint or the new one.

A trainer process saves a complete checkpoint at step 1, then saves step
2 with ``os.fsync``, ``os.rename`` and ``os.replace`` wrapped so that the k-th of
those calls (every file, manifest and directory fsync, the publishing rename,
the ledger-ordered pointer and best-record replaces, and with ``keep_latest_k=1``
the retention's rename to trash) SIGKILLs the process instead. One trial per
call, plus one killed just after the last call. After each kill a new trainer
resumes ("latest") on the same SQLite ledger and directory and must get exactly
the step-1 state or exactly the step-2 state, never anything in between: the
ledger verifies, no temporary or trash directory survives, the directories on
disk are exactly the ledger's resumable checkpoints, every one of them loads,
and the run goes on saving.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dataflow import Consumer, Ledger, replay
from stores import LocalFeatureStore
from training import CheckpointConfig, CheckpointManager

RUN = "run"
ACC = "eval/simulated_acc_len"
CHILD_TIMEOUT_S = 120
CONCURRENT_TRIALS = 2
DURABLE_CALLS = ("fsync", "rename", "replace")
# Each trial's trainer is a process of its own, forked from a server that imported torch
# and the libraries once (as the demo's processes are): a spawned one imports them again,
# seconds of CPU a trial, thirty trials a run. The SIGKILL is as real either way.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "dataflow", "stores", "training", __name__])


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


def _rank_state(step: int) -> dict[str, Any]:
    return {"position": torch.arange(8) + step, "step": step}


def _metrics(step: int) -> dict[str, float]:
    return {ACC: float(step)}  # each save beats the one before: the best record moves too


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    else:
        assert a == b


def _manager(args: dict[str, Any]) -> CheckpointManager:
    config = CheckpointConfig(root=args["ckpt"], run_id=RUN, keep_latest_k=args["keep_latest_k"])
    return CheckpointManager(config)


# -- the trainer process -----------------------------------------------------------------------
def _save_in_child(args: dict[str, Any]) -> None:
    """Save step 1 intact, then step 2, SIGKILLed at durable call ``kill_at`` (before it runs)
    or just after call ``kill_after``; with neither, report the calls the save made."""
    led = Ledger.open(args["ledger"])
    consumer = Consumer(
        led, LocalFeatureStore(), run_id=RUN, consumer_id=f"trainer-{args['trial']}"
    )
    manager = _manager(args)
    manager.resume(consumer)
    manager.save(1, _state(1), rank_state=_rank_state(1), metrics=_metrics(1))

    calls: list[str] = []

    def durable(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            calls.append(name)
            if len(calls) == args["kill_at"]:
                _kill_self(args)
            result = real(*a, **kw)
            if len(calls) == args["kill_after"]:
                _kill_self(args)
            return result

        return call

    for name in DURABLE_CALLS:
        setattr(os, name, durable(name, getattr(os, name)))
    manager.save(2, _state(2), rank_state=_rank_state(2), metrics=_metrics(2))
    Path(args["report"]).write_text(json.dumps({"calls": calls}))


def _kill_self(args: dict[str, Any]) -> None:
    """SIGKILL this process, having noted (no durable call) that it reached its kill point."""
    Path(args["killing"]).write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _run_children(trials: list[dict[str, Any]]) -> list[int | None]:
    """Each trial's exit code (None: it hung), ``CONCURRENT_TRIALS`` running at a time.

    All from this thread: ``Process.start()`` polls every running child, which reads its
    exit status from the fork server's pipe; a join of that child in another thread
    racing with it reads the pipe's end instead and reports 255 (seen in CI).
    """
    codes: dict[int, int | None] = {}
    waiting = list(enumerate(trials))
    running: dict[int, tuple[int, multiprocessing.process.BaseProcess, float]] = {}
    while waiting or running:
        while waiting and len(running) < CONCURRENT_TRIALS:
            index, args = waiting.pop(0)
            process = CONTEXT.Process(target=_save_in_child, args=(args,))
            process.start()
            running[process.sentinel] = (index, process, time.monotonic() + CHILD_TIMEOUT_S)
        for sentinel in multiprocessing.connection.wait(list(running), timeout=1.0):
            index, process, _ = running.pop(sentinel)
            process.join()
            codes[index] = process.exitcode
        for sentinel, (index, process, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                process.kill()
                process.join()
                codes[index] = None  # hung
                del running[sentinel]
    return [codes[index] for index in range(len(trials))]


def _trial_args(tmp_path: Path, trial: str, keep_latest_k: int, **kill: int) -> dict[str, Any]:
    where = tmp_path / trial
    where.mkdir()
    return {
        "trial": trial,
        "ledger": f"sqlite:///{where}/ledger.db",
        "ckpt": str(where / "ckpt"),
        "report": str(where / "report.json"),
        "killing": str(where / "killing"),
        "keep_latest_k": keep_latest_k,
        "kill_at": kill.get("kill_at", 0),
        "kill_after": kill.get("kill_after", 0),
    }


# -- what a new trainer finds ------------------------------------------------------------------
def _resume_after_the_kill(args: dict[str, Any]) -> str:
    """Resume a new trainer where the killed one left off; check everything; "old" or "new"."""
    run_dir = Path(args["ckpt"]) / RUN
    with Ledger.open(args["ledger"]) as led:
        recorded = [c.step for c in replay(led, RUN).checkpoints]
        assert recorded in ([1], [1, 2]), recorded
        consumer = Consumer(led, LocalFeatureStore(), run_id=RUN, consumer_id="resumer")
        manager = _manager(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan, state = manager.resume(consumer)
        # Nothing corrupt, nothing to skip or fall back from.
        assert [str(w.message) for w in caught] == []
        assert state is not None and plan.checkpoint is not None
        step = state["step"]
        assert step in (1, 2)
        # Once the ledger recorded the new checkpoint, it is what a resume gets.
        assert step == recorded[-1]
        assert plan.checkpoint_step == plan.checkpoint.step == step
        _assert_equal(state, _state(step))
        _assert_equal(manager.load_rank_state(plan.checkpoint, rank=0), _rank_state(step))

        ledger = replay(led, RUN)
        assert ledger.verify() == []
        assert plan.checkpoint.seq not in ledger.removed_checkpoints
        leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
        assert leftovers == []
        # On disk: exactly the checkpoints the ledger can resume from, each intact.
        resumable = {
            Path(c.path).name: c
            for c in ledger.checkpoints
            if c.seq not in ledger.removed_checkpoints
        }
        saved = manager.saved()
        assert sorted(c.path.name for c in saved) == sorted(resumable)
        for c in saved:
            _assert_equal(manager.load(c), _state(c.step))
            assert c.digest == resumable[c.path.name].digest
        for c in ledger.checkpoints:
            if c.seq in ledger.removed_checkpoints:
                assert not Path(c.path).exists(), f"removed {c.path} is still there"
        # The pointers and the best record name checkpoints that are there.
        for pointer in ("latest", "best"):
            link = Path(args["ckpt"]) / f"{RUN}-{pointer}"
            if link.is_symlink():
                assert link.resolve().parent == run_dir.resolve()
                assert link.resolve().name in resumable, f"{link} dangles"
        best = manager.best()
        assert best is not None and best.path.name in resumable
        _assert_equal(manager.load("best"), _state(best.step))

        # The run goes on: the next save is recorded and resumable.
        manager.save(3, _state(3), rank_state=_rank_state(3), metrics=_metrics(3))
        after = replay(led, RUN)
        assert after.verify() == []
        assert after.checkpoints[-1].step == 3
        assert [c.step for c in after.lineage_checkpoints()][-2:] == [step, 3]
        again = Consumer(led, LocalFeatureStore(), run_id=RUN, consumer_id="resumer-2")
        plan, state = _manager(args).resume(again)
        assert plan.checkpoint_step == 3
        _assert_equal(state, _state(3))
    return "new" if step == 2 else "old"


@pytest.mark.slow
@pytest.mark.parametrize("keep_latest_k", [0, 1], ids=["keep-all", "keep-latest-1"])
def test_sigkill_at_every_durable_call_of_a_save_leaves_the_old_or_the_new_checkpoint(
    tmp_path: Path, keep_latest_k: int
) -> None:
    # 1: an unkilled save, to count its durable calls.
    counting = _trial_args(tmp_path, "count", keep_latest_k)
    assert _run_children([counting]) == [0]
    calls = json.loads(Path(counting["report"]).read_text())["calls"]
    assert set(calls) == set(DURABLE_CALLS)  # file and dir fsyncs, the rename, the replaces
    assert len(calls) > 5
    if keep_latest_k:
        assert calls[-1] == "rename"  # the retention moves step 1 to the trash last
    n = len(calls)

    # 2: one trial killed before each call, one just after the last.
    trials = [
        _trial_args(tmp_path, f"before-{k}", keep_latest_k, kill_at=k) for k in range(1, n + 1)
    ]
    trials.append(_trial_args(tmp_path, f"after-{n}", keep_latest_k, kill_after=n))
    exitcodes = _run_children(trials)
    outcomes = {}
    for args, exitcode in zip(trials, exitcodes, strict=True):
        assert exitcode == -signal.SIGKILL, f"{args['trial']}: exit code {exitcode}"
        assert Path(args["killing"]).exists()  # by its own kill, at its kill point
        assert not Path(args["report"]).exists()  # killed inside the save
        outcomes[args["trial"]] = _resume_after_the_kill(args)

    described = {
        trial: (calls[int(trial.split("-")[1]) - 1], outcome) for trial, outcome in outcomes.items()
    }
    print(f"keep_latest_k={keep_latest_k}: {n} durable calls; outcomes {described}")
    # The kill points span the publish: the early ones keep the old checkpoint, the late
    # ones the new; and once a kill point gives the new one, every later one does.
    order = [outcomes[a["trial"]] for a in trials]
    assert order[0] == "old" and order[-1] == "new"
    assert order == sorted(order, key=lambda o: o == "new"), order
