"""Real processes and real gloo groups for the multi-rank tests: ports, start-up, joining."""

from __future__ import annotations

import multiprocessing
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dataflow import Consumer, Ledger
from dataflow.live._collectives import join_loopback_gloo

# A rank 0's rendezvous port, below the kernel's ephemeral range (see the module).
from dataflow.live._ports import loopback_port as free_port
from stores import SharedDirFeatureStore

CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 30


def run_args(tmp_path: Path, **more: Any) -> dict[str, Any]:
    """What a multi-rank test's processes share: a free rendezvous port, a SQLite ledger,
    a shared-directory store, a checkpoint root and a directory for their results."""
    return {
        "port": free_port(),
        "ledger": f"sqlite:///{tmp_path}/ledger.db",
        "features": str(tmp_path / "features"),
        "ckpt": str(tmp_path / "ckpt"),
        "out": str(tmp_path),
        **more,
    }


def rank_consumer(
    args: dict[str, Any], rank: int, *, run_id: str = "run", **options: Any
) -> Consumer:
    """Rank ``rank``'s Consumer (id ``rank<N>``) of a two-rank run, on ``run_args``'
    ledger and store."""
    return Consumer(
        Ledger.open(args["ledger"]),
        SharedDirFeatureStore(args["features"]),
        run_id=run_id,
        consumer_id=f"rank{rank}",
        rank=rank,
        world_size=2,
        **options,
    )


def init_gloo(rank: int, port: int, *, world_size: int = 2) -> None:
    """Join a gloo group on loopback, in a rank's process."""
    join_loopback_gloo(rank, world_size, port, timeout_s=COLLECTIVE_TIMEOUT_S)


def start(target: Callable[..., Any], *args: Any) -> multiprocessing.Process:
    """Start ``target(*args)`` in a spawned process (a module-level function)."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


def join(process: multiprocessing.Process) -> int | None:
    """Wait for ``process``; fail the test if it hangs; its exit code."""
    process.join(CHILD_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("a child process hung")
    return process.exitcode


def forkserver_context(*preload: str) -> multiprocessing.context.ForkServerContext:
    """The ``forkserver`` context, whose processes fork from a server that imported torch
    and ``preload`` once (as the demo's ranks do): a spawned process imports them again,
    seconds of CPU each on a busy machine. The processes, their SIGKILLs and their gloo
    groups are as real either way. One fork server serves the whole test session, so the
    first module to start one decides what it preloads; a later one imports the rest.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dataflow", "stores", "training", *preload])
    return context


def forkserver_start(*preload: str) -> Callable[..., multiprocessing.Process]:
    """A ``start(target, *args)`` whose processes fork from the server of
    :func:`forkserver_context` (``preload``: what it imports besides)."""
    context = forkserver_context(*preload)

    def start_forked(target: Callable[..., Any], *args: Any) -> multiprocessing.Process:
        process = context.Process(target=target, args=args)
        process.start()
        return process

    return start_forked


def _unless_gone_already(function: Any, path: str, exc_info: Any) -> None:
    """rmtree's error handler: a file that vanished meanwhile is fine (a ledger that the
    garbage collector closes during the rmtree deletes its own -wal and -shm files)."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def kept_aside(where: Path, args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """Keep the run directory ``where`` aside; each call of the result puts an exact copy
    back at the same path (a ledger records absolute paths) and returns ``args``. For a
    module-scoped fixture whose tests each resume (and kill) a run set up once."""
    pristine = where.with_name(f"{where.name}-pristine")
    shutil.copytree(where, pristine, symlinks=True)

    def fresh() -> dict[str, Any]:
        shutil.rmtree(where, onerror=_unless_gone_already)
        shutil.copytree(pristine, where, symlinks=True)
        return dict(args)

    return fresh
