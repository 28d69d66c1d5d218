"""What ``dataflow demo`` takes (:class:`DemoOptions`, checked when made), and its error."""

from __future__ import annotations

import dataclasses
import os
from urllib.parse import urlsplit

from dataflow.model._errors import DataflowError

#: The fewest samples a demo runs with: enough for checkpoints before the kill.
MIN_SAMPLES = 64
MAX_SAMPLES = 1_000_000


def check_store_uri(store: str) -> None:
    """Refuse a store URI with a port that is none (``mooncake://host:x``) or a ``dir://``
    URI whose path is not absolute (``dir://relative/x``), as the store would once a
    producer opens it; ValueError naming it."""
    parts = urlsplit(store)
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise ValueError(
            f"--store {store!r}: {exc}; pass HOST:PORT with a port from 1 to 65535"
        ) from None
    if parts.scheme == "dir" and (parts.netloc or not parts.path.startswith("/")):
        raise ValueError(
            f"--store {store!r}: a dir:// URI names an absolute path, dir:///ABSOLUTE/PATH "
            f"(here: dir://{os.path.abspath(parts.netloc + parts.path)})"
        )


class DemoError(DataflowError):
    """The demo could not finish: a process failed or stalled (its log is named)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What ``dataflow demo`` runs; checked when created (ValueError naming the option)."""

    workdir: str = "dataflow-demo"
    """Directory for the ledger file, the features, checkpoints, logs and the report;
    created if missing. Runs of earlier demos there are kept (each demo is a new run)."""

    quick: bool = False
    """A small run: under a minute on two cores."""

    crash: bool = True
    """SIGKILL both trainer ranks partway through and restart them (``--no-crash``: not)."""

    seed: int = 0
    """Seeds the data, the models and the moment of the kill."""

    samples: int | None = None
    """Samples to produce and train; None: 384 with ``quick``, else 3072."""

    ledger: str | None = None
    """Ledger URL; None: ``sqlite:///{workdir}/ledger.db``."""

    store: str | None = None
    """Feature store URI; None: a shared directory, ``{workdir}/features/{run_id}``."""

    start_mooncake_master: bool = False
    """Start a local ``mooncake_master`` for a ``mooncake://`` store, and stop it at the end."""

    def __post_init__(self) -> None:
        if not isinstance(self.workdir, str) or not self.workdir:
            raise ValueError(f"--workdir must be a directory path, got {self.workdir!r}")
        if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
            raise ValueError(
                f"--workdir {self.workdir} is a file, not a directory; pass a directory "
                "(it is created if missing)"
            )
        if self.samples is not None and not MIN_SAMPLES <= self.samples <= MAX_SAMPLES:
            raise ValueError(
                f"--samples must be from {MIN_SAMPLES} to {MAX_SAMPLES}, got {self.samples}"
            )
        if self.store is not None:
            scheme, sep, _ = self.store.partition("://")
            if not sep or not scheme:
                raise ValueError(
                    f"--store {self.store!r} is not a store URI; pass dir:///PATH or "
                    "mooncake://HOST:PORT?..."
                )
            if scheme == "mem":
                raise ValueError(
                    f"--store {self.store} lives in one process, and the demo's producers and "
                    "ranks are separate processes; pass dir:///PATH or mooncake://HOST:PORT?..."
                )
            from stores import known_schemes

            if scheme not in known_schemes():  # before anything starts, not in a producer
                raise ValueError(
                    f"--store {self.store}: no store is registered for {scheme!r} (known: "
                    f"{', '.join(known_schemes())}); pass dir:///PATH or mooncake://HOST:PORT?..."
                )
            check_store_uri(self.store)
        if self.start_mooncake_master and not (self.store or "").startswith("mooncake://"):
            raise ValueError(
                "--start-mooncake-master starts the master of a mooncake:// store, but the "
                f"store is {self.store or 'the default shared directory'}: add "
                "--store mooncake:// (or drop --start-mooncake-master)"
            )
