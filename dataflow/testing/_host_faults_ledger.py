"""Faults between the ledger's clients and PostgreSQL, each on a simulated cluster.

Each function runs one fault trial on a started :class:`~dataflow.testing.Cluster`
whose PostgreSQL server (``Cluster.start_postgres``) runs on host ``pg``: it makes a
fresh database, starts real producer and rank processes on their own hosts
(:mod:`dataflow.testing._ledger_actor`), injects the fault, lets them recover the
way the docs tell a user to, and returns a :class:`LedgerFaultOutcome` read from the
ledger and the store (not from what the processes believe).

The faults (docs/reliability.md, "Faults across hosts"):

- :func:`producer_reply_lost`: the server commits an emit and its reply is lost
  (a relay holds it), then the link is cut (``"cut"``: longer than the timeouts),
  reset (``"reset"``), or cut and healed before any timeout (``"short"``);
- :func:`producer_cut_at_random`: a link cut, silent or loud, short or long, at a
  random moment of a run of emits;
- :func:`rank_cut`: a rank cut off while its lease or ack commits (or with the
  reply lost), for less or longer than its timeouts;
- :func:`rank_fenced_after_cut`: a rank cut off long enough that a new consumer
  resumed the run; healed, it writes nothing more;
- :func:`postgres_restart`: the PostgreSQL host restarted (stopped, or its
  postmaster SIGKILLed) while a producer and a rank run.

Every trial bounds every wait; ``busy_timeout`` (2 s by default) sets the
clients' dead-peer bound D = max(busy_timeout, 2 s), so a trial takes seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import select
import signal
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


class Actor:
    """A producer or rank process on a host, answering JSON lines (see _ledger_actor)."""

    def __init__(
        self, cluster: Any, host: str, role: str, url: str, root: Path, actor: str, busy: float
    ) -> None:
        argv = [sys.executable, "-m", "dataflow.testing._ledger_actor", role, url, str(root)]
        self.name = f"{role} {actor} on {host}"
        self.log = root.parent / f"{actor}-{uuid.uuid4().hex[:6]}.log"
        with open(self.log, "w") as log:
            self.process: subprocess.Popen[str] = cluster[host].popen(
                [*argv, RUN, actor, str(busy)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
            )
        self.host = cluster[host]
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
class _Trial:
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
        url = self.url if via is None else _through(self.url, via)
        started = Actor(self.cluster, host, role, url, self.root, actor, self.busy)
        self.actors.append(started)
        return started

    def ledger(self) -> Ledger:
        return Ledger.open(self.url, busy_timeout=self.busy)

    def close(self) -> None:
        for actor in self.actors:
            actor.stop()


@contextlib.contextmanager
def _trial(cluster: Any, server: Any, kind: str, busy: float) -> Iterator[_Trial]:
    name = f"{kind.replace('-', '_')}_{uuid.uuid4().hex[:10]}"
    url = create_database(cluster.postgres_url(server), name)
    url = make_url(url).set(host=cluster["pg"].address).render_as_string(hide_password=False)
    root = Path(cluster.workdir) / name / "store"
    root.mkdir(parents=True)
    trial = _Trial(cluster, server, busy, url, root)
    try:
        yield trial
    finally:
        trial.close()


def _through(url: str, address: str) -> str:
    host, port = address.rsplit(":", 1)
    return make_url(url).set(host=host, port=int(port)).render_as_string(hide_password=False)


def _wait_until(what: str, check: Callable[[], bool], within: float) -> float:
    """Poll ``check`` until true (the monotonic time then); TrialError after ``within``."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(DataflowError):
            if check():
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TrialError(f"{what}: not within {within:.0f}s")
        time.sleep(0.05)


def _committed(ledger: Ledger, sample_ids: Sequence[str]) -> bool:
    return set(ledger.commits(RUN, list(sample_ids))) == set(sample_ids)


def _outcome(
    trial: _Trial,
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


def _errors(*answers: dict[str, Any]) -> list[str]:
    return [a["error"] for a in answers if "error" in a]


def _produce(trial: _Trial, sample_ids: Sequence[str]) -> None:
    """Commit ``sample_ids`` from this process (the trial's data for a rank)."""
    with trial.ledger() as ledger, SharedDirFeatureStore(trial.root) as store:
        producer = Producer(ledger, store, run_id=RUN, producer_id="seed")
        producer.emit_many([(s, {"x": _one()}) for s in sample_ids])
        producer.close()


def _one() -> torch.Tensor:
    return torch.ones(4)


# -- producers ------------------------------------------------------------------------------
def producer_reply_lost(
    cluster: Any,
    server: Any,
    *,
    after: str = "cut",
    host: str = "producer0",
    busy_timeout: float = 2.0,
) -> LedgerFaultOutcome:
    """An emit whose COMMIT the server committed while its reply was lost.

    A relay on the gateway carries the producer's connection; once the COMMIT went
    out, the relay holds every reply, and the trial waits until the commit is visible
    from another connection. Then, ``after``:

    - ``"cut"``: the producer's host is cut from the gateway, silently, for longer
      than its timeouts: the emit raises CommitOutcomeUnknownError (its own retry
      cannot connect either) and keeps the features; emitted again once the link
      heals, it answers None (the ledger holds it);
    - ``"reset"``: the relay resets the connection: the producer's own second try
      finds its very ref committed and the emit returns it;
    - ``"short"``: the host is cut for half the dead-peer bound, then healed and the
      reply let through: the emit returns, as if nothing happened.
    """
    kind = f"producer-reply-lost-{after}"
    with _trial(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        relay = cluster.relay("pg", make_url(trial.url).port)
        producer = trial.start(host, "producer", "p0", via=relay.address)
        first = producer.call(trial.call_within, op="emit", ids=["s-0"])
        producer.tell(op="emit", ids=["s-1"], pause=True)
        producer.said(trial.call_within, expect="committing")
        relay.stall("to_client")
        producer.tell(op="go")
        _wait_until("the commit of s-1", lambda: _committed(ledger, ["s-1"]), trial.call_within)
        answers: dict[str, Any] = {}
        if after == "reset":
            relay.reset()
            relay.resume()
            healed = time.monotonic()
            answers["during"] = producer.said(trial.call_within)
        else:
            cluster.cut(host, "gateway", silent=True)
            if after == "short":
                time.sleep(trial.dead / 2)
            else:
                answers["during"] = producer.said(trial.call_within)
            cluster.heal(host, "gateway")
            relay.resume()
            healed = time.monotonic()
            if after == "short":
                answers["during"] = producer.said(trial.call_within)
            elif "error" in answers["during"]:
                answers["retry"] = producer.call(trial.call_within, op="emit", ids=["s-1"])
        last = answers.get("retry", answers["during"])
        recovery = last["at"] - healed if "ok" in last else float("inf")
        after_fault = producer.call(trial.call_within, op="emit", ids=["s-2"])
        relay.close()
        told = [s for a in (first, *answers.values(), after_fault) for s in a.get("result") or ()]
        return _outcome(
            trial,
            kind,
            told=[s for s in told if s],
            detail=f"the emit of s-1 answered {_short(answers)}; s-2 then {_short(after_fault)}",
            recovery_s=recovery,
            seen=_errors(*answers.values(), after_fault),
            results={"first": first, **answers, "after": after_fault},
        )


def producer_cut_at_random(
    cluster: Any,
    server: Any,
    *,
    seed: int,
    silent: bool,
    long: bool,
    host: str = "producer0",
    busy_timeout: float = 2.0,
) -> LedgerFaultOutcome:
    """A producer emitting one sample after another is cut from the pg host at a random
    moment (``seed``), ``silent``-ly or loudly, for less than its dead-peer bound D or
    (``long``) longer; every failed emit is emitted again, as the docs say, until it
    returns. Each sample must be committed exactly once, with its features."""
    rng = random.Random(seed)
    quiet = "silent" if silent else "loud"
    kind = f"producer-cut-{quiet}-{'long' if long else 'short'}"
    with _trial(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        producer = trial.start(host, "producer", "p0")
        stop = trial.root.parent / "stop"
        producer.tell(op="emit_loop", first=0, retry_s=trial.call_within * 3, stop=str(stop))
        producer.said(trial.call_within, expect="looping")
        time.sleep(rng.uniform(0.0, 0.6))
        cut_for = trial.dead * (rng.uniform(1.5, 2.5) if long else rng.uniform(0.1, 0.4))
        cluster.cut(host, "pg", silent=silent)
        time.sleep(cut_for)
        cluster.heal(host, "pg")
        healed = time.monotonic()
        count = len(list(ledger.commits(RUN, [f"s-{i}" for i in range(10_000)])))
        _wait_until(
            "a commit after the heal",
            lambda: len(ledger.commits(RUN, [f"s-{i}" for i in range(count + 1)])) > count,
            trial.call_within * 2,
        )
        stop.touch()
        end = producer.said(trial.call_within * 4)
        errors = end.get("errors", [])
        after_heal = [e["at"] for e in errors if e["at"] >= healed]
        recovery = 0.0 if not errors else max([healed, *after_heal]) - healed
        return _outcome(
            trial,
            kind,
            told=end.get("emitted", []),
            detail=(
                f"cut {quiet}ly for {cut_for:.2f}s after a {rng.random():.0%} draw: "
                f"{len(end.get('emitted', []))} emitted, {len(errors)} failed tries "
                f"({', '.join(sorted({e['error'] for e in errors})) or 'none'})"
                + ("" if end.get("ok") else f"; gave up on {end.get('gave_up')}")
            ),
            recovery_s=recovery,
            seen=[e["error"] for e in errors],
            results=end,
        )


def _short(answer: Any) -> str:
    text = json.dumps(answer)
    return text if len(text) < 300 else text[:297] + "..."


# -- ranks ----------------------------------------------------------------------------------
def rank_cut(
    cluster: Any,
    server: Any,
    *,
    during: str,
    long: bool,
    reply_lost: bool = False,
    host: str = "trainer0",
    busy_timeout: float = 2.0,
) -> LedgerFaultOutcome:
    """A rank cut off from the pg host while its ``during`` (``"lease"`` or ``"ack"``)
    commits: the COMMIT goes out into a silent cut lasting half the dead-peer bound
    (it arrives once healed: the call returns) or (``long``) longer (the call raises,
    and the same call once healed goes through). ``reply_lost``: the server committed
    and the reply was held by a relay before the (long) cut: the retry must neither
    lose the lease nor ack twice. The rank then trains what is left; every sample must
    be trained exactly once."""
    mode = "reply-lost" if reply_lost else ("long" if long else "short")
    kind = f"rank-cut-{during}-{mode}"
    with _trial(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        samples = [f"s-{i}" for i in range(6)]
        _produce(trial, samples)
        relay = cluster.relay("pg", make_url(trial.url).port) if reply_lost else None
        rank = trial.start(host, "rank", "r0", via=None if relay is None else relay.address)
        step, acked = 1, []
        if during == "ack":
            leased = rank.call(trial.call_within, op="lease", n=2)["result"]
            command = {"op": "ack", "ids": leased, "step": step}
        else:
            command = {"op": "lease", "n": 2}
        rank.tell(**command, pause=True)
        rank.said(trial.call_within, expect="committing")
        peer = "gateway" if relay is not None else "pg"
        if relay is not None:
            relay.stall("to_client")
            rank.tell(op="go")
            landed = (
                (lambda: any(e.kind == Kind.ACK for e in ledger.events(RUN)))
                if during == "ack"
                else (lambda: any(e.kind == Kind.LEASE for e in ledger.events(RUN)))
            )
            _wait_until(f"the {during} landing", landed, trial.call_within)
            cluster.cut(host, peer, silent=True)
        else:
            cluster.cut(host, peer, silent=True)
            rank.tell(op="go")
        if long or reply_lost:
            answer = rank.said(trial.call_within)
            cluster.heal(host, peer)
            if relay is not None:
                relay.resume()
            healed = time.monotonic()
            retried = rank.call(trial.call_within, **command) if "error" in answer else answer
        else:
            time.sleep(trial.dead / 2)
            cluster.heal(host, peer)
            healed = time.monotonic()
            answer = retried = rank.said(trial.call_within)
        recovery = retried["at"] - healed if "error" in answer and "ok" in retried else 0.0
        if during == "ack" and "ok" in retried:
            acked += command["ids"]
        elif during == "lease" and "ok" in retried:
            again = rank.call(trial.call_within, op="ack", ids=retried["result"], step=step)
            acked += retried["result"] if "ok" in again else []
        rest = _train_rest(rank, trial, step + 1)
        if relay is not None:
            relay.close()
        return _outcome(
            trial,
            kind,
            told=samples,
            trained=acked + rest["trained"],
            detail=(
                f"the {during} answered {_short(answer)}, its retry {_short(retried)}; "
                f"then {len(rest['trained'])} more trained"
                + (f", {rest['stuck']}" if rest["stuck"] else "")
            ),
            recovery_s=recovery,
            seen=_errors(answer) + (_errors(retried) if retried is not answer else []),
            results={"during": answer, "retry": retried, "rest": rest},
        )


def _train_rest(rank: Actor, trial: _Trial, step: int) -> dict[str, Any]:
    """Lease and ack until the rank leases nothing (at most 50 batches)."""
    trained: list[str] = []
    for step in range(step, step + 50):  # noqa: B020 (the next step numbers)
        leased = rank.call(trial.call_within, op="lease", n=4)
        if "error" in leased:
            return {"trained": trained, "stuck": f"a lease raised {_short(leased)}"}
        if not leased["result"]:
            return {"trained": trained, "stuck": None}
        acked = rank.call(trial.call_within, op="ack", ids=leased["result"], step=step)
        if "error" in acked:
            return {"trained": trained, "stuck": f"an ack raised {_short(acked)}"}
        trained += leased["result"]
    return {"trained": trained, "stuck": "still leasing after 50 batches"}


def rank_fenced_after_cut(
    cluster: Any, server: Any, *, busy_timeout: float = 2.0
) -> LedgerFaultOutcome:
    """Rank r0 on trainer0 holds a lease when its host is cut off from pg; while it is
    away, a replacement (r1 on trainer1) resumes the run, fencing r0 off, and trains
    everything. Healed, r0's ack and lease must raise StaleEpochError and write nothing."""
    kind = "rank-fenced-after-cut"
    with _trial(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        samples = [f"s-{i}" for i in range(6)]
        _produce(trial, samples)
        old = trial.start("trainer0", "rank", "r0")
        leased = old.call(trial.call_within, op="lease", n=2)["result"]
        cluster.cut("trainer0", "pg", silent=True)
        during = old.call(trial.call_within, op="ack", ids=leased, step=1)
        new = trial.start("trainer1", "rank", "r1")
        rest = _train_rest(new, trial, 1)
        head = ledger.head_seq(RUN)
        cluster.heal("trainer0", "pg")
        ack = old.call(trial.call_within, op="ack", ids=leased, step=2)
        lease = old.call(trial.call_within, op="lease", n=2)
        wrote = [e for e in ledger.events(RUN, after_seq=head) if e.actor == "r0"]
        outcome = _outcome(
            trial,
            kind,
            told=samples,
            trained=rest["trained"],
            detail=(
                f"r0's ack on the cut link answered {_short(during)}; healed, its ack answered "
                f"{_short(ack)} and its lease {_short(lease)}; r1 trained "
                f"{len(rest['trained'])}, r0 wrote {len(wrote)} events after"
            ),
            recovery_s=0.0,
            seen=_errors(during, ack, lease),
            results={"during": during, "ack": ack, "lease": lease, "rest": rest},
        )
        if wrote:
            return _replace(outcome, problems=(*outcome.problems, f"r0 wrote {wrote}"))
        return outcome


def _replace(outcome: LedgerFaultOutcome, **changes: Any) -> LedgerFaultOutcome:
    return dataclasses.replace(outcome, **changes)


# -- the PostgreSQL host --------------------------------------------------------------------
def postgres_restart(
    cluster: Any, server: Any, *, how: str = "stop", busy_timeout: float = 2.0
) -> LedgerFaultOutcome:
    """The PostgreSQL server restarted while a producer emits (retrying each failed emit):
    ``how`` ``"stop"`` (``server.stop()`` then ``start()``) or ``"kill"`` (SIGKILL of the
    postmaster, then ``start()``). Then a rank trains the run: every sample is committed
    and trained exactly once."""
    kind = f"postgres-restart-{how}"
    with _trial(cluster, server, kind, busy_timeout) as trial:
        producer = trial.start("producer0", "producer", "p0")
        stop = trial.root.parent / "stop"
        producer.tell(op="emit_loop", first=0, retry_s=trial.call_within * 4, stop=str(stop))
        producer.said(trial.call_within, expect="looping")
        time.sleep(0.3)
        if how == "kill":
            _kill_postmaster(server)
        else:
            server.stop()
        server.start()
        restarted = time.monotonic()
        with trial.ledger() as ledger:
            count = len(ledger.commits(RUN, [f"s-{i}" for i in range(10_000)]))
            _wait_until(
                "a commit after the restart",
                lambda: len(ledger.commits(RUN, [f"s-{i}" for i in range(count + 1)])) > count,
                trial.call_within * 2,
            )
        stop.touch()
        end = producer.said(trial.call_within * 4)
        closed = producer.call(trial.call_within, op="close")
        rank = trial.start("trainer0", "rank", "r0")
        rest = _train_rest(rank, trial, 1)
        errors = end.get("errors", [])
        after = [e["at"] for e in errors if e["at"] >= restarted]
        return _outcome(
            trial,
            kind,
            told=end.get("emitted", []),
            trained=rest["trained"],
            detail=(
                f"{len(end.get('emitted', []))} emitted, {len(errors)} failed tries "
                f"({', '.join(sorted({e['error'] for e in errors})) or 'none'}); close "
                f"{_short(closed)}; then r0 trained {len(rest['trained'])}"
                + (f", {rest['stuck']}" if rest["stuck"] else "")
            ),
            recovery_s=(max([restarted, *after]) - restarted) if errors else 0.0,
            seen=[e["error"] for e in errors],
            results={"producer": end, "rest": rest},
        )


def _kill_postmaster(server: Any) -> None:
    """SIGKILL the server's postmaster (its pid is the first line of postmaster.pid); its
    backends notice and exit on their own."""
    directory = getattr(server, "data_directory", None) or Path(server.directory) / "data"
    pid = int((Path(directory) / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise TrialError(f"the postmaster {pid} outlived its SIGKILL for 30s")
