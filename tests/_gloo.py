"""Real processes and real gloo groups for the multi-rank tests: ports, start-up, joining."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 30


def free_port() -> int:
    """A loopback port nobody listens on now (rank 0's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, port: int, *, world_size: int = 2) -> None:
    """Join a gloo group on loopback, in a rank's process."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


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
