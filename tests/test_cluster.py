"""The simulated cluster (dataflow.testing.Cluster): hosts, cuts, relays, skew, services.

One Cluster serves the whole module (building one costs about a second); every
test leaves it healed. Needs root (network namespaces): skipped elsewhere,
failed under CI=true.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataflow.testing import Cluster, cluster_unavailable
from tests.conftest import unavailable

# A TCP echo server on port 7000 of its host, run through Host.popen.
ECHO = """
import socket
server = socket.create_server(("0.0.0.0", 7000))
while True:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
"""
# Connect to ADDRESS:PORT with a short timeout; print what happened.
PROBE = """
import errno, socket, sys
sock = socket.socket()
sock.settimeout(float(sys.argv[3]))
try:
    sock.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except socket.timeout:
    print("timeout")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, str(exc.errno)))
"""
ECHO_PORT = 7000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = cluster_unavailable()
    if reason is not None:
        unavailable(reason)
    with Cluster(workdir=tmp_path_factory.mktemp("cluster")) as cluster:
        for host in ("pg", "master"):
            cluster[host].popen([sys.executable, "-c", ECHO])
        for host in ("pg", "master"):
            _wait_listening(cluster, host)
        yield cluster


@pytest.fixture(autouse=True)
def _healed(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.heal()
    for host in cluster.hosts:
        cluster.link_up(host)


def _wait_listening(cluster: Cluster, host: str) -> None:
    for _ in range(200):
        if _probe(cluster, "trainer1", host, 2.0) == "connected":
            return
        time.sleep(0.05)
    raise AssertionError(f"the echo server on {host} never listened")


def _probe(cluster: Cluster, source: str, target: str, timeout_s: float = 1.0) -> str:
    """How a TCP connect from ``source`` to the echo server on ``target`` ends."""
    argv = [sys.executable, "-c", PROBE, cluster[target].address, str(ECHO_PORT), str(timeout_s)]
    return cluster[source].run(argv, capture_output=True, text=True).stdout.strip()


def test_hosts_reach_each_other_by_address(cluster: Cluster) -> None:
    assert _probe(cluster, "trainer0", "pg") == "connected"
    assert _probe(cluster, "producer1", "master") == "connected"
    with socket.create_connection((cluster["pg"].address, ECHO_PORT), timeout=5) as sock:
        sock.sendall(b"from the gateway")
        assert sock.recv(100) == b"from the gateway"


def test_a_host_sees_its_own_address_and_no_other_interface(cluster: Cluster) -> None:
    host = cluster["trainer0"]
    shown = host.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    interfaces = {line.split()[0].split("@")[0] for line in shown.splitlines()}
    assert interfaces == {"lo", host.interface}
    assert f"{host.address}/24" in shown
    assert cluster["pg"].address not in shown


def test_silent_cut_times_out_and_heal_restores(cluster: Cluster) -> None:
    cluster.cut("trainer0", "pg")
    assert _probe(cluster, "trainer0", "pg") == "timeout"
    assert _probe(cluster, "trainer1", "pg") == "connected"
    cluster.heal("pg", "trainer0")
    assert _probe(cluster, "trainer0", "pg") == "connected"


def test_loud_cut_fails_at_once(cluster: Cluster) -> None:
    cluster.cut("trainer0", "pg", silent=False)
    assert _probe(cluster, "trainer0", "pg", timeout_s=30.0) == "EHOSTUNREACH"
    cluster.heal()
    assert _probe(cluster, "trainer0", "pg") == "connected"


def test_stop_leaves_no_namespace_bridge_or_process(tmp_path: Path) -> None:
    with Cluster(["a", "b"], workdir=tmp_path) as small:
        names = [small[h].netns for h in ("a", "b")]
        bridge = f"df{small.slot}br"
        sleeper = small["a"].popen(["sleep", "600"])
    assert sleeper.poll() is not None
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    for name in [*names, bridge]:
        assert name not in netns.split() and name not in links
