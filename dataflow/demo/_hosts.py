"""The demo's children on the hosts of a simulated cluster (``dataflow chaos --hosts``).

Each child runs on a host of its own (a network namespace of
``dataflow.testing.Cluster``): PostgreSQL on ``pg``, the Mooncake master and the store
keeper on ``master``, producer ``i`` on ``producer{i}``, rank ``r`` on ``trainer{r}``.
A child forked from the demo's fork server (torch imported once) joins its host's
namespace first thing, before it opens a socket (``setns``, as ``ip netns exec`` does);
a child on a host whose clock is skewed is started through ``Host.popen`` instead, as
a new program under libfaketime (a fork cannot change its clock).

Every address a child uses is its host's view: the ledger at the PostgreSQL host's
address (or a relay's, on the gateway), the stream at the trainer hosts' addresses,
gloo between the trainer hosts' interfaces. Nothing binds or connects to loopback.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def run_on_host(netns: str, role: str, config_path: str, log_path: str, *args: object) -> None:
    """A forked child's entry point: join ``netns``, then run as ``run_child`` does."""
    join_netns(netns)
    run_child(role, config_path, log_path, *args)


_EXEC = (
    "import json, sys; from dataflow.demo._child import run_child; "
    "run_child(sys.argv[1], sys.argv[2], sys.argv[3], *json.loads(sys.argv[4]))"
)


class ExecProcess:
    """A child started as a new program on a host (``Host.popen``), with the parts of
    ``multiprocessing.Process`` the conductor uses: ``pid``, ``exitcode``, ``join``,
    ``kill`` and ``terminate`` (an exit code is negative for a signal, as there)."""

    def __init__(self, host: Any, role: str, config: str, log: str, args: tuple) -> None:
        argv = [sys.executable, "-c", _EXEC, role, config, log, json.dumps(list(args))]
        self._popen: subprocess.Popen[bytes] = host.popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def host_of(role: str, args: tuple) -> str:
    """The host a child of ``role`` (with its arguments) runs on."""
    if role == "producer":
        return f"producer{args[0]}"
    if role == "trainer":
        return f"trainer{args[0]}"
    return "master"  # the store keeper: beside the master it lends memory to
