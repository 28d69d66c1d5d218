"""The demo's children on the hosts of a simulated cluster (``dataflow chaos --hosts``).

Each child runs on a host of its own (a network namespace of
``dataflow.testing.Cluster``): PostgreSQL on ``pg``, the Mooncake master and the store
keeper on ``master``, producer ``i`` on ``producer{i}``, rank ``r`` on ``trainer{r}``.
A child forked from the demo's fork server (torch imported once) joins its host's
namespace first thing, before it opens a socket (``setns``, as ``ip netns exec`` does);
a child on a host whose clock is skewed reads Python's wall clock that far off
(:func:`skew_clock`).

Every address a child uses is its host's view: the ledger at the PostgreSQL host's
address (or a relay's, on the gateway), the stream at the trainer hosts' addresses,
gloo between the trainer hosts' interfaces. Nothing binds or connects to loopback.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from dataflow.demo._child import run_child

_CLONE_NEWNET = 0x40000000
#: Where ``ip netns add`` keeps a namespace's handle.
NETNS_DIR = Path("/run/netns")


def join_netns(netns: str) -> None:
    """Move this process (its only thread: call it first thing) into network namespace
    ``netns``; OSError if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def run_on_host(
    netns: str, skew_s: float, role: str, config_path: str, log_path: str, *args: object
) -> None:
    """A forked child's entry point: join ``netns``, move its wall clock ``skew_s``
    seconds, then run as ``run_child`` does."""
    join_netns(netns)
    if skew_s:
        skew_clock(skew_s)
    run_child(role, config_path, log_path, *args)


def skew_clock(skew_s: float) -> None:
    """Move this process's wall clock, as Python reads it (``time.time``,
    ``time.time_ns``: every clock read of dataflow, its stores and training), by
    ``skew_s`` seconds; the monotonic clock stays.

    Why not the cluster's libfaketime (``Host.command`` of a skewed host): with
    ``DONT_FAKE_MONOTONIC=1`` Python's ``time.sleep`` fails with EINVAL (libfaketime
    0.9.10 mangles its absolute CLOCK_MONOTONIC deadline), and without it every timed
    lock or event wait sleeps for the skew, so a producer's threads cannot run there.
    """
    wall, wall_ns, offset_ns = time.time, time.time_ns, round(skew_s * 1e9)
    time.time = lambda: wall() + skew_s  # type: ignore[assignment]
    time.time_ns = lambda: wall_ns() + offset_ns  # type: ignore[assignment]


def host_of(role: str, args: tuple) -> str:
    """The host a child of ``role`` (with its arguments) runs on."""
    if role == "producer":
        return f"producer{args[0]}"
    if role == "trainer":
        return f"trainer{args[0]}"
    return "master"  # the store keeper: beside the master it lends memory to
