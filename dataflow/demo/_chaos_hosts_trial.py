"""One trial of ``dataflow chaos --hosts``: the demo pipeline with each component on a host
of a simulated cluster, and the network faults its plan names injected mid-run.

The conductor (this process, in the root namespace, where relays live too) watches the
ledger through PostgreSQL's address and injects each fault at its moment, heals it after
its hold, and restarts what failed on it once no fault is active, as an operator would:
a producer is started again, both ranks are restarted when one fails. Each fault's
recovery is the conductor's time from the heal to the first ledger event of what it
hit (the affected producer, or the ranks, or anyone for a server-wide fault).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

from dataflow.demo._chaos_hosts_plan import (
    BUSY_TIMEOUT_S,
    GLOO_TIMEOUT_S,
    JITTER_S,
    LATENCY_S,
    SKEW_S,
    SKEWED_HOST,
    FaultPlan,
)
from dataflow.demo._chaos_trial import ChaosTrial
from dataflow.demo._child import write_config
from dataflow.demo._hosts import host_of, run_on_host
from dataflow.demo._options import DemoError, DemoOptions
from dataflow.demo._run import PRODUCERS, RANKS, _with_query
from dataflow.model._events import Kind
from dataflow.model._fold import RunState


def producer_id(index: int) -> str:
    """Demo producer ``index``'s id, as ``dataflow.demo._model.producer_id`` names it:
    that module imports torch, which the conductor does not need (seconds a run)."""
    return f"producer-{index}"


#: The port each rank's receiver binds on its own host.
STREAM_PORT = 5600
#: The relay's one-way delay while ``pg-cut-producer`` waits for the commit whose reply it
#: loses: the reply is in the relay for that long, the conductor's window to stall it.
#: (Set once the producer is connected: a new connection's handshake would take several
#: round trips of it, past the connect timeout.)
REPLY_DELAY_S = 0.4
#: pg-cut-producer gives up on its commit (the producer finished first) after this long.
ARM_S = 60.0
#: A fault's successor waits at most this long for its recovery.
RECOVERY_WAIT_S = 30.0
#: Restarts of failed children per trial before the trial is called failed.
MAX_CASUALTIES = 12


class HostsTrial(ChaosTrial):
    """One run of the demo on ``cluster`` with the planned network faults."""

    def __init__(
        self,
        options: DemoOptions,
        *,
        cluster: Any,
        postgres: Any,
        master: Any,
        faults: list[FaultPlan],
        ambient: tuple[str, ...],
        streaming: bool,
        size: tuple,
        seed: int,
        gloo_timeout_s: float = GLOO_TIMEOUT_S,
    ) -> None:
        super().__init__(options, plan=None, streaming=streaming, size=size, postgres=postgres)
        self.gloo_timeout_s = gloo_timeout_s
        self.cluster, self.master = cluster, master
        self.plans, self.ambient = faults, ambient
        self.skew = {SKEWED_HOST: SKEW_S} if "clock-skew" in ambient else {}
        self.rng = random.Random(seed)
        kinds = {p.kind for p in faults} | set(ambient)
        self.relay_pg = bool(kinds & {"latency", "stall-reset", "pg-cut-producer"})
        self.relay_stream = streaming and bool(kinds & {"latency", "stall-reset"})
        self.delay = (LATENCY_S, JITTER_S) if "latency" in ambient else (0.0, 0.0)
        self.pg_relays: dict[str, Any] = {}
        self.stream_relays: dict[tuple[int, int], Any] = {}
        self.records: list[dict[str, Any]] = []
        self._active: dict[str, Any] | None = None
        self._next = 0
        self._casualties = 0

    # -- placement -----------------------------------------------------------------------
    def _store_uri(self) -> str:
        if self.master is None:
            return super()._store_uri()
        # As the demo does: the ranks and producers lend no memory, a keeper on the
        # master's host does (see _keeper.py).
        uri = self.master.store_uri(namespace=self.run_id)
        self.lender_store_uri = _with_query(uri, segment_size="64M")
        return _with_query(uri, segment_size="0")

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        config["busy_timeout_s"] = BUSY_TIMEOUT_S
        config["endpoints"] = self._bind_endpoints()
        self._make_relays()
        curve = self._make_keys() if self.streaming else None
        for host in self.cluster.hosts.values():
            own = dict(config, ledger_url=self._ledger_url(host.name))
            if host.name.startswith("producer"):
                index = int(host.name[-1])
                own["endpoints"] = self._producer_endpoints(index)
                if curve is not None:
                    own["curve"] = {
                        "secret": str(curve / f"producer{index}.key_secret"),
                        "server_public": str(curve / "ranks.key"),
                    }
            if host.name.startswith("trainer"):
                own["gloo"] = {
                    "master_addr": self.cluster["trainer0"].address,
                    "ifname": host.interface,
                    "timeout_s": self.gloo_timeout_s,
                }
                if curve is not None:
                    own["curve"] = {
                        "secret": str(curve / "ranks.key_secret"),
                        "authorized": str(curve / "authorized"),
                    }
            write_config(self.run_dir / f"config-{host.name}.json", own)
        return config

    def _bind_endpoints(self) -> list[str]:
        return [f"tcp://{self.cluster[f'trainer{r}'].address}:{STREAM_PORT}" for r in range(RANKS)]

    def _producer_endpoints(self, index: int) -> list[str]:
        if not self.relay_stream:
            return self._bind_endpoints()
        return [f"tcp://{self.stream_relays[index, r].address}" for r in range(RANKS)]

    def _ledger_url(self, host: str) -> str:
        from sqlalchemy.engine import make_url

        relay = self.pg_relays.get(host)
        if relay is None:
            return self.ledger_url
        return (
            make_url(self.ledger_url)
            .set(host=self.cluster.gateway, port=relay.port)
            .render_as_string(hide_password=False)
        )

    def _make_relays(self) -> None:
        delay, jitter = self.delay
        seed = self.rng.randrange(2**31)
        if self.relay_pg:
            clients = [f"producer{i}" for i in range(PRODUCERS)] + [
                f"trainer{r}" for r in range(RANKS)
            ]
            for offset, host in enumerate(clients):
                self.pg_relays[host] = self.cluster.relay(
                    "pg", self.postgres.port, delay_s=delay, jitter_s=jitter, seed=seed + offset
                )
        if self.relay_stream:
            for i in range(PRODUCERS):
                for r in range(RANKS):
                    self.stream_relays[i, r] = self.cluster.relay(
                        f"trainer{r}",
                        STREAM_PORT,
                        delay_s=delay,
                        jitter_s=jitter,
                        seed=seed + 7 * i + r,
                    )

    def _make_keys(self) -> Path:
        """CURVE certificates: one for the ranks, one per producer (authorized by the ranks)."""
        import zmq.auth

        keys = self.run_dir / "curve"
        (keys / "authorized").mkdir(parents=True, exist_ok=True)
        zmq.auth.create_certificates(keys, "ranks")
        for index in range(PRODUCERS):
            public, _ = zmq.auth.create_certificates(keys, f"producer{index}")
            shutil.copy(public, keys / "authorized")
        return keys

    def _spawn(self, name: str, role: str, log: str, *args: Any) -> Any:
        host = self.cluster[host_of(role, args)]
        config = str(self.run_dir / f"config-{host.name}.json")
        process = self._context.Process(
            target=run_on_host,
            args=(host.netns, self.skew.get(host.name, 0.0), role, config, log, *args),
            name=name,
        )
        process.start()
        return process

    def _say(self, text: str) -> None:
        if not text.startswith("["):  # the trial's story, timed as the demo's own lines are
            text = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        super()._say(text)

    def _announce(self) -> None:
        mode = "streaming over ZeroMQ (CURVE)" if self.streaming else "offline, seeded order"
        faults = [*self.ambient, *(p.describe() for p in self.plans)] or ["none (the reference)"]
        self._say(f"run {self.run_id} on {self.cluster!r}: {mode}; faults: {'; '.join(faults)}")

    def _end_children(self) -> None:
        # The store keeper hands its memory back on SIGTERM (seconds with Mooncake); the
        # trial's store is checked by now and goes with its cluster: no need to wait.
        for child in self.children:
            if child.service and child.process.exitcode is None:
                child.process.kill()
        super()._end_children()

    # -- the faults ------------------------------------------------------------------------
    def _tick(self, state: RunState, now: float) -> bool:
        if self._survivors:
            return self._restart_ranks_when_down(now)
        self._step_faults(state, now)
        self._check_recoveries(now)
        if self.kill is None:
            return False
        failed = [
            c
            for c in self.children
            if c.process.exitcode not in (None, 0) and not c.killed and not c.service
        ]
        for child in failed:
            child.doomed = True  # failed on a fault: restarted once no fault is active
        if self._active is not None or not failed:
            return False
        self._casualties += len(failed)
        if self._casualties > MAX_CASUALTIES:
            names = ", ".join(c.name for c in failed)
            raise DemoError(
                f"restarted {self._casualties} children that failed on the faults, the last "
                f"{names}; their logs are in {self.run_dir / 'logs'}"
            )
        return self._restart_casualties(now)

    def _step_faults(self, state: RunState, now: float) -> None:
        active = self._active
        if active is not None:
            for due, action in list(active["steps"]):
                if now >= due:
                    active["steps"].remove((due, action))
                    action()
            done = active.get("done")
            if now >= active["until"] or (done is not None and done()):
                self._heal(active, now)
            return
        if self._next >= len(self.plans):
            return
        if self.records and not self._settled(self.records[-1], state, now):
            return
        plan = self.plans[self._next]
        if plan.kind == "pg-cut-producer" or self._due(plan, state):
            self._next += 1
            self._inject(plan, state, now)

    def _due(self, plan: FaultPlan, state: RunState) -> bool:
        """A rank's fault at its share of the training, any other at its share of the
        commits (which set the run's pace: the ranks train what arrives within seconds)."""
        done = state.trained if plan.kind in ("pg-cut-rank", "gloo-cut") else state.committed
        return len(done) >= plan.at * self.samples

    def _settled(self, record: dict[str, Any], state: RunState, now: float) -> bool:
        """Whether the next fault may come after ``record``'s: it healed, and what it hit
        recovered, or has nothing left to recover (so a quick run still injects every
        planned fault), or RECOVERY_WAIT_S passed."""
        healed = record.get("healed_mono")
        if healed is None:
            return False
        if record.get("recovery_s") is not None or record.get("missed", False):
            return True
        if self._finished(record.get("actors"), state):
            record["target_finished"] = True
            return True
        return now - healed > RECOVERY_WAIT_S

    def _finished(self, actors: str | None, state: RunState) -> bool:
        """Whether ``actors`` (as a record names them) have nothing left to recover: a
        producer closed (one that failed and is restarted claims its id again, which
        opens it), the ranks exited after the last step."""
        if actors == "ranks":
            return all(r.process.exitcode == 0 for r in self.ranks)
        if actors is not None:
            return actors in state.closed
        return False

    def _inject(self, plan: FaultPlan, state: RunState, now: float) -> None:
        record: dict[str, Any] = {"kind": plan.kind, "plan": plan.describe(), "t": now}
        if self.kill is None:  # from now on a child's failure is a casualty, not a failure
            self.kill = {"target": "network", "victims": [], "wall": time.time(), "after_seq": 0}
        active = {"record": record, "until": now + plan.hold_s, "steps": [], "heal": []}
        self.records.append(record)
        self._active = active
        getattr(self, "_inject_" + plan.kind.replace("-", "_"))(plan, active, now)
        self._say(f"fault: {plan.describe()}")

    def _heal(self, active: dict[str, Any], now: float) -> None:
        for undo in reversed(active["heal"]):
            undo()
        record = active["record"]
        record["held_s"] = round(now - record["t"], 3)
        record["healed_mono"] = time.monotonic()
        record["heal_seq"] = self._head()
        self._active = None
        self._say(f"healed: {record['plan']} after {record['held_s']} s")

    def _cut(self, active: dict[str, Any], a: str, b: str) -> None:
        self.cluster.cut(a, b)
        active["heal"].append(lambda: self.cluster.heal(a, b))

    def _stall(self, active: dict[str, Any], relay: Any, direction: str = "both") -> None:
        relay.stall(direction)
        active["heal"].append(relay.resume)

    def _inject_partition(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = "ranks"
        relay = self.stream_relays.get((plan.index, plan.peer))
        if relay is not None:  # the link runs through a relay: hold its bytes both ways
            self._stall(active, relay)
        else:
            self._cut(active, f"producer{plan.index}", f"trainer{plan.peer}")

    def _inject_mooncake_cut(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = producer_id(plan.index)
        self._cut(active, f"producer{plan.index}", "master")

    def _inject_pg_cut_rank(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = "ranks"
        active["record"]["longer_than_timeouts"] = plan.long
        relay = self.pg_relays.get(f"trainer{plan.index}")
        if relay is not None:
            self._stall(active, relay)
        else:
            self._cut(active, f"trainer{plan.index}", "pg")

    def _inject_gloo_cut(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = "ranks"
        ranks = list(self.ranks)
        for rank in ranks:
            rank.doomed = True
        self._cut(active, "trainer0", "trainer1")

        def stopped() -> bool:
            return all(r.process.exitcode is not None for r in ranks)

        def stop_survivors() -> None:  # the operator, once the ranks had their timeout
            errors = {}
            for rank in ranks:
                if rank.process.exitcode is None:
                    rank.process.kill()
                    rank.process.join()
                    errors[rank.name] = "did not stop on its own: killed"
                else:
                    errors[rank.name] = f"exit {rank.process.exitcode}: {_last_line(rank.log)}"
            active["record"]["rank_errors"] = errors

        active["done"] = stopped
        active["heal"].insert(0, stop_survivors)

    def _inject_stall_reset(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = None
        relays = [*self.pg_relays.values(), *self.stream_relays.values()]
        events = []
        for k in range(3):
            relay = self.rng.choice(relays)
            at = now + plan.hold_s * k / 3
            if self.rng.random() < 0.5:
                events.append("reset")
                active["steps"].append((at, relay.reset))
            else:
                events.append("stall")
                active["steps"].append((at, lambda relay=relay: relay.stall("both")))
                active["steps"].append((at + plan.hold_s / 4, relay.resume))
                active["heal"].append(relay.resume)
        active["record"]["events"] = events

    def _inject_pg_restart(self, plan: FaultPlan, active: dict, now: float) -> None:
        active["record"]["actors"] = None
        self.postgres.stop()
        time.sleep(plan.hold_s)
        self.postgres.start()
        active["until"] = now  # healed at once: the server is back

    def _inject_pg_cut_producer(self, plan: FaultPlan, active: dict, now: float) -> None:
        """Once the producer committed through its relay (it is connected), delay the
        relay by REPLY_DELAY_S each way; as soon as the server committed the producer's
        next commit (the conductor counts its rows while the reply is still in the
        relay), hold the reply and cut the producer from the gateway: the reply is lost.
        A reply that got through first (the relay holds nothing) heals at once, and the
        next commit is tried."""
        record = active["record"]
        actor = producer_id(plan.index)
        record["actors"] = actor
        relay = self.pg_relays[f"producer{plan.index}"]
        host = f"producer{plan.index}"
        commits = _CommitCounter(self.ledger_url, self.run_id, actor)
        seen = {"rows": commits.count(), "delayed": False}
        active["until"] = now + ARM_S

        def watch() -> bool:
            if "caught" in record:
                return False
            rows = commits.count()
            if rows == seen["rows"]:
                return False
            seen["rows"] = rows
            if not seen["delayed"]:
                relay.set_delay(REPLY_DELAY_S)
                seen["delayed"] = True
                return False
            relay.stall("to_client")
            self.cluster.cut(host, "gateway")
            held = _held_bytes(relay, "to_client")
            if held == 0:  # the reply got through before the stall: try the next commit
                self.cluster.heal(host, "gateway")
                relay.resume()
                record["tries"] = record.get("tries", 0) + 1
                return False
            record["caught"] = {"commit_rows": rows, "reply_bytes_held": held}
            active["until"] = time.monotonic() + plan.hold_s
            return False

        def undo() -> None:
            commits.close()
            if "caught" in record:
                relay.reset()  # the held reply goes nowhere: the connection ends
                self.cluster.heal(host, "gateway")
            else:
                record["missed"] = True
            relay.resume()
            relay.set_delay(*self.delay)

        active["done"] = watch
        active["heal"].append(undo)

    # -- recovery ----------------------------------------------------------------------------
    def _check_recoveries(self, now: float) -> None:
        for record in self.records:
            if "heal_seq" not in record or "recovery_s" in record or record.get("missed"):
                continue
            wanted = record.get("actors")
            for event in self.ledger.events(self.run_id, after_seq=record["heal_seq"]):
                if _affected(wanted, event.actor):
                    record["recovery_s"] = round(time.monotonic() - record["healed_mono"], 3)
                    break

    def _recovery(self) -> float | None:
        return None  # per fault: see _check_recoveries

    def _finish(self) -> dict[str, Any]:
        if self._active is not None:  # the run ended under the fault: nothing to recover
            self._active["record"]["run_ended_first"] = True
            self._heal(self._active, time.monotonic())
        self.cluster.heal()
        for record in self.records:
            record.pop("healed_mono", None)
            record.pop("t", None)
        for plan in self.plans[self._next :]:
            self.records.append({"kind": plan.kind, "plan": plan.describe(), "missed": True})
        result = super()._finish()
        result["faults"] = self.records
        # Features a rank found missing (reported lost, regenerated and trained): a commit
        # whose features its producer deleted after a lost reply would show here.
        result["payloads_lost"] = sum(
            1 for e in self.ledger.events(self.run_id) if e.kind == Kind.LOST
        )
        result["ambient"] = list(self.ambient)
        result["casualties"] = self._casualties
        return result


class _CommitCounter:
    """Counts a producer's commit rows straight from the events table: a row is there
    the moment the server committed it (the ledger's own reads wait for the horizon of
    every open transaction, later than a reply in flight)."""

    def __init__(self, url: str, run_id: str, actor: str) -> None:
        from sqlalchemy import create_engine, func, select

        from dataflow.recorder._schema import events

        self._engine = create_engine(url)
        self._query = (
            select(func.count())
            .select_from(events)
            .where(events.c.run_id == run_id, events.c.actor == actor, events.c.kind == Kind.COMMIT)
        )

    def count(self) -> int:
        with self._engine.connect() as conn:
            return int(conn.execute(self._query).scalar_one())

    def close(self) -> None:
        self._engine.dispose()


def _held_bytes(relay: Any, direction: str) -> int | None:
    """Bytes ``relay`` holds in ``direction`` (None where it cannot say).

    The Relay has no public count of what it holds, so this reads its connections from
    its own thread; a later Relay without them answers None.
    """
    counted: dict[str, int] = {}

    def count() -> None:
        counted["n"] = sum(
            sum(len(data or b"") for _, data in c.pipes[direction].queue)
            + len(c.pipes[direction].out)
            for c in relay._live
        )

    try:
        relay._call(count)
    except Exception:  # a probe of another module's internals
        return None
    return counted.get("n")


def _affected(wanted: str | None, actor: str) -> bool:
    """Whether ``actor`` is what a fault hit: ``wanted`` names it, "ranks" (any attempt of
    a rank), or None (anyone: the server went down for all)."""
    if wanted is None:
        return True
    if wanted == "ranks":
        return actor.startswith("rank")
    return actor == wanted


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"
