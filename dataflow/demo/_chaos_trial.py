"""One chaos trial: a run of the demo whose conductor kills what its plan names, restarts
it as an operator would, and checks the run afterwards."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dataflow.demo._chaos_plan import (
    MASTER,
    POSTGRES,
    POSTGRES_DOWN_S,
    SURVIVOR_WAIT_S,
    KillPlan,
)
from dataflow.demo._options import DemoError, DemoOptions
from dataflow.demo._report import lineage_report
from dataflow.demo._run import (
    RANKS,
    Demo,
    _Child,
)
from dataflow.live._replay import replay
from dataflow.model._events import Kind
from dataflow.model._fold import RunState


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
