"""The ``ip`` commands under :class:`dataflow.testing.Cluster`: namespaces, slots, teardown.

Everything here runs ``ip`` (iproute2) as root; nothing needs netem, nft or
iptables. A cluster takes a *slot* (1..200) under an ``fcntl`` lock so that
parallel test workers never share a name or a subnet; the names of slot ``S``
are ``dfSh0``, ``dfSh1``... (namespaces and the root ends of their veths) and
``dfSbr`` (the bridge), its subnet ``10.213.S.0/24``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from dataflow.model._errors import DataflowError

LOCK_DIR = Path("/run/dataflow-cluster")
SLOTS = range(1, 201)
NOWHERE_MAC = "02:00:00:00:00:{:02x}"  # locally administered, owned by no interface
FAKETIME_PACKAGE = "faketime"  # the Debian/Ubuntu package that brings libfaketime
# Absolute paths: a caller's env without PATH (or with another PATH) still finds them.
IP = shutil.which("ip") or "/usr/sbin/ip"
ENV = shutil.which("env") or "/usr/bin/env"
_CAP_NET_ADMIN = 12
_LIBFAKETIME = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


class ClusterError(DataflowError):
    """The simulated cluster could not be built, changed or torn down."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n NETNS] ARGS``; return its stdout, or raise ClusterError with its stderr."""
    argv = [IP, *args] if netns is None else [IP, "-n", netns, *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


def nameservers(resolv_conf: str = "/etc/resolv.conf") -> list[str]:
    """The DNS servers this machine's resolver asks, but those on loopback."""
    try:
        lines = Path(resolv_conf).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            address = fields[1].split("%", 1)[0]  # an IPv6 zone index is no address
            with contextlib.suppress(ValueError):
                if not ipaddress.ip_address(address).is_loopback:
                    found.append(address)
    return found


def names(slot: int) -> tuple[str, str]:
    """(namespace prefix, bridge name) of ``slot``."""
    return f"df{slot}h", f"df{slot}br"


def subnet(slot: int) -> str:
    return f"10.213.{slot}"


@functools.cache
def cluster_unavailable() -> str | None:
    """None when this process can build a Cluster, else the reason (for ``pytest.skip``).

    A Cluster needs root or CAP_NET_ADMIN, the ``ip`` command (iproute2), and a
    kernel that lets it make and remove a network namespace; this tries one.
    """
    if os.geteuid() != 0 and not _has_net_admin():
        return "a Cluster needs root or CAP_NET_ADMIN (network namespaces)"
    if shutil.which("ip") is None:
        return "a Cluster needs the `ip` command (Debian/Ubuntu: apt-get install iproute2)"
    probe = f"dfprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace here: {exc}"
    return None


def _has_net_admin() -> bool:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    return False


def take_slot() -> tuple[int, IO[bytes]]:
    """Lock a free slot; return it with the open lock file (closing it frees the slot).

    A slot whose lock is free may hold the leftovers of a run that was killed
    before it could tear down: they are removed here, before the slot is used.
    """
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for slot in SLOTS:
        lock = open(LOCK_DIR / f"slot{slot}.lock", "wb")  # noqa: SIM115 (held for the cluster's life)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            remove_slot(slot)
        except BaseException:
            lock.close()
            raise
        return slot, lock
    raise ClusterError(
        f"every cluster slot ({SLOTS.start}..{SLOTS.stop - 1}) is taken: stop some Clusters "
        f"(their locks are in {LOCK_DIR})"
    )


def remove_slot(slot: int) -> None:
    """Kill every process in the slot's namespaces, delete them, the bridge and the routes."""
    prefix, bridge = names(slot)
    pattern = re.compile(rf"{re.escape(prefix)}\d+")
    namespaces = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    for netns in namespaces:
        if pattern.fullmatch(netns):
            kill_namespace(netns)
    # Deleting a veth's root end deletes its peer at once; a namespace's own
    # interfaces go away later, in the background, after `ip netns del`.
    for link in json.loads(ip("-j", "link", "show") or "[]"):
        if pattern.fullmatch(link.get("ifname", "")):
            ip("link", "del", link["ifname"], check=False)
    for netns in namespaces:
        if pattern.fullmatch(netns):
            ip("netns", "del", netns, check=False)
    ip("link", "del", bridge, check=False)
    # The loud cuts' unreachable routes in the root namespace name no device, so
    # deleting the bridge leaves them behind.
    for route in json.loads(ip("-j", "route", "show", "type", "unreachable") or "[]"):
        if route.get("dst", "").startswith(f"{subnet(slot)}."):
            ip("route", "del", "unreachable", route["dst"], check=False)


def kill_namespace(netns: str, *, grace_s: float = 0.0) -> None:
    """End every process inside ``netns`` (SIGTERM, then SIGKILL after ``grace_s``)."""
    signals = [signal.SIGTERM, signal.SIGKILL] if grace_s > 0 else [signal.SIGKILL]
    for sig in signals:
        pids = [int(p) for p in ip("netns", "pids", netns, check=False).split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 3.0)
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our own child not yet waited for) is dead for our purposes.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def wait_forwarding(port: str, timeout_s: float = 10.0) -> None:
    """Wait until bridge port ``port`` forwards frames (state 3), at most ``timeout_s``."""
    state = Path(f"/sys/class/net/{port}/brport/state")
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if state.read_text().strip() == "3":
                return
        if time.monotonic() > deadline:
            raise ClusterError(f"bridge port {port} did not forward within {timeout_s:g}s")
        time.sleep(0.01)


@functools.cache
def libfaketime() -> str:
    """Path of ``libfaketime.so.1``, or ClusterError naming the package that brings it."""
    candidates = list(_LIBFAKETIME)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(
            ["dpkg", "-L", "libfaketime"], capture_output=True, text=True, timeout=10
        ).stdout
        candidates = [line for line in listing.split() if line.endswith("libfaketime.so.1")]
        candidates += list(_LIBFAKETIME)
    candidates += glob.glob("/usr/lib*/*/faketime/libfaketime.so.1")
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise ClusterError(
        "a skewed host needs libfaketime, which is not installed: "
        f"apt-get install {FAKETIME_PACKAGE} (Debian/Ubuntu), or pass no skew"
    )


_FAKETIME_FILE = re.compile(r"(?:sem\.)?faketime_(?:shm|sem)_(\d+)")


def remove_dead_faketime_files(shm: Path = Path("/dev/shm")) -> None:
    """Remove the shared-memory files libfaketime left for processes that are gone.

    libfaketime removes its ``faketime_shm_PID`` and ``sem.faketime_sem_PID`` when a
    process exits normally; a skewed host's process that was SIGKILLed leaves them.
    """
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm):
            match = _FAKETIME_FILE.fullmatch(entry.name)
            if match is None or Path(f"/proc/{match[1]}").exists():
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
