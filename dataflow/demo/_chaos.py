"""``dataflow chaos``: the demo pipeline, SIGKILLed at random, restarted, and checked.

Each trial is one run of the demo (two producer processes, two gloo trainer ranks, a
shared-directory store and a SQLite ledger of its own) at a small size. Trial ``i`` draws
its kill from seed ``S + i``: the target (a producer, one trainer rank, both ranks and,
with ``--store mooncake://``, the ``mooncake_master`` each trial starts, in turn) and the
moment (a random point of the run's progress, or a chosen one: a producer between the
puts of a commit batch and its commit, both ranks in the middle of writing a checkpoint).
The conductor restarts what died as an operator would: a producer is started again and
emits everything once more (the ledger answers what it holds, so only the rest is stored
and committed); when one rank dies its peer fails on its next gloo
collective (or is killed after ``SURVIVOR_WAIT_S``), and both are restarted, resuming
through the ledger; a killed master is started afresh on its ports, holding nothing, and
whatever failed on its outage is restarted. With ``--start-postgres`` the ledger is a
PostgreSQL server chaos starts (durable: fsync, synchronous_commit and full_page_writes
on), and its postmaster is a target too: SIGKILLed, then started again on its port and
data directory (crash recovery replays the WAL), and whatever failed on its outage is
restarted the same way.

Every other trial is *offline*: the producers commit a dataset, which the ranks train in
the seeded order (no stream), and the final weights must be ``torch.equal`` to those of
an uninterrupted run of the same data (run once per ``--seed``: the data and models come
from ``S``, the trials' seeds only draw the kills). The others stream refs over ZeroMQ in
arrival order. After each run: ``replay(...).verify()`` must be clean, every committed
sample trained exactly once in the final lineage (counted from the events), and after
``collect_garbage(grace=0)`` the store must hold nothing the fold does not keep alive.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dataflow.demo import DemoError, DemoOptions, check_store_uri
from dataflow.demo._report import lineage_report
from dataflow.demo._run import (
    BATCH_SIZE,
    GRAD_ACCUM,
    PRODUCERS,
    RANKS,
    Demo,
    Terminated,
    _Child,
    _write_json,
    sigterm_raises,
)
from dataflow.live._replay import replay
from dataflow.model._events import Kind
from dataflow.model._fold import RunState

#: Kill targets, taken in turn (so any three consecutive trials hit each).
TARGETS = ("producer", "rank", "ranks")
#: With a ``mooncake://`` store, the master chaos starts for each trial is a target too.
MASTER = "mooncake_master"
#: With ``--start-postgres``, the PostgreSQL server chaos starts is a target too.
POSTGRES = "postgres"
#: The server's settings that make a commit durable: all must be on.
DURABLE = ("fsync", "synchronous_commit", "full_page_writes")
#: How long the killed postmaster's processes get to exit before the restart.
POSTGRES_DOWN_S = 30.0
MODES = ("alternate", "streaming", "offline")
#: (samples, checkpoint_every, eval_every): optimizer steps of 16 samples.
SIZE = (256, 4, 4)
QUICK_SIZE = (128, 2, 2)
#: How long the peer of a killed rank gets to fail on its own before the operator kills it.
SURVIVOR_WAIT_S = 20.0
CHUNK = 8  # the demo producer's samples per commit batch


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosOptions:
    """What ``dataflow chaos`` runs; checked when created (ValueError naming the option)."""

    trials: int = 20
    seed: int = 0
    """Trial ``i`` draws its kill from ``seed + i``; the data and models come from ``seed``."""
    ledger: str | None = None
    """Ledger URL shared by every trial; None: a SQLite file per trial."""
    store: str | None = None
    """``dir:///PATH``: each trial's features under ``PATH/trial-NNN``; None: under workdir."""
    workdir: str = "dataflow-chaos"
    quick: bool = False
    """Smaller runs (128 samples instead of 256)."""
    mode: str = "alternate"
    """``alternate`` (odd trials offline), ``streaming`` or ``offline`` for every trial."""
    json_path: str | None = None
    start_postgres: bool = False
    """Start a durable PostgreSQL server for the ledger, and kill it as a target too."""
    targets: tuple[str, ...] | None = None
    """Only these kill targets, taken in turn in this order; None: every target the
    other options allow (see :meth:`available_targets`)."""

    def available_targets(self) -> tuple[str, ...]:
        """The kill targets these options allow, in their default order."""
        targets = (*TARGETS, MASTER) if (self.store or "").startswith("mooncake://") else TARGETS
        # The server first: two trials already kill it once.
        return (POSTGRES, *targets) if self.start_postgres else targets

    def __post_init__(self) -> None:
        if self.start_postgres and self.ledger is not None:
            raise ValueError(
                "--start-postgres starts the ledger's server itself; leave out --ledger"
            )
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"--trials must be an int >= 1, got {self.trials!r}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.store is not None:
            check_store_uri(self.store)
        if (self.store or "").startswith("dir://") and urlsplit(self.store).path.rstrip("/") == "":
            raise ValueError(
                f"--store {self.store!r}: each trial's features go under PATH/trial-NNN; "
                "pass a directory of its own, dir:///PATH, not the file system's root"
            )
        if self.store is not None and not self.store.startswith(("dir://", "mooncake://")):
            raise ValueError(
                f"--store {self.store!r}: chaos runs each trial in a store of its own, a "
                "shared directory or a mooncake_master it starts; pass dir:///PATH or "
                "mooncake:// (or leave it out)"
            )
        if (self.store or "").startswith("mooncake://") and urlsplit(self.store).hostname not in (
            None,
            "127.0.0.1",
            "localhost",
        ):
            raise ValueError(
                f"--store {self.store}: chaos starts (and kills) a mooncake_master of its own on "
                "127.0.0.1; pass mooncake:// (or mooncake://127.0.0.1:PORT)"
            )
        if not isinstance(self.workdir, str | os.PathLike) or not os.fspath(self.workdir):
            raise ValueError(f"--workdir must be a directory path, got {self.workdir!r}")
        if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
            raise ValueError(f"--workdir {self.workdir} is a file; pass a directory")
        if self.targets is not None:
            self._check_targets(self.targets)

    def _check_targets(self, targets: object) -> None:
        if isinstance(targets, str) or not isinstance(targets, tuple) or not targets:
            raise ValueError(f"--targets must name at least one target, got {targets!r}")
        allowed = self.available_targets()
        for target in targets:
            if target in allowed:
                continue
            why = {
                MASTER: " (a master is a target with --store mooncake:// only)",
                POSTGRES: " (the server is a target with --start-postgres only)",
            }.get(target, "")
            raise ValueError(
                f"--targets {target!r} is no target here{why}; pass some of {', '.join(allowed)}"
            )
        if len(set(targets)) != len(targets):
            raise ValueError(f"--targets names a target twice: {' '.join(targets)}")


@dataclasses.dataclass(frozen=True)
class KillPlan:
    """Where and when a trial's SIGKILL lands."""

    target: str  # one of TARGETS
    how: str  # "moment" (the conductor kills), "in-commit" or "in-save" (the process itself)
    at: float  # "moment": the share of the samples committed (producer) or trained (ranks)
    index: int  # the producer, or the rank, killed
    after_puts: int  # "in-commit": the put after which the producer dies
    step: int  # "in-save": the checkpoint step whose save the ranks die in

    def describe(self) -> str:
        who = {
            "producer": f"producer-{self.index}",
            "rank": f"rank {self.index}",
            MASTER: "the mooncake_master",
            POSTGRES: "the PostgreSQL postmaster",
        }.get(self.target, "both ranks")
        if self.how == "in-commit":
            return f"{who} after put {self.after_puts}, before its batch's commit"
        if self.how == "in-save":
            return f"{who} in the checkpoint save at step {self.step}"
        return f"{who} at {self.at:.0%} of the run"


def plan_kill(
    trial_seed: int, trial: int, samples: int, checkpoint_every: int, targets: tuple = TARGETS
) -> KillPlan:
    rng = random.Random(trial_seed)
    target = targets[trial % len(targets)]
    steps = samples // (RANKS * BATCH_SIZE * GRAD_ACCUM)
    how = "moment"
    if target == "producer" and rng.random() < 0.5:
        how = "in-commit"
    elif target == "ranks" and rng.random() < 0.5:
        how = "in-save"
    share = samples // PRODUCERS
    saves = list(range(checkpoint_every, steps, checkpoint_every))[:-1] or [checkpoint_every]
    return KillPlan(
        target=target,
        how=how,
        # postgres: a share of the whole run's progress (commits and training together).
        at=rng.uniform(0.1, 0.6) if target in ("producer", POSTGRES) else rng.uniform(0.15, 0.75),
        index=rng.randrange(PRODUCERS if target == "producer" else RANKS),
        after_puts=rng.randrange(CHUNK + 1, share - 1),
        step=rng.choice(saves),
    )


class ChaosTrial(Demo):
    """One run of the demo pipeline with one planned SIGKILL (none for a reference run)."""

    def __init__(
        self,
        options: DemoOptions,
        *,
        plan: KillPlan | None,
        streaming: bool,
        size: tuple,
        postgres: Any = None,
    ) -> None:
        super().__init__(options)
        self.postgres = postgres  # the PostgresServer of the ledger, when chaos started it
        self.samples, self.checkpoint_every, self.eval_every = size
        self.plan, self.streaming = plan, streaming
        self.kill: dict[str, Any] | None = None  # what was killed, when, and what restarted
        self._survivors: list[_Child] = []
        self._survivors_due = 0.0
        self._markers = Path(self.run_dir) / "killed"

    # Quiet: the chaos conductor prints one table; each trial's story goes to its log.
    def _say(self, text: str) -> None:
        with (self.run_dir / "chaos.log").open("a") as file:
            file.write(text + "\n")

    def _progress(self, state: RunState, *, final: bool = False) -> None:
        pass

    def _announce(self) -> None:
        what = "no kill (the reference)" if self.plan is None else f"SIGKILL {self.plan.describe()}"
        mode = "streaming over ZeroMQ" if self.streaming else "offline, in the seeded order"
        self._say(f"run {self.run_id}: {self.samples} samples, {mode}; {what}")

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        config["stream"] = self.streaming
        plan = self.plan
        if plan is not None and plan.how == "in-commit":
            config["kill_in_commit"] = {
                "producer": plan.index,
                "after_puts": plan.after_puts,
                "marker": str(self._markers) + f"-producer-{plan.index}",
            }
        if plan is not None and plan.how == "in-save":
            config["kill_in_save"] = {"step": plan.step, "marker": str(self._markers) + "-rank"}
        return config

    # -- the kill and the restart ------------------------------------------------------
    def _tick(self, state: RunState, now: float) -> bool:
        plan = self.plan
        if plan is None:
            return False
        if self._survivors:
            return self._restart_ranks_when_down(now)
        if self.kill is not None:
            return plan.target in (MASTER, POSTGRES) and self._restart_casualties(now)
        if plan.how == "moment":
            return self._kill_at_moment(state, plan)
        return self._notice_self_kill(plan, now)

    def _kill_at_moment(self, state: RunState, plan: KillPlan) -> bool:
        # The watch looks every TICK_S: a quick run may be past its victim's part (all
        # committed, or all trained) before it sees the moment. The kill still lands (on
        # the final checkpoint, eval or release) and is counted as late.
        over = state.committed if plan.target == "producer" else state.trained
        late = len(over) >= self.samples
        killed = self._kill_now(state, plan)
        if killed and late and self.kill is not None:
            self.kill["late"] = {"committed": len(state.committed), "trained": len(state.trained)}
        return killed

    def _kill_now(self, state: RunState, plan: KillPlan) -> bool:
        if plan.target == MASTER:
            return self._kill_master(state, plan)
        if plan.target == POSTGRES:
            return self._kill_postgres(state, plan)
        if plan.target == "producer":
            if len(state.committed) < plan.at * self.samples:
                return False
            victims = [c for c in self._alive() if c.name.startswith(f"producer-{plan.index}")]
        else:
            if len(state.trained) < plan.at * self.samples:
                return False
            victims = [r for r in self.ranks if r.process.exitcode is None]
            if plan.target == "rank":
                victims = [r for r in victims if r is self.ranks[plan.index]]
        if not victims or (plan.target == "ranks" and len(victims) < RANKS):
            self.kill = {"missed": True}  # it finished first: nothing to kill
            return False
        wall = time.time()
        for child in victims:
            os.kill(child.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.killed = True
        for child in victims:
            child.process.join()
        return self._after_kill(victims, wall, time.monotonic())

    def _notice_self_kill(self, plan: KillPlan, now: float) -> bool:
        """A child that SIGKILLed itself at its planned point left a marker saying when."""
        dead = [c for c in self.children if c.process.exitcode == -signal.SIGKILL and not c.killed]
        stamps = sorted(self._markers.parent.glob(self._markers.name + "-*"))
        if not dead or not stamps:
            return False
        for child in dead:
            child.killed = True
        wall = min(float(p.read_text()) for p in stamps)
        return self._after_kill(dead, wall, now)

    def _after_kill(self, victims: list[_Child], wall: float, now: float) -> bool:
        self.kill = {
            "target": self.plan.target if self.plan else None,
            "victims": [c.name for c in victims],
            "wall": wall,
            "after_seq": self._head(),  # the dead write no more: what follows is the restart's
        }
        self._say(f"SIGKILL {', '.join(self.kill['victims'])} ({self.plan.describe()})")
        if any(c in self.ranks for c in victims):
            # A rank's peer fails on its next gloo collective; the operator restarts both.
            self._await_survivors(now)
            return self._restart_ranks_when_down(now)
        for child in victims:
            index = int(child.name.split("-")[1])
            self._start(f"producer-{index}-restarted", "producer", index)
            self.kill["restarted"] = [f"producer-{index}"]
        return True

    def _await_survivors(self, now: float) -> None:
        """After a rank's death: its peers fail on their next collective (or are killed
        after SURVIVOR_WAIT_S), then both ranks restart."""
        self._survivors = [r for r in self.ranks if not r.killed]
        self._survivors_due = now + SURVIVOR_WAIT_S
        for rank in self._survivors:
            # Its death is expected from now on, also between two rounds of the watch
            # (which would otherwise call it a failure): on its collective, or in its save.
            rank.doomed = True

    def _restart_ranks_when_down(self, now: float) -> bool:
        alive = [r for r in self._survivors if r.process.exitcode is None]
        if alive and now < self._survivors_due:
            return False
        assert self.kill is not None
        self.kill["survivors_failed_alone"] = not alive
        if self.plan is not None and self.plan.how == "in-save":  # those that died in the save
            self.kill["victims"] = [
                r.name for r in self.ranks if Path(f"{self._markers}-rank{r.name[4]}").exists()
            ]
        for rank in alive:
            os.kill(rank.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        for rank in self._survivors:
            rank.killed = True  # failed on (or was killed at) its collective: expected
            rank.process.join()
        self._survivors = []
        self._start_ranks()
        if self.kill.get("target") not in (MASTER, POSTGRES):
            self.kill["restarted"] = [f"rank{r}-attempt{self.attempt}" for r in range(RANKS)]
        self._say(f"restarted both ranks (attempt {self.attempt})")
        return True

    def _kill_master(self, state: RunState, plan: KillPlan) -> bool:
        """SIGKILL the store's master and start a fresh one on its ports, as an operator
        would; every feature it held is gone, and the ranks report what they miss as lost."""
        if len(state.trained) < plan.at * self.samples:
            return False
        if not any(r.process.exitcode is None for r in self.ranks):
            self.kill = {"missed": True}
            return False
        wall = time.time()
        self._master.kill()
        self.kill = {"target": MASTER, "victims": [MASTER], "wall": wall}
        self.kill["after_seq"] = self._head()
        self._master.start()
        self.kill["restarted"] = None  # no ledger actor of its own (see _recovery)
        self._say(f"SIGKILL {MASTER}, started a fresh one on its ports")
        return True

    def _kill_postgres(self, state: RunState, plan: KillPlan) -> bool:
        """SIGKILL the ledger server's postmaster and start it again on its port and data
        directory, as an operator would (crash recovery replays the WAL); what failed on
        the outage is restarted by ``_restart_casualties``."""
        progress = len(state.committed) + len(state.trained)
        if progress < plan.at * 2 * self.samples:
            return False
        if not self._alive():
            self.kill = {"missed": True}
            return False
        server = self.postgres
        data = server.directory / "data"
        after_seq = self._head()
        pid = int((data / "postmaster.pid").read_text().split()[0])
        processes = [pid, *_children_of(pid)]
        wall = time.time()
        os.kill(pid, signal.SIGKILL)
        self.kill = {"target": POSTGRES, "victims": [POSTGRES], "wall": wall}
        self.kill["after_seq"] = after_seq
        self.kill["restarted"] = None  # no ledger actor of its own (see _recovery)
        # Its backends and workers notice the postmaster's death and exit; a process that
        # no one reaps stays a zombie (in a container without an init), holding nothing.
        deadline = time.monotonic() + POSTGRES_DOWN_S
        while any(_running(p) for p in processes):
            if time.monotonic() > deadline:
                raise DemoError(f"the killed postmaster's processes {processes} did not exit")
            time.sleep(0.05)
        # The postmaster is dead (maybe an unreaped zombie, which the server's own check
        # of its lock files takes for a running server): remove the stale lock files.
        (data / "postmaster.pid").unlink(missing_ok=True)
        (server.directory / f".s.PGSQL.{server.port}.lock").unlink(missing_ok=True)
        from dataflow.testing._postgres import _run_tool

        log = server.directory / "server.log"
        try:
            _run_tool(server.bin_dir, "pg_ctl", "start", "-D", str(data), "-l", str(log),
                      "-o", server.server_options(server.port),
                      "-w", "-t", str(round(server.startup_timeout)))  # fmt: skip
            server._wait_ready()
        except RuntimeError as exc:
            raise DemoError(f"the killed PostgreSQL server did not start again: {exc}") from exc
        self.kill["down_s"] = round(time.time() - wall, 3)
        self._say(f"SIGKILL postmaster {pid}, started it again in {self.kill['down_s']} s")
        self._restart_casualties(time.monotonic())
        return True

    def _restart_casualties(self, now: float) -> bool:
        """After the master's (or the ledger server's) kill, restart a producer or the
        ranks that failed on it."""
        failed = [
            c
            for c in self.children
            if c.process.exitcode not in (None, 0) and not c.killed and not c.service
        ]
        assert self.kill is not None
        for child in failed:
            child.killed = True
            self.kill.setdefault("casualties", []).append(child.name)
            if child not in self.ranks:
                index = int(child.name.split("-")[1])
                self._start(f"producer-{index}-restarted-{len(self.children)}", "producer", index)
        if any(child in self.ranks for child in failed):
            # Its peer fails on its next collective (or is killed after SURVIVOR_WAIT_S);
            # when both failed at once, both are restarted now.
            self._await_survivors(now)
            if not self._survivors:
                self._restart_ranks_when_down(now)
        return bool(failed)

    def _alive(self) -> list[_Child]:
        return [c for c in self.children if c.process.exitcode is None and not c.killed]

    def _head(self) -> int:
        state = RunState(self.run_id, ref_source=self.ledger)
        state.apply_rows(self.ledger.rows(self.run_id))
        return state.head_seq

    # -- the checks --------------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        state = replay(self.ledger, self.run_id)
        lineage = lineage_report(self.ledger.events(self.run_id))
        committed = set(state.committed)
        trained = Counter(lineage.acks)
        result: dict[str, Any] = {
            "run_id": self.run_id,
            "committed": len(committed),
            "lost": len(committed - set(trained)),
            # Trained twice in the final lineage, or trained without being committed.
            "duplicated": sum(1 for n in trained.values() if n > 1) + len(set(trained) - committed),
            "verify": state.verify(),
            "weights": str(self.run_dir / "weights.pt"),
            "kill": self.kill,
            "recovery_s": self._recovery(),
        }
        result.update(self._collect())
        return result

    def _recovery(self) -> float | None:
        """From the kill to the first ledger event of what was restarted."""
        kill = self.kill
        if not kill or "restarted" not in kill:
            return None
        # The master writes to no ledger: its recovery is the first commit after the kill
        # (features the fresh master took: a producer's, or a lost sample's regeneration).
        # The ledger server's recovery: the first event after the kill (the server was down
        # until it was started again, so whoever wrote it wrote to the restarted server).
        actors = kill["restarted"]
        for event in self.ledger.events(self.run_id, after_seq=kill["after_seq"]):
            if kill["target"] == POSTGRES:
                back = event.ts >= kill["wall"]
            else:
                back = event.kind == Kind.COMMIT if actors is None else event.actor in actors
            if back:
                return max(event.ts - kill["wall"], 0.0)
        return None

    def _collect(self) -> dict[str, int]:
        """``dataflow gc --grace 0``, then count what the store still holds that the fold
        keeps no reason for (the newest committed revision, neither released nor lost)."""
        from dataflow.tools._gc import collect_garbage
        from stores import open_store

        store = open_store(self.store_uri)
        try:
            report = collect_garbage(self.ledger, store, grace=0)
            state = replay(self.ledger, self.run_id)
            stored = [s for s in state.committed if s not in state.released and s not in state.lost]
            live = {(sid, ref.generation) for sid, ref in state.refs(stored).items()}
            orphans = sum(1 for obj in store.scan() if (obj.sample_id, obj.generation) not in live)
        finally:
            store.close()
        return {"gc_removed": report.removed, "orphans": orphans}


def _children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _same_weights(path: str, reference: str) -> bool:
    import torch

    ours = torch.load(path, weights_only=True)
    theirs = torch.load(reference, weights_only=True)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


class Chaos:
    """``dataflow chaos``: ``run()`` returns the summary it prints (and writes as JSON)."""

    def __init__(self, options: ChaosOptions) -> None:
        self.options = options
        self.size = QUICK_SIZE if options.quick else SIZE
        self.workdir = Path(options.workdir).absolute()
        self._reference: str | None = None
        self.mooncake = (options.store or "").startswith("mooncake://")
        self.targets = options.targets or options.available_targets()
        self.ledger_url = options.ledger
        self.postgres: Any = None  # the PostgresServer chaos started (--start-postgres)

    def _demo_options(self, name: str) -> DemoOptions:
        store = self.options.store
        if self.mooncake:
            assert store is not None
            # A master of its own per trial (the demo starts it; chaos kills it).
            own = {"store": store, "start_mooncake_master": True}
        else:
            own = {"store": None if store is None else f"{store.rstrip('/')}/{name}"}
        return DemoOptions(
            workdir=str(self.workdir / name),
            quick=True,
            seed=self.options.seed,
            samples=self.size[0],
            ledger=self.ledger_url,
            **own,
        )

    def _offline(self, trial: int) -> bool:
        mode = self.options.mode
        return mode == "offline" or (mode == "alternate" and trial % 2 == 1)

    def reference(self) -> str:
        """The weights of an uninterrupted offline run of ``--seed``'s data (once)."""
        if self._reference is None:
            name = f"reference-seed-{self.options.seed}"
            run = ChaosTrial(self._demo_options(name), plan=None, streaming=False, size=self.size)
            result = run.run()
            if result["verify"] or result["lost"] or result["duplicated"]:
                raise DemoError(f"the uninterrupted reference run failed its checks: {result}")
            self._reference = result["weights"]
        return self._reference

    def trial(self, trial: int) -> dict[str, Any]:
        seed = self.options.seed + trial
        offline = self._offline(trial)
        plan = plan_kill(seed, trial, self.size[0], self.size[1], self.targets)
        out: dict[str, Any] = {
            "trial": trial,
            "seed": seed,
            "mode": "offline" if offline else "streaming",
            "plan": plan.describe(),
            "target": plan.target,
        }
        try:
            reference = self.reference() if offline else None
            name = f"trial-{trial:03d}"
            run = ChaosTrial(
                self._demo_options(name),
                plan=plan,
                streaming=not offline,
                size=self.size,
                postgres=self.postgres,
            )
            out.update(run.run())
            if reference is not None:
                same = _same_weights(out["weights"], reference)
                if plan.target == MASTER:
                    # Not a check: the loader skips a sample whose payload is gone and trains
                    # it once regenerated, so the batches (and the weights) may differ from
                    # the uninterrupted run's (docs/operations.md, "Lost payloads").
                    out["weights_equal"] = same
                else:
                    out["mismatch"] = not same
        except Terminated:
            raise  # the operator stops chaos, not this trial
        except DemoError as exc:
            out["failure"] = str(exc)
        return out

    def run(self) -> dict[str, Any]:
        """Run the trials. A SIGTERM, between trials too, stops chaos and what it started
        (the PostgreSQL server included)."""
        with sigterm_raises():
            return self._run_all()

    def _run_all(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            if self.options.start_postgres:
                self._start_postgres()
            return self._run(started)
        finally:
            if self.postgres is not None:
                log = self.postgres.directory / "server.log"
                if log.exists():
                    shutil.copyfile(log, self.workdir / "postgres.log")
                self.postgres.stop()

    def _start_postgres(self) -> None:
        """A throw-away PostgreSQL server with durable settings (checked with SHOW), its
        files under the workdir (as root: where the ``postgres`` user can reach them)."""
        import psycopg

        from dataflow.testing._postgres import PostgresServer, _conninfo

        where = self.workdir
        if os.geteuid() == 0 and not all(p.stat().st_mode & 0o001 for p in (where, *where.parents)):
            where = None  # the postgres user cannot enter it: tempfile's directory instead
        server = PostgresServer(durable=True)
        saved, tempfile.tempdir = tempfile.tempdir, where and str(where)
        try:
            server.start()
        except RuntimeError as exc:
            raise DemoError(f"--start-postgres: {exc}") from exc
        finally:
            tempfile.tempdir = saved
        self.postgres = server
        with psycopg.connect(_conninfo(server.url)) as conn:
            settings = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in DURABLE}
        if set(settings.values()) != {"on"}:
            raise DemoError(f"--start-postgres: the server runs with {settings}")
        self.ledger_url = server.create_database("dataflow_chaos")

    def _run(self, started: float) -> dict[str, Any]:
        from tqdm import tqdm

        results = []
        bar = tqdm(range(self.options.trials), desc="chaos", unit="trial", file=sys.stderr)
        for trial in bar:
            result = self.trial(trial)
            results.append(result)
            bar.set_postfix_str(f"last: {result['plan']}", refresh=True)
            with (self.workdir / "trials.jsonl").open("a") as file:
                file.write(json.dumps(result) + "\n")
        bar.close()
        summary = summarize(results, time.monotonic() - started, self.targets)
        print(format_table(summary), flush=True)
        if self.options.json_path is not None:
            _write_json(Path(self.options.json_path), summary)
        return summary


def summarize(
    results: list[dict[str, Any]], wall_s: float, targets: tuple = TARGETS
) -> dict[str, Any]:
    """The JSON of ``dataflow chaos --json``: totals over the trials, and each trial."""
    kills = dict.fromkeys(targets, 0)
    for r in results:
        kill = r.get("kill")
        if kill and not kill.get("missed") and "failure" not in r:
            kills[r["target"]] += 1
    recovery = [r["recovery_s"] for r in results if r.get("recovery_s") is not None]
    p50, p99 = _percentile(recovery, 0.5), _percentile(recovery, 0.99)
    return {
        "trials": len(results),
        "kills": kills,
        "missed": sum(1 for r in results if (r.get("kill") or {}).get("missed")),
        "late": sum(1 for r in results if (r.get("kill") or {}).get("late")),
        "lost": sum(r.get("lost", 0) for r in results),
        "duplicated": sum(r.get("duplicated", 0) for r in results),
        "mismatches": sum(1 for r in results if r.get("mismatch")),
        "orphans": sum(r.get("orphans", 0) for r in results),
        "verify_failures": sum(1 for r in results if r.get("verify")),
        "failures": sum(1 for r in results if "failure" in r),
        "gc_removed": sum(r.get("gc_removed", 0) for r in results),
        "recovery_s_p50": None if p50 is None else round(p50, 3),
        "recovery_s_p99": None if p99 is None else round(p99, 3),
        "wall_s": round(wall_s, 1),
        "results": results,
    }


def clean(summary: dict[str, Any]) -> bool:
    keys = ("lost", "duplicated", "mismatches", "orphans", "verify_failures", "failures")
    return not any(summary[k] for k in keys)


def format_table(summary: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    kills = summary["kills"]
    offline = sum(1 for r in summary["results"] if r["mode"] == "offline")
    rows = [
        ("trials", f"{summary['trials']} ({offline} offline, seeded order; the rest streaming)"),
        (
            "kills",
            ", ".join(f"{k} {v}" for k, v in kills.items())
            + (f" ({summary['missed']} missed: the run ended first)" if summary["missed"] else "")
            + (
                f" ({summary['late']} late: after the victim's part of the run)"
                if summary.get("late")
                else ""
            ),
        ),
        ("lost", summary["lost"]),
        ("duplicated", summary["duplicated"]),
        ("weight mismatches", summary["mismatches"]),
        ("orphans after gc", f"{summary['orphans']} ({summary['gc_removed']} collected)"),
        ("verify failures", summary["verify_failures"]),
        ("failed trials", summary["failures"]),
        ("recovery p50", seconds(summary["recovery_s_p50"])),
        ("recovery p99", seconds(summary["recovery_s_p99"])),
        ("wall", f"{summary['wall_s']:.1f} s"),
    ]
    lines = [f"{name:>18}  {value}" for name, value in rows]
    for r in summary["results"]:
        if "failure" in r:
            lines.append(f"  trial {r['trial']} failed: {r['failure']}")
    lines.append("verdict: " + ("clean" if clean(summary) else "FAILED"))
    return "\n".join(lines)


def run_chaos(options: ChaosOptions) -> dict[str, Any]:
    """Run ``dataflow chaos``; return the summary (``clean(summary)`` says if it passed)."""
    return Chaos(options).run()
