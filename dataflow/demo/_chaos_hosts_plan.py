"""What ``dataflow chaos --hosts`` runs: its options, its fault vocabulary, and which
trial injects which fault, when and for how long."""

from __future__ import annotations

import dataclasses
import os
import random

#: Every fault kind, in the order trials take them (see :func:`assign`), with what it does.
FAULTS: dict[str, str] = {
    "partition": "a producer host cut silently from a trainer host (the stream link), "
    "healed after a few seconds",
    "pg-cut-producer": "a producer cut from PostgreSQL mid-commit with the reply lost after "
    "the server committed (its relay holds the reply, the link is cut), healed later",
    "gloo-cut": "trainer0 cut silently from trainer1: both ranks stop on their gloo timeout, "
    "the conductor restarts them and they resume through the ledger",
    "pg-cut-rank": "a rank cut silently from PostgreSQL mid-lease or mid-ack, for less or "
    "for longer than its ledger timeouts (drawn per trial)",
    "stall-reset": "random stalls and connection resets of the relays the run uses "
    "(PostgreSQL and the stream)",
    "pg-restart": "the PostgreSQL host's server stopped and started again mid-run",
    "latency": "100 ms round trip (50 ms +- 20 ms each way) on every PostgreSQL and stream "
    "link, through relays, for the whole trial",
    "clock-skew": "producer1's wall clock 3 hours ahead (its Python time.time) for the whole trial",
    "mooncake-cut": "a producer cut silently from the Mooncake master host (its RPC and "
    "the keeper's memory), healed after a few seconds",
}
#: Faults that last the whole trial: nothing to recover from.
AMBIENT = ("latency", "clock-skew")
#: Faults that need the stream (a streaming trial).
STREAM_ONLY = ("partition",)
#: Faults that need a Mooncake store.
MOONCAKE_ONLY = ("mooncake-cut",)
#: The order a trial injects its (non-ambient) faults: the producers' first (they finish
#: committing early in an offline trial), the ranks' last.
PHASE = {
    "pg-cut-producer": 0,
    "mooncake-cut": 0,
    "partition": 0,
    "stall-reset": 1,
    "pg-restart": 1,
    "pg-cut-rank": 2,
    "gloo-cut": 2,
}
#: The skewed host of ``clock-skew``, and by how much (seconds ahead).
SKEWED_HOST, SKEW_S = "producer1", 3 * 3600.0
#: Relays' one-way delay and jitter under ``latency``.
LATENCY_S, JITTER_S = 0.05, 0.02
#: The demo's children open the ledger with this busy_timeout: a cut ends a session in
#: about as long (``dataflow.recorder``'s dead-peer bound), so a fault trial takes seconds.
BUSY_TIMEOUT_S = 3.0
#: The ranks' gloo timeout: how long a rank cut from its peer waits before it fails.
GLOO_TIMEOUT_S = 20.0
#: With ``--quick``: still room for a peer that a loaded machine starves for seconds.
QUICK_GLOO_TIMEOUT_S = 10.0
#: (samples, checkpoint_every, eval_every): optimizer steps of 16 samples.
HOSTS_SIZE = (768, 8, 8)
#: With ``--quick`` (the test suite's size): half the samples, a checkpoint as often in
#: samples trained, so that every fault still lands mid-run.
QUICK_HOSTS_SIZE = (384, 4, 8)
#: The ranges (seconds) of the producers' cuts, which no timeout of theirs bounds below
#: (the lost reply's still outlasts the ledger's dead-peer bound BUSY_TIMEOUT_S).
PRODUCER_HOLDS = {
    "partition": (2.0, 6.0),
    "pg-cut-producer": (3.0, 8.0),
    "mooncake-cut": (2.0, 5.0),
}
#: With ``--quick``: a producer's cut drawn from this lower share of its range, so that
#: a fault after it still finds the producers at work (a quick streaming trial's
#: producers commit for about 7 s).
QUICK_HOLD_SHARE = 0.3


class HostsPlanError(ValueError):
    """An option of ``--hosts`` that cannot be run (raised as ValueError by the options)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostsChaosOptions:
    """What ``dataflow chaos --hosts`` runs; checked when created (ValueError naming it)."""

    trials: int = 6
    seed: int = 0
    """Trial ``i`` draws its faults' moments from ``seed + i``; the data from ``seed``."""
    faults: tuple[str, ...] | None = None
    """Only these fault kinds; None: every kind (``mooncake-cut`` only with Mooncake)."""
    workdir: str = "dataflow-chaos"
    json_path: str | None = None
    mooncake: bool | None = None
    """Run the store on a Mooncake master host; None: when Mooncake is installed."""
    quick: bool = False
    """Smaller trials (``QUICK_HOSTS_SIZE``), a shorter gloo timeout
    (``QUICK_GLOO_TIMEOUT_S``) and shorter cuts of the producers (``QUICK_HOLD_SHARE``):
    the test suite's size."""

    @property
    def size(self) -> tuple[int, int, int]:
        """(samples, checkpoint_every, eval_every) of each trial."""
        return QUICK_HOSTS_SIZE if self.quick else HOSTS_SIZE

    @property
    def gloo_timeout_s(self) -> float:
        """The ranks' gloo timeout (a ``gloo-cut`` waits that long for both to stop)."""
        return QUICK_GLOO_TIMEOUT_S if self.quick else GLOO_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"--trials must be an int >= 1, got {self.trials!r}")
        if not isinstance(self.workdir, str | os.PathLike) or not os.fspath(self.workdir):
            raise ValueError(f"--workdir must be a directory path, got {self.workdir!r}")
        if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
            raise ValueError(f"--workdir {self.workdir} is a file; pass a directory")
        if self.faults is not None:
            check_faults(self.faults)

    def kinds(self, mooncake: bool) -> tuple[str, ...]:
        """The fault kinds these trials spread over (the given ones, or all that apply)."""
        if self.faults is not None:
            if not mooncake and any(k in MOONCAKE_ONLY for k in self.faults):
                raise ValueError(
                    "--faults mooncake-cut cuts a producer from the Mooncake master, but "
                    "Mooncake is not installed here (pip install the 'mooncake' extra), so "
                    "the store is a shared directory; leave mooncake-cut out"
                )
            return self.faults
        return tuple(k for k in FAULTS if mooncake or k not in MOONCAKE_ONLY)


def check_faults(faults: object) -> None:
    """ValueError naming an unknown or repeated fault kind."""
    if isinstance(faults, str) or not isinstance(faults, tuple) or not faults:
        raise ValueError(f"--faults must name at least one fault kind, got {faults!r}")
    for kind in faults:
        if kind not in FAULTS:
            raise ValueError(
                f"--faults {kind!r} is no fault kind; pass some of {', '.join(FAULTS)}"
            )
    if len(set(faults)) != len(faults):
        raise ValueError(f"--faults names a kind twice: {','.join(faults)}")


def parse_faults(text: str) -> tuple[str, ...]:
    """``partition,latency`` -> ("partition", "latency"), checked."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    check_faults(kinds)
    return kinds


def streaming(trial: int, kinds: tuple[str, ...] = ()) -> bool:
    """Even trials stream refs over ZeroMQ; odd ones train a committed dataset in the
    seeded order (their weights are compared with an uninterrupted run's), unless a kind
    of theirs needs the stream (a partition)."""
    return trial % 2 == 0 or any(k in STREAM_ONLY for k in kinds)


def assign(trials: int, kinds: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The fault kinds of each trial.

    With at least as many trials as kinds, trial ``i`` injects kind ``i mod K``; with
    fewer, kind ``j`` goes to trial ``j mod N`` (a trial injects several, one after
    another), so ``--trials 6`` covers all nine kinds.
    """
    slots: list[list[str]] = [[] for _ in range(trials)]
    if trials >= len(kinds):
        for i in range(trials):
            slots[i].append(kinds[i % len(kinds)])
    else:
        for j, kind in enumerate(kinds):
            slots[j % trials].append(kind)
    return [tuple(slot) for slot in slots]


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """One fault of a trial: what, on whom, from when, for how long."""

    kind: str
    at: float  # the share of its phase's progress (see HostsTrial) that sets it off
    index: int  # the producer or rank it hits
    peer: int  # partition: the rank the producer is cut from
    hold_s: float  # how long the fault lasts (a cut, a stall, the server's downtime)
    long: bool = False  # pg-cut-rank: held for longer than the rank's ledger timeouts

    def describe(self) -> str:
        who = {
            "partition": f"producer{self.index} <-> trainer{self.peer}",
            "pg-cut-producer": f"producer{self.index} <-> PostgreSQL, reply lost",
            "mooncake-cut": f"producer{self.index} <-> master",
            "pg-cut-rank": f"trainer{self.index} <-> PostgreSQL "
            + ("(longer than its timeouts)" if self.long else "(shorter than its timeouts)"),
            "gloo-cut": "trainer0 <-> trainer1",
            "stall-reset": "relay stalls and resets",
            "pg-restart": "PostgreSQL restarted",
        }.get(self.kind, self.kind)
        return f"{self.kind}: {who} at {self.at:.0%} for {self.hold_s:.1f} s"


def plan_faults(trial_seed: int, kinds: tuple[str, ...], *, quick: bool = False) -> list[FaultPlan]:
    """The timed faults of a trial (ambient ones are set up with the trial), in order;
    ``quick``: the producers' cuts shorter (``QUICK_HOLD_SHARE``), all else the same."""
    rng = random.Random(trial_seed)
    timed = sorted((k for k in kinds if k not in AMBIENT), key=lambda k: PHASE[k])
    plans = []
    for kind in timed:
        long = kind == "pg-cut-rank" and rng.random() < 0.5
        hold = {
            "partition": rng.uniform(*PRODUCER_HOLDS["partition"]),
            "pg-cut-producer": rng.uniform(*PRODUCER_HOLDS["pg-cut-producer"]),
            "mooncake-cut": rng.uniform(*PRODUCER_HOLDS["mooncake-cut"]),
            # Shorter than the ledger's dead-peer bound, or well past it.
            "pg-cut-rank": rng.uniform(2.5 * BUSY_TIMEOUT_S, 4 * BUSY_TIMEOUT_S)
            if long
            else rng.uniform(0.3, 0.6 * BUSY_TIMEOUT_S),
            "gloo-cut": GLOO_TIMEOUT_S + 15.0,  # at most: healed once both ranks stopped
            "stall-reset": rng.uniform(1.0, 2.5),
            "pg-restart": rng.uniform(0.5, 2.0),
        }[kind]
        if quick and kind in PRODUCER_HOLDS:
            low = PRODUCER_HOLDS[kind][0]
            hold = low + (hold - low) * QUICK_HOLD_SHARE
        plans.append(
            FaultPlan(
                kind=kind,
                at=rng.uniform(0.1, 0.4),
                index=rng.randrange(2),
                peer=rng.randrange(2),
                hold_s=round(hold, 2),
                long=long,
            )
        )
    return plans
