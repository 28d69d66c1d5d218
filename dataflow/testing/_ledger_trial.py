"""The plumbing of a ledger fault trial on a simulated cluster: its database and store,
the producer and rank processes it drives (:mod:`dataflow.testing._ledger_actor`),
and the outcome read back from the ledger and the store
(:mod:`dataflow.testing._host_faults_ledger` runs the trials)."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.engine import make_url

from dataflow.live._producer import Producer
from dataflow.live._replay import replay
from dataflow.model._errors import DataflowError
from dataflow.model._events import Kind
from dataflow.recorder._ledger import Ledger
from dataflow.recorder._postgres import dead_peer_s
from dataflow.testing._postgres import create_database
from dataflow.tools._gc import collect_garbage
from stores import SharedDirFeatureStore

RUN = "run"
#: A Python process importing torch on a loaded machine.
STARTUP_S = 90.0


class TrialError(DataflowError):
    """A fault trial could not run as planned (a process said nothing in time, or
    exited): not an outcome of the fault, a failure of the trial."""


@dataclass(frozen=True)
class LedgerFaultOutcome:
    """What one fault trial did to the run, read back from the ledger and the store.

    ``lost``: samples a client was told are committed (or trained) that the ledger
    does not hold, or whose features the store no longer has; ``duplicated``:
    samples committed or acked more than once; ``orphans``: store generations no
    ledger ref keeps alive (what ``dataflow gc`` would remove); ``recovery_s``: from
    the end of the fault to the first write that went through (0 when the fault
    never failed one); ``seen``: the errors the clients raised, by class name;
    ``problems``: ``replay(...).verify()``; ``detail``: a line on what happened.
    """

    kind: str
    lost: int
    duplicated: int
    orphans: int
    recovery_s: float
    detail: str
    seen: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """Nothing lost, duplicated or orphaned, and the log verifies."""
        return not (self.lost or self.duplicated or self.orphans or self.problems)


#: Per host, an actor process started ahead, importing torch (seconds of CPU) while a
#: trial runs, waiting on stdin for the arguments of the next trial's actor there.
_SPARES: dict[str, tuple[Any, subprocess.Popen[str], Path]] = {}


def _spawn(cluster: Any, host: str) -> tuple[Any, subprocess.Popen[str], Path]:
    log = Path(cluster.workdir) / "actors" / f"{host}-{uuid.uuid4().hex[:6]}.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as file:
        process: subprocess.Popen[str] = cluster[host].popen(
            [sys.executable, "-m", "dataflow.testing._ledger_actor"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=file,
            text=True,
            bufsize=1,
        )
    return cluster, process, log


def _take_spare(cluster: Any, host: str) -> tuple[subprocess.Popen[str], Path]:
    """The actor process started ahead on ``host`` (a new one if there is none), and
    another started ahead in its place."""
    spare = _SPARES.pop(host, None)
    if spare is not None and (spare[0] is not cluster or spare[1].poll() is not None):
        if spare[1].poll() is None:
            spare[0][host].kill(spare[1])
        spare[1].communicate()  # reaped, its pipes closed
        spare = None
    _, process, log = spare or _spawn(cluster, host)
    _SPARES[host] = _spawn(cluster, host)
    return process, log


class Actor:
    """A producer or rank process on a host, answering JSON lines (see _ledger_actor).

    The process was started ahead (it imported what it needs during the previous
    trial); it opens the ledger and the store once told its arguments, here."""

    def __init__(
        self, cluster: Any, host: str, role: str, url: str, root: Path, actor: str, busy: float
    ) -> None:
        self.name = f"{role} {actor} on {host}"
        self.process, self.log = _take_spare(cluster, host)
        self.host = cluster[host]
        self.tell(argv=[role, url, str(root), RUN, actor, str(busy)])
        self.said(STARTUP_S, expect="ready")

    def said(self, within: float, *, expect: str | None = None) -> dict[str, Any]:
        """The next line the actor says; TrialError after ``within`` seconds."""
        out = self.process.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], within)
        line = out.readline() if ready else ""
        if not line:
            tail = self.log.read_text(errors="replace")[-1500:]
            raise TrialError(f"{self.name} said nothing within {within:.0f}s:\n{tail}")
        answer = json.loads(line)
        if expect is not None and expect not in answer:
            raise TrialError(f"{self.name} said {answer}, expected {expect!r}")
        return answer

    def tell(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def call(self, within: float, **command: Any) -> dict[str, Any]:
        self.tell(**command)
        return self.said(within)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.host.kill(self.process)
        self.process.wait(timeout=30)


@dataclass
class Trial:
    """One trial's database, store and processes; ``close`` ends the processes."""

    cluster: Any
    server: Any
    busy: float
    url: str  # the database at the pg host's address
    root: Path
    actors: list[Actor] = field(default_factory=list)

    @property
    def dead(self) -> float:
        return dead_peer_s(self.busy)

    @property
    def call_within(self) -> float:
        """How long one library call on a dead link may take, with room for a loaded host:
        docs/reliability.md ("Timeouts") bounds it by 3 D + 2 s; a producer's commit
        tries twice."""
        return 2 * (3 * self.dead + 2) + 10

    def start(self, host: str, role: str, actor: str, *, via: str | None = None) -> Actor:
        url = self.url if via is None else through(self.url, via)
        started = Actor(self.cluster, host, role, url, self.root, actor, self.busy)
        self.actors.append(started)
        return started

    def ledger(self) -> Ledger:
        return Ledger.open(self.url, busy_timeout=self.busy)

    def close(self) -> None:
        for actor in self.actors:
            actor.stop()


@contextlib.contextmanager
def trial_on(cluster: Any, server: Any, kind: str, busy: float) -> Iterator[Trial]:
    name = f"{kind.replace('-', '_')}_{uuid.uuid4().hex[:10]}"
    url = create_database(cluster.postgres_url(server), name)
    url = make_url(url).set(host=cluster["pg"].address).render_as_string(hide_password=False)
    root = Path(cluster.workdir) / name / "store"
    root.mkdir(parents=True)
    trial = Trial(cluster, server, busy, url, root)
    try:
        yield trial
    finally:
        trial.close()


def through(url: str, address: str) -> str:
    host, port = address.rsplit(":", 1)
    return make_url(url).set(host=host, port=int(port)).render_as_string(hide_password=False)


def wait_until(what: str, check: Callable[[], bool], within: float) -> float:
    """Poll ``check`` until true (the monotonic time then); TrialError after ``within``."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(DataflowError):
            if check():
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TrialError(f"{what}: not within {within:.0f}s")
        time.sleep(0.05)


def committed(ledger: Ledger, sample_ids: Sequence[str]) -> bool:
    return set(ledger.commits(RUN, list(sample_ids))) == set(sample_ids)


def read_outcome(
    trial: Trial,
    kind: str,
    *,
    told: Sequence[str],
    detail: str,
    recovery_s: float,
    seen: Sequence[str] = (),
    trained: Sequence[str] | None = None,
    results: dict[str, Any] | None = None,
) -> LedgerFaultOutcome:
    """Read the run back: ``told`` the ids a producer was told are committed, ``trained``
    those a rank acked (given, every committed sample must be trained: a rank trained
    the run to its end)."""
    with trial.ledger() as ledger, SharedDirFeatureStore(trial.root) as store:
        events = list(ledger.events(RUN))
        commits = Counter(e.sample_id for e in events if e.kind == Kind.COMMIT)
        acks = Counter(s for e in events if e.kind == Kind.ACK for s in e.sample_ids or ())
        state = replay(ledger, RUN)
        live = [s for s in state.committed if s not in state.released and s not in state.lost]
        refs = state.refs(live)
        missing = {s for s, ref in refs.items() if not store.exists(ref)}
        missing |= {s for s in told if s not in commits}
        if trained is not None:
            missing |= {s for s in trained if s not in state.trained}
            missing |= {s for s in state.committed if s not in state.trained}
        orphans = collect_garbage(ledger, store, grace=0, dry_run=True).removed
        duplicated = sum(1 for c in commits.values() if c > 1) + sum(
            1 for c in acks.values() if c > 1
        )
        return LedgerFaultOutcome(
            kind=kind,
            lost=len(missing),
            duplicated=duplicated,
            orphans=orphans,
            recovery_s=round(max(recovery_s, 0.0), 3),
            detail=detail,
            seen=tuple(seen),
            problems=tuple(state.verify()),
            results={"url": trial.url, **(results or {})},
        )


def errors_of(*answers: dict[str, Any]) -> list[str]:
    return [a["error"] for a in answers if "error" in a]


def produce(trial: Trial, sample_ids: Sequence[str]) -> None:
    """Commit ``sample_ids`` from this process (the trial's data for a rank)."""
    with trial.ledger() as ledger, SharedDirFeatureStore(trial.root) as store:
        producer = Producer(ledger, store, run_id=RUN, producer_id="seed")
        producer.emit_many([(s, {"x": _one()}) for s in sample_ids])
        producer.close()


def _one() -> torch.Tensor:
    return torch.ones(4)


def loop_recovery(loop: dict[str, Any], healed: float) -> float:
    """From ``healed`` to the first emit of ``loop`` that returned after it; 0 when no
    emit failed (the fault went unnoticed)."""
    if not loop.get("errors"):
        return 0.0
    after = [at for at in loop.get("done", []) if at >= healed]
    return min(after) - healed if after else float("inf")


def short(answer: Any) -> str:
    text = json.dumps(answer)
    return text if len(text) < 300 else text[:297] + "..."


def train_rest(rank: Actor, trial: Trial, step: int) -> dict[str, Any]:
    """Lease and ack until the rank leases nothing (at most 50 batches)."""
    trained: list[str] = []
    for step in range(step, step + 50):  # noqa: B020 (the next step numbers)
        leased = rank.call(trial.call_within, op="lease", n=4)
        if "error" in leased:
            return {"trained": trained, "stuck": f"a lease raised {short(leased)}"}
        if not leased["result"]:
            return {"trained": trained, "stuck": None}
        acked = rank.call(trial.call_within, op="ack", ids=leased["result"], step=step)
        if "error" in acked:
            return {"trained": trained, "stuck": f"an ack raised {short(acked)}"}
        trained += leased["result"]
    return {"trained": trained, "stuck": "still leasing after 50 batches"}
