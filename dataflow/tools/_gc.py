"""Garbage collection: the features a store holds that no ledger event keeps alive.

A store collects what the ledger no longer needs: puts of producers that died before
their commit, generations a regeneration superseded, and features the release policy
freed whose delete never happened (a crash between the release event and the delete).
Only the store contract is used (``scan`` and ``delete_stored``), so a plugin store is
collected the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataflow.interfaces._store import FeatureStore
from dataflow.live._replay import replay
from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

#: Seconds a stored generation is left alone after its put: a commit may still come.
DEFAULT_GRACE_S = 300.0


@dataclass(frozen=True)
class GcReport:
    """What a collection removed (or, with ``dry_run``, would remove)."""

    removed: int
    bytes: int
    kept: int
    young: int
    dry_run: bool


_CHUNK = 5000


def collect_garbage(
    ledger: Ledger,
    store: FeatureStore,
    *,
    grace: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
) -> GcReport:
    """Remove from ``store`` every generation that no run of ``ledger`` keeps alive.

    A generation is kept while it is the newest committed revision of its sample in a
    run of the ledger and the features of that revision were neither released nor
    reported lost. Every run of the ledger counts, so a store that several runs share
    loses nothing; a store shared with another ledger must not be collected against
    this one. Generations younger than ``grace`` seconds are never touched (a put whose
    commit is on its way), so a collection is safe while the run is live, as long as
    ``grace`` exceeds the longest gap between a producer's put and its commit, and the
    hosts' clocks agree within it (a store records its writer's clock, or its file
    server's). The generation of a commit whose features were since released or
    lost is removed whatever its age: no put of it can be on its way. A
    generation put again meanwhile is never freed (``delete_stored``).

    The ledger's refs name their store by URI. A store that no ref names but that
    holds a generation which refs naming another URI keep alive is that store reached
    by another path (moved, or mounted elsewhere): InvalidArgumentError, before any
    such generation is removed.
    """
    if not isinstance(store, FeatureStore):
        raise ArgumentTypeError(f"store must be a FeatureStore, got {type(store).__name__}")
    if (
        isinstance(grace, bool)
        or not isinstance(grace, (int, float))
        or not math.isfinite(grace)
        or grace < 0
    ):
        raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
    live: set[tuple[str, int]] = set()
    elsewhere: dict[tuple[str, int], str] = {}  # kept alive in a store of another URI
    # Committed, then released or lost: no put of it is on its way, so no grace. Its
    # `created` is its writer's clock, which may run hours ahead of this host's.
    settled: set[tuple[str, int]] = set()
    for run_id in ledger.runs():
        state = replay(ledger, run_id)
        stored = [s for s in state.committed if s not in state.released and s not in state.lost]
        for start in range(0, len(stored), _CHUNK):  # refs of trained samples come from the ledger
            for sample_id, ref in state.refs(stored[start : start + _CHUNK]).items():
                if ref.store == store.uri:
                    live.add((sample_id, ref.generation))
                else:
                    elsewhere[(sample_id, ref.generation)] = ref.store
        gone = [s for s in state.committed if s in state.released or s in state.lost]
        for start in range(0, len(gone), _CHUNK):
            for sample_id, ref in state.refs(gone[start : start + _CHUNK]).items():
                if ref.store == store.uri:
                    settled.add((sample_id, ref.generation))
    horizon = time.time() - grace
    removed = nbytes = kept = young = 0
    for obj in store.scan():
        key = (obj.sample_id, obj.generation)
        if key in live:
            kept += 1
        elif not live and key in elsewhere:
            raise InvalidArgumentError(
                f"store {store.uri} holds sample {obj.sample_id!r} generation "
                f"{obj.generation}, which the ledger keeps alive in store {elsewhere[key]}, "
                f"and no ref names {store.uri}: it looks like that store reached by another "
                "path (moved, or mounted elsewhere). Stopped before removing anything the "
                f"ledger keeps alive; collect it by the URI its refs name ({elsewhere[key]})"
            )
        elif obj.created > horizon and key not in settled:
            young += 1
        elif dry_run or store.delete_stored(obj):
            removed += 1
            nbytes += obj.nbytes
    return GcReport(removed=removed, bytes=nbytes, kept=kept, young=young, dry_run=dry_run)
