"""What ``dataflow chaos`` runs: its options, its kill targets and each trial's kill plan."""

from __future__ import annotations

import dataclasses
import os
import random
from urllib.parse import urlsplit

from dataflow.demo._options import check_store_uri
from dataflow.demo._run import (
    BATCH_SIZE,
    GRAD_ACCUM,
    PRODUCERS,
    RANKS,
)

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
