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
- :func:`producer_replaced_after_cut`: a producer cut off and replaced by a new
  process with its id; healed, the old one writes nothing;
- :func:`rank_cut`: a rank cut off while its lease or ack commits (or with the
  reply lost), for less or longer than its timeouts;
- :func:`rank_cut_at_random`: a link cut, silent or loud, short or long, at a
  random moment of a rank's leases and acks;
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
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from dataflow.model._events import Kind
from dataflow.recorder._postgres import dead_peer_s
from dataflow.testing._ledger_trial import (
    RUN,
    LedgerFaultOutcome,
    TrialError,
    committed,
    errors_of,
    loop_recovery,
    produce,
    read_outcome,
    short,
    train_rest,
    trial_on,
    wait_until,
)

__all__ = [
    "RUN",
    "LedgerFaultOutcome",
    "TrialError",
    "postgres_restart",
    "producer_cut_at_random",
    "producer_replaced_after_cut",
    "producer_reply_lost",
    "rank_cut",
    "rank_cut_at_random",
    "rank_fenced_after_cut",
]


# -- producers ------------------------------------------------------------------------------
def producer_reply_lost(
    cluster: Any,
    server: Any,
    *,
    after: str = "cut",
    cut_s: float | None = None,
    host: str = "producer0",
    busy_timeout: float = 2.0,
) -> LedgerFaultOutcome:
    """An emit whose COMMIT the server committed while its reply was lost.

    A relay on the gateway carries the producer's connection; once the COMMIT went
    out, the relay holds every reply, and the trial waits until the commit is visible
    from another connection. Then, ``after``:

    - ``"cut"``: the producer's host is cut from the gateway, silently, until the
      emit fails (longer than its timeouts): the emit raises CommitOutcomeUnknownError
      (its own retry cannot connect either) and keeps the features; emitted again
      once the link heals, it answers None (the ledger holds it). With ``cut_s``,
      healed after ``cut_s`` seconds instead, whatever the emit did meanwhile: the
      held reply arrives (the emit returns), or the emit failed first (then it is
      emitted again, as above) or its own retry found its ref (it returns);
    - ``"reset"``: the relay resets the connection: the producer's own second try
      finds its very ref committed and the emit returns it;
    - ``"short"``: the cut lasts half the dead-peer bound: the emit returns, as if
      nothing happened.
    """
    kind = f"producer-reply-lost-{after}" if cut_s is None else "producer-reply-lost-timed"
    if after == "short":
        after, cut_s = "cut", dead_peer_s(busy_timeout) / 2
    with trial_on(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        relay = cluster.relay("pg", make_url(trial.url).port)
        producer = trial.start(host, "producer", "p0", via=relay.address)
        first = producer.call(trial.call_within, op="emit", ids=["s-0"])
        producer.tell(op="emit", ids=["s-1"], pause=True)
        producer.said(trial.call_within, expect="committing")
        relay.stall("to_client")
        producer.tell(op="go")
        wait_until("the commit of s-1", lambda: committed(ledger, ["s-1"]), trial.call_within)
        answers: dict[str, Any] = {}
        if after == "reset":
            relay.reset()
            relay.resume()
            healed = time.monotonic()
            answers["during"] = producer.said(trial.call_within)
        else:
            cluster.cut(host, "gateway", silent=True)
            if cut_s is None:
                answers["during"] = producer.said(trial.call_within)
            else:
                time.sleep(cut_s)
            cluster.heal(host, "gateway")
            relay.resume()
            healed = time.monotonic()
            if "during" not in answers:
                answers["during"] = producer.said(trial.call_within)
            if "error" in answers["during"]:
                answers["retry"] = producer.call(trial.call_within, op="emit", ids=["s-1"])
        last = answers.get("retry", answers["during"])
        recovery = last["at"] - healed if "ok" in last else float("inf")
        after_fault = producer.call(trial.call_within, op="emit", ids=["s-2"])
        relay.close()
        told = [s for a in (first, *answers.values(), after_fault) for s in a.get("result") or ()]
        return read_outcome(
            trial,
            kind,
            told=[s for s in told if s],
            detail=f"the emit of s-1 answered {short(answers)}; s-2 then {short(after_fault)}",
            recovery_s=recovery,
            seen=errors_of(*answers.values(), after_fault),
            results={"first": first, **answers, "after": after_fault},
        )


def _cut_from_pg_at_random(
    cluster: Any, trial: Any, host: str, rng: random.Random, silent: bool, long: bool
) -> tuple[float, float, float]:
    """Cut ``host`` from the pg host at a random moment for less than D or (``long``)
    longer, then heal: (seconds waited before the cut, seconds cut, monotonic heal time)."""
    wait = rng.uniform(0.0, 0.6)
    time.sleep(wait)
    cut_for = trial.dead * (rng.uniform(1.5, 2.5) if long else rng.uniform(0.1, 0.4))
    cluster.cut(host, "pg", silent=silent)
    time.sleep(cut_for)
    cluster.heal(host, "pg")
    return wait, cut_for, time.monotonic()


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
    with trial_on(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        producer = trial.start(host, "producer", "p0")
        stop = trial.root.parent / "stop"
        producer.tell(op="emit_loop", first=0, retry_s=trial.call_within * 3, stop=str(stop))
        producer.said(trial.call_within, expect="looping")
        wait, cut_for, healed = _cut_from_pg_at_random(cluster, trial, host, rng, silent, long)
        count = len(list(ledger.commits(RUN, [f"s-{i}" for i in range(10_000)])))
        wait_until(
            "a commit after the heal",
            lambda: len(ledger.commits(RUN, [f"s-{i}" for i in range(count + 1)])) > count,
            trial.call_within * 2,
        )
        stop.touch()
        end = producer.said(trial.call_within * 4)
        errors = end.get("errors", [])
        return read_outcome(
            trial,
            kind,
            told=end.get("emitted", []),
            detail=(
                f"cut {quiet}ly for {cut_for:.2f}s, {wait:.2f}s into the emits: "
                f"{len(end.get('emitted', []))} emitted, {len(errors)} failed tries "
                f"({', '.join(sorted({e['error'] for e in errors})) or 'none'})"
                + ("" if end.get("ok") else f"; gave up on {end.get('gave_up')}")
            ),
            recovery_s=loop_recovery(end, healed),
            seen=[e["error"] for e in errors],
            results=end,
        )


def producer_replaced_after_cut(
    cluster: Any, server: Any, *, busy_timeout: float = 2.0
) -> LedgerFaultOutcome:
    """Producer p0 on producer0 is cut off from the pg host mid-emit; a replacement
    with the same id starts on producer1 (its claim fences the old one off) and emits
    the same sample and a new one. Healed, the old process's every emit (of a sample
    the ledger holds, or of a new one, whose features it deletes again) and its close
    raise ProducerFencedError. One commit per sample, no orphan."""
    kind = "producer-replaced-after-cut"
    with trial_on(cluster, server, kind, busy_timeout) as trial:
        old = trial.start("producer0", "producer", "p0")
        first = old.call(trial.call_within, op="emit", ids=["s-0"])
        cluster.cut("producer0", "pg", silent=True)
        during = old.call(trial.call_within, op="emit", ids=["s-1"])
        new = trial.start("producer1", "producer", "p0")
        replaced = new.call(trial.call_within, op="emit", ids=["s-1", "s-2"])
        cluster.heal("producer0", "pg")
        again = old.call(trial.call_within, op="emit", ids=["s-1"])
        fresh = old.call(trial.call_within, op="emit", ids=["s-3"])
        closed = old.call(trial.call_within, op="close")
        told = [s for a in (first, replaced, again, fresh) for s in a.get("result") or () if s]
        return read_outcome(
            trial,
            kind,
            told=told,
            detail=(
                f"cut off, the old p0's emit answered {short(during)}; the new p0's "
                f"{short(replaced)}; healed, the old one's emit of s-1 {short(again)}, of "
                f"s-3 {short(fresh)}, its close {short(closed)}"
            ),
            recovery_s=0.0,
            seen=errors_of(during, again, fresh, closed),
            results={
                "during": during,
                "new": replaced,
                "again": again,
                "fresh": fresh,
                "close": closed,
            },
        )


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
    with trial_on(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        samples = [f"s-{i}" for i in range(6)]
        produce(trial, samples)
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
            wait_until(f"the {during} landing", landed, trial.call_within)
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
        rest = train_rest(rank, trial, step + 1)
        if relay is not None:
            relay.close()
        return read_outcome(
            trial,
            kind,
            told=samples,
            trained=acked + rest["trained"],
            detail=(
                f"the {during} answered {short(answer)}, its retry {short(retried)}; "
                f"then {len(rest['trained'])} more trained"
                + (f", {rest['stuck']}" if rest["stuck"] else "")
            ),
            recovery_s=recovery,
            seen=errors_of(answer) + (errors_of(retried) if retried is not answer else []),
            results={"during": answer, "retry": retried, "rest": rest},
        )


def rank_cut_at_random(
    cluster: Any,
    server: Any,
    *,
    seed: int,
    silent: bool,
    long: bool,
    host: str = "trainer0",
    busy_timeout: float = 2.0,
) -> LedgerFaultOutcome:
    """A rank leasing and acking step after step is cut from the pg host at a random
    moment (``seed``), ``silent``-ly or loudly, for less than its dead-peer bound D or
    (``long``) longer; it makes every failed call again (the same ack) until it returns.
    Every sample must be trained exactly once."""
    rng = random.Random(seed)
    quiet = "silent" if silent else "loud"
    kind = f"rank-cut-{quiet}-{'long' if long else 'short'}"
    with trial_on(cluster, server, kind, busy_timeout) as trial:
        samples = [f"s-{i}" for i in range(600)]
        produce(trial, samples)
        rank = trial.start(host, "rank", "r0")
        stop = trial.root.parent / "stop"
        rank.tell(op="train_loop", n=2, retry_s=trial.call_within * 3, stop=str(stop))
        rank.said(trial.call_within, expect="looping")
        wait, cut_for, healed = _cut_from_pg_at_random(cluster, trial, host, rng, silent, long)
        stop.touch()
        end = rank.said(trial.call_within * 4)
        errors = end.get("errors", [])
        return read_outcome(
            trial,
            kind,
            told=samples,
            trained=end.get("trained", []),
            detail=(
                f"cut {quiet}ly for {cut_for:.2f}s, {wait:.2f}s into training: "
                f"{len(end.get('trained', []))} trained, {len(errors)} failed calls "
                f"({', '.join(sorted({e['error'] for e in errors})) or 'none'})"
            ),
            recovery_s=loop_recovery(end, healed),
            seen=[e["error"] for e in errors],
            results=end,
        )


def rank_fenced_after_cut(
    cluster: Any, server: Any, *, busy_timeout: float = 2.0
) -> LedgerFaultOutcome:
    """Rank r0 on trainer0 holds a lease when its host is cut off from pg; while it is
    away, a replacement (r1 on trainer1) resumes the run, fencing r0 off, and trains
    everything. Healed, r0's ack and lease must raise StaleEpochError and write nothing."""
    kind = "rank-fenced-after-cut"
    with trial_on(cluster, server, kind, busy_timeout) as trial, trial.ledger() as ledger:
        samples = [f"s-{i}" for i in range(6)]
        produce(trial, samples)
        old = trial.start("trainer0", "rank", "r0")
        leased = old.call(trial.call_within, op="lease", n=2)["result"]
        cluster.cut("trainer0", "pg", silent=True)
        during = old.call(trial.call_within, op="ack", ids=leased, step=1)
        new = trial.start("trainer1", "rank", "r1")
        rest = train_rest(new, trial, 1)
        head = ledger.head_seq(RUN)
        cluster.heal("trainer0", "pg")
        ack = old.call(trial.call_within, op="ack", ids=leased, step=2)
        lease = old.call(trial.call_within, op="lease", n=2)
        wrote = [e for e in ledger.events(RUN, after_seq=head) if e.actor == "r0"]
        outcome = read_outcome(
            trial,
            kind,
            told=samples,
            trained=rest["trained"],
            detail=(
                f"r0's ack on the cut link answered {short(during)}; healed, its ack answered "
                f"{short(ack)} and its lease {short(lease)}; r1 trained "
                f"{len(rest['trained'])}, r0 wrote {len(wrote)} events after"
            ),
            recovery_s=0.0,
            seen=errors_of(during, ack, lease),
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
    """The PostgreSQL server restarted while a producer emits and a rank trains, each
    retrying every call that fails (the same call again): ``how`` ``"stop"``
    (``server.stop()`` then ``start()``), ``"kill"`` (SIGKILL of the postmaster
    alone, then ``start()``: crash recovery) or ``"reboot"`` (the pg host silently
    isolated and every server process SIGKILLed; after 1.5 D the host answers again,
    refusing connections until the server has started). Every sample must be committed and
    trained exactly once."""
    kind = f"postgres-restart-{how}"
    with trial_on(cluster, server, kind, busy_timeout) as trial:
        retry_s = trial.call_within * 4
        producer = trial.start("producer0", "producer", "p0")
        rank = trial.start("trainer0", "rank", "r0")
        stops = trial.root.parent / "stop-producer", trial.root.parent / "stop-rank"
        producer.tell(op="emit_loop", first=0, retry_s=retry_s, stop=str(stops[0]))
        producer.said(trial.call_within, expect="looping")
        rank.tell(op="train_loop", retry_s=retry_s, stop=str(stops[1]))
        rank.said(trial.call_within, expect="looping")
        if how == "kill":
            _kill_postmaster(server)
        elif how == "reboot":  # the machine goes silent, and comes back without a server
            cluster.isolate("pg", silent=True)
            server.kill()
            time.sleep(trial.dead * 1.5)
            cluster.heal()
        else:
            server.stop()
        server.start()
        restarted = time.monotonic()
        with trial.ledger() as ledger:
            count = len(ledger.commits(RUN, [f"s-{i}" for i in range(10_000)]))
            wait_until(
                "a commit after the restart",
                lambda: len(ledger.commits(RUN, [f"s-{i}" for i in range(count + 1)])) > count,
                trial.call_within * 2,
            )
        stops[0].touch()
        made = producer.said(retry_s + trial.call_within)
        closed = producer.call(trial.call_within, op="close")
        stops[1].touch()
        trained = rank.said(retry_s + trial.call_within)
        errors = made.get("errors", []) + trained.get("errors", [])
        return read_outcome(
            trial,
            kind,
            told=made.get("emitted", []),
            trained=trained.get("trained", []),
            detail=(
                f"{len(made.get('emitted', []))} emitted, {len(trained.get('trained', []))} "
                f"trained, {len(errors)} failed calls "
                f"({', '.join(sorted({e['error'] for e in errors})) or 'none'}); the close "
                f"answered {short(closed)}"
            ),
            recovery_s=max(loop_recovery(made, restarted), loop_recovery(trained, restarted)),
            seen=[e["error"] for e in errors],
            results={"producer": made, "rank": trained, "close": closed},
        )


def _kill_postmaster(server: Any) -> None:
    """SIGKILL the server's postmaster alone (its pid is the first line of
    postmaster.pid), as a crash of that process would; its backends notice and exit on
    their own, then the server counts as stopped (``kill``: nothing left to kill)."""
    data = Path(server.directory) / "data"
    pid = int((data / "postmaster.pid").read_text().split()[0])
    backends = [p for p in _children(pid)]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in (pid, *backends)):
        if time.monotonic() > deadline:
            raise TrialError(f"the postmaster {pid} or its backends outlived its SIGKILL for 30s")
        time.sleep(0.05)
    server.kill()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
