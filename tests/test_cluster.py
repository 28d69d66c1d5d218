"""The simulated cluster (dataflow.testing.Cluster): hosts, cuts, relays, skew, servers.

One Cluster serves the module (building one costs about a second); every test
leaves it healed. Needs root (network namespaces): skipped elsewhere, failed
under CI=true.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataflow import DataflowError, InvalidArgumentError
from dataflow.testing import Cluster, ClusterError, PostgresServer, Relay, cluster_unavailable
from dataflow.testing._netns import alive, nameservers, remove_dead_faketime_files
from tests.conftest import unavailable

ECHO_PORT = 7000
# A TCP echo server on ECHO_PORT, one connection at a time.
ECHO = f"""
import socket
server = socket.create_server(("0.0.0.0", {ECHO_PORT}))
while True:
    conn, _ = server.accept()
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except ConnectionResetError:
            pass
"""
# Connect to ADDRESS:PORT with a timeout; print how it ended.
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
# Run SQL statements at URL (autocommit); print the last one's rows, or the error's class.
SQL = """
import sys, psycopg
try:
    with psycopg.connect(sys.argv[1], connect_timeout=5, autocommit=True) as conn:
        for statement in sys.argv[2:]:
            cursor = conn.execute(statement)
        print(cursor.fetchall() if cursor.description else "ok")
except psycopg.OperationalError as exc:
    print("OperationalError", exc)
"""


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


@pytest.fixture(scope="module")
def pg(cluster: Cluster) -> PostgresServer:
    try:
        return cluster.start_postgres()
    except RuntimeError as exc:  # no PostgreSQL server binaries
        unavailable(str(exc))
        raise


def _wait_listening(cluster: Cluster, host: str) -> None:
    for _ in range(200):
        if _probe(cluster, "trainer1", host) == "connected":
            return
        time.sleep(0.05)
    raise AssertionError(f"the echo server on {host} never listened")


def _probe(cluster: Cluster, source: str, target: str, timeout_s: float = 1.0) -> str:
    """How a TCP connect from ``source`` to the echo server on ``target`` ends."""
    argv = [sys.executable, "-c", PROBE, cluster[target].address, str(ECHO_PORT), str(timeout_s)]
    return cluster[source].run(argv, capture_output=True, text=True).stdout.strip()


def _sql(cluster: Cluster, source: str, url: str, *statements: str) -> str:
    url = url.replace("postgresql+psycopg://", "postgresql://")
    argv = [sys.executable, "-c", SQL, url, *statements]
    return cluster[source].run(argv, capture_output=True, text=True).stdout.strip()


def _echo_client(cluster: Cluster) -> socket.socket:
    """A connection from the gateway (this process) to the echo server on pg."""
    return socket.create_connection((cluster["pg"].address, ECHO_PORT), timeout=30)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"connection closed after {len(data)} of {size} bytes"
        data += chunk
    return data


# -- hosts -------------------------------------------------------------------------------


def test_hosts_reach_each_other_and_the_gateway_by_address(cluster: Cluster) -> None:
    assert _probe(cluster, "trainer0", "pg") == "connected"
    assert _probe(cluster, "producer1", "master") == "connected"
    with _echo_client(cluster) as sock:
        sock.sendall(b"from the gateway")
        assert _recv_exactly(sock, 16) == b"from the gateway"


def test_a_host_sees_its_own_address_and_no_other_interface(cluster: Cluster) -> None:
    host = cluster["trainer0"]
    shown = host.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    interfaces = {line.split()[0].split("@")[0] for line in shown.splitlines()}
    assert interfaces == {"lo", host.interface}
    assert f"{host.address}/24" in shown
    assert cluster["pg"].address not in shown and cluster.gateway not in shown


def test_a_hosts_dns_servers_are_unreachable_so_a_lookup_fails_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(
        "# a comment\nnameserver 10.255.255.53\nnameserver 127.0.0.53\n"
        "nameserver fe80::1%eth0\noptions timeout:5\nnameserver\n"
    )
    assert nameservers(str(resolv)) == ["10.255.255.53", "fe80::1"]  # not loopback
    assert nameservers(str(tmp_path / "none")) == []
    for server in nameservers():
        route = cluster["trainer0"].run(["ip", "route", "get", server], check=False,
                                        capture_output=True, text=True)  # fmt: skip
        assert route.returncode != 0 and "No route to host" in route.stderr, route


def test_kill_ends_the_whole_process_group(cluster: Cluster) -> None:
    shell = cluster["producer0"].popen(
        ["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    cluster["producer0"].kill(shell)
    assert shell.returncode == -signal.SIGKILL
    for _ in range(500):
        if not alive(grandchild):
            break
        time.sleep(0.01)
    assert not alive(grandchild)


# -- faults ------------------------------------------------------------------------------


def test_silent_cut_neither_refuses_nor_completes_and_heal_restores(cluster: Cluster) -> None:
    cluster.cut("trainer0", "pg")
    assert _probe(cluster, "trainer0", "pg") == "timeout"
    assert _probe(cluster, "trainer1", "pg") == "connected"
    cluster.heal("pg", "trainer0")
    assert _probe(cluster, "trainer0", "pg") == "connected"


def test_an_open_connection_across_a_silent_cut_hangs_then_resumes(cluster: Cluster) -> None:
    with _echo_client(cluster) as sock:
        cluster.cut("gateway", "pg")
        sock.sendall(b"lost for now")  # into the send buffer: no error, no RST
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(100)
        cluster.heal()
        sock.settimeout(60)  # TCP retransmits on its own backoff
        assert _recv_exactly(sock, 12) == b"lost for now"


def test_loud_cut_fails_at_once_with_no_route_to_host(cluster: Cluster) -> None:
    cluster.cut("trainer0", "pg", silent=False)
    assert _probe(cluster, "trainer0", "pg", timeout_s=60.0) == "EHOSTUNREACH"
    assert _probe(cluster, "pg", "master", timeout_s=60.0) == "connected"
    cluster.heal()
    assert _probe(cluster, "trainer0", "pg") == "connected"


def test_link_down_fails_local_sends_and_link_up_restores(cluster: Cluster) -> None:
    cluster.link_down("trainer0")
    assert _probe(cluster, "trainer0", "pg", timeout_s=60.0) == "ENETUNREACH"
    cluster.link_up("trainer0")
    assert _probe(cluster, "trainer0", "pg") == "connected"


def test_isolate_cuts_a_host_from_all_and_partition_heals(cluster: Cluster) -> None:
    cluster.isolate("pg", silent=False)
    for source in ("trainer0", "master"):
        assert _probe(cluster, source, "pg", timeout_s=60.0) == "EHOSTUNREACH"
    with pytest.raises(OSError):
        socket.create_connection((cluster["pg"].address, ECHO_PORT), timeout=60)
    cluster.heal()
    with cluster.partition("producer0", "master"):
        assert _probe(cluster, "producer0", "master") == "timeout"
        assert _probe(cluster, "producer0", "pg") == "connected"
    assert _probe(cluster, "producer0", "master") == "connected"


# -- relays ------------------------------------------------------------------------------


def _relay_client(relay: Relay) -> socket.socket:
    return socket.create_connection((relay.host, relay.port), timeout=30)


def test_relay_keeps_bytes_intact_and_in_order_under_jitter(cluster: Cluster) -> None:
    relay = cluster.relay("pg", ECHO_PORT, delay_s=0.002, jitter_s=0.002, seed=7)
    payload = random.Random(1).randbytes(1 << 20)
    with _relay_client(relay) as sock:
        pieces = [payload[i : i + 4000] for i in range(0, len(payload), 4000)]
        sender = threading.Thread(target=lambda: [sock.sendall(p) for p in pieces])
        sender.start()
        received = _recv_exactly(sock, len(payload))
        sender.join(30)
    assert received == payload
    assert relay.connections == 1
    relay.close()


def test_relay_delays_each_direction_by_at_least_its_delay(cluster: Cluster) -> None:
    relay = cluster.relay("pg", ECHO_PORT, delay_s=0.1)
    with _relay_client(relay) as sock:
        for delay_s in (0.1, 0.2):
            relay.set_delay(delay_s)
            start = time.monotonic()
            sock.sendall(b"ping")
            assert _recv_exactly(sock, 4) == b"ping"
            assert time.monotonic() - start >= 2 * delay_s  # once each way
    relay.close()


def test_relay_stall_holds_bytes_until_resume(cluster: Cluster) -> None:
    relay = cluster.relay("pg", ECHO_PORT)
    with _relay_client(relay) as sock:
        for direction in ("to_client", "to_server", "both"):
            relay.stall(direction)
            sock.sendall(direction.encode())
            sock.settimeout(0.5)
            with pytest.raises(socket.timeout):
                sock.recv(100)
            relay.resume()
            sock.settimeout(30)
            assert _recv_exactly(sock, len(direction)) == direction.encode()
    relay.close()


def test_relay_reset_gives_the_client_a_connection_reset(cluster: Cluster) -> None:
    relay = cluster.relay("pg", ECHO_PORT)
    with _relay_client(relay) as sock:
        sock.sendall(b"x")
        assert _recv_exactly(sock, 1) == b"x"
        relay.reset()
        with pytest.raises(ConnectionResetError):
            sock.recv(100)
            sock.sendall(b"y")  # if the RST raced the recv, the next send sees it
            sock.recv(100)
    with _relay_client(relay) as sock:  # the relay itself still serves
        sock.sendall(b"z")
        assert _recv_exactly(sock, 1) == b"z"
    assert relay.connections == 2
    relay.close()
    with pytest.raises(ClusterError):
        relay.stall()


# A client that sends COMMIT through a relay, then (on a line on stdin) one more message, and
# prints how its wait for the reply ended; TCP_USER_TIMEOUT of 1 s bounds unacknowledged data.
LOST_REPLY = """
import errno, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
sock = socket.create_connection((host, int(port)), timeout=60)
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000)
sock.sendall(b"COMMIT")
print("sent", flush=True)
sys.stdin.readline()
try:
    sock.sendall(b"more")
    print(sock.recv(100))
except OSError as exc:
    print(errno.errorcode.get(exc.errno, str(exc.errno)))
"""


def test_a_stalled_reply_and_a_cut_link_end_the_client_by_its_own_timeout(
    cluster: Cluster,
) -> None:
    relay = cluster.relay("pg", ECHO_PORT)
    relay.stall("to_client")  # the server answers; the answer is held
    client = cluster["trainer0"].popen(
        [sys.executable, "-c", LOST_REPLY, relay.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    assert client.stdout.readline().strip() == "sent"
    cluster.cut("trainer0", "gateway")
    client.stdin.write("go\n")
    client.stdin.flush()
    assert client.stdout.readline().strip() == "ETIMEDOUT"
    client.wait(60)
    relay.close()


# -- servers -----------------------------------------------------------------------------


def test_postgres_is_reached_by_address_and_not_by_loopback(
    cluster: Cluster, pg: PostgresServer
) -> None:
    url = cluster.postgres_url(pg)
    assert cluster["pg"].address in url
    assert _sql(cluster, "trainer0", url, "SELECT 1") == "[(1,)]"
    loopback = pg.url_at("127.0.0.1")
    assert _sql(cluster, "trainer0", loopback, "SELECT 1").startswith("OperationalError")
    assert _sql(cluster, "pg", loopback, "SELECT 1") == "[(1,)]"


def test_postgres_restart_keeps_its_data_and_port(cluster: Cluster, pg: PostgresServer) -> None:
    pg.create_database("restart")
    url = cluster.postgres_url(pg, "restart")
    statements = ("CREATE TABLE t (a int)", "INSERT INTO t VALUES (7)")
    assert _sql(cluster, "trainer1", url, *statements) == "ok"
    port = pg.port
    pg.stop()
    assert _sql(cluster, "trainer1", url, "SELECT 1").startswith("OperationalError")
    pg.start()
    assert pg.port == port
    assert _sql(cluster, "trainer1", url, "SELECT a FROM t") == "[(7,)]"
    pg.kill()  # a crash; it comes back with recovery
    pg.start()
    assert _sql(cluster, "trainer1", url, "SELECT 1") == "[(1,)]"


def test_mooncake_master_listens_on_its_hosts_address(cluster: Cluster) -> None:
    try:
        master = cluster.start_mooncake_master()
    except DataflowError as exc:  # no mooncake_master binary
        unavailable(str(exc))
    address = cluster["master"].address
    assert master.master_address == f"{address}:{master.rpc_port}"
    assert address in master.store_uri() and address in master.metadata_url
    argv = [sys.executable, "-c", PROBE, address, str(master.rpc_port), "5"]
    probe = cluster["producer0"].run(argv, capture_output=True, text=True).stdout.strip()
    assert probe == "connected"
    master.stop()


# -- clocks, teardown, bad input ----------------------------------------------------------


def test_skew_moves_the_wall_clock_of_its_host_only(cluster: Cluster, tmp_path: Path) -> None:
    try:
        skewed = Cluster(
            ["early", "late", "plain"], workdir=tmp_path, skew={"early": -90.5, "late": 3600}
        )
    except ClusterError as exc:  # libfaketime is not installed
        unavailable(str(exc))
    code = (
        "import threading, time; t = time.monotonic(); time.sleep(0.2); "
        "threading.Event().wait(0.1); lock = threading.Lock(); lock.acquire(); "
        "lock.acquire(timeout=0.1); print(time.time(), time.monotonic() - t)"
    )
    with skewed:
        for host, skew_s in (("early", -90.5), ("late", 3600.0), ("plain", 0.0)):
            shown = skewed[host].run([sys.executable, "-c", code], capture_output=True, text=True)
            wall, slept = map(float, shown.stdout.split())
            assert abs(wall - time.time() - skew_s) < 30  # generous: process start-up
            assert slept >= 0.4  # sleeps and timed waits work there; durations stay true


def test_stop_leaves_no_namespace_bridge_route_or_process(cluster: Cluster, tmp_path: Path) -> None:
    with Cluster(["a", "b"], workdir=tmp_path) as small:
        names = [small[h].netns for h in ("a", "b")]
        bridge = f"df{small.slot}br"
        sleeper = small["a"].popen(["sleep", "600"])
        small.cut("a", "gateway", silent=False)
        small.relay("b", 1)
    assert sleeper.poll() is not None
    small.stop()  # idempotent
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    for name in [*names, bridge]:
        assert name not in netns.split() and name not in links
    assert f"10.213.{small.slot}." not in routes


def test_leftovers_of_a_killed_run_are_removed_when_its_slot_is_taken(
    cluster: Cluster, tmp_path: Path
) -> None:
    code = (
        "import sys, time\nfrom dataflow.testing import Cluster\n"
        f"c = Cluster(['a'], workdir={str(tmp_path)!r}).start()\n"
        "p = c['a'].popen(['sleep', '600'])\nprint(c.slot, p.pid, flush=True)\ntime.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    slot, sleeper = map(int, child.stdout.readline().split())
    child.kill()
    child.wait()
    assert alive(sleeper)  # nobody tore it down
    with contextlib.ExitStack() as held:
        # The lowest free slot is taken first: hold clusters until one took the killed run's
        # slot (or a parallel test took it first and removed the leftovers itself).
        for _ in range(200):
            taken = held.enter_context(Cluster(["a"], workdir=tmp_path))
            if taken.slot >= slot or not alive(sleeper):
                break
        assert not alive(sleeper)


def test_bad_arguments_are_refused_with_clear_errors(cluster: Cluster, tmp_path: Path) -> None:
    assert issubclass(ClusterError, DataflowError)
    with pytest.raises(InvalidArgumentError, match="'nobody'"):
        cluster["nobody"]
    with pytest.raises(InvalidArgumentError, match="itself"):
        cluster.cut("pg", "pg")
    with pytest.raises(InvalidArgumentError, match="both"):
        cluster.heal("pg")
    with pytest.raises(InvalidArgumentError, match="'ghost'"):
        Cluster(["a"], workdir=tmp_path, skew={"ghost": 1.0})
    with pytest.raises(InvalidArgumentError, match="'gateway'"):
        Cluster(["gateway"], workdir=tmp_path)
    with pytest.raises(DataflowError, match="not started"):
        Cluster(["a"], workdir=tmp_path).relay("a", 80)
    relay = cluster.relay("pg", ECHO_PORT)
    with pytest.raises(InvalidArgumentError, match="'sideways'"):
        relay.stall("sideways")
    with pytest.raises(InvalidArgumentError, match="delay_s"):
        relay.set_delay(-1.0)
    relay.close()


def test_libfaketime_files_of_dead_processes_are_removed_and_others_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        f"faketime_shm_{dead.pid}": False,
        f"sem.faketime_sem_{dead.pid}": False,
        f"faketime_shm_{os.getpid()}": True,  # a live process's: still in use
        "faketime_shm_notapid": True,
        "PostgreSQL.123": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    remove_dead_faketime_files(tmp_path)
    assert {n: (tmp_path / n).exists() for n in names} == names


# -- the launcher hook (Cluster(launcher=...)) and the suite's HostZygotes -------------------
NETNS = "import os; print(os.readlink('/proc/self/ns/net'), os.getpid() == os.getsid(0))"


def test_a_launcher_starts_a_hosts_commands_and_none_leaves_them_to_subprocess(cluster):
    calls: list[tuple[str, list[str], bool]] = []

    def launcher(host, argv, **kwargs):
        calls.append((host.name, argv, kwargs["start_new_session"]))
        if argv[0] == "sleep":
            return None  # left to subprocess.Popen
        return subprocess.Popen(host.command(argv), **kwargs)

    cluster.launcher = launcher
    try:
        echoed = cluster["trainer0"].popen(["echo", "hi"], stdout=subprocess.PIPE, text=True)
        assert echoed.communicate(timeout=30)[0] == "hi\n"
        sleeper = cluster["trainer1"].popen(["sleep", "600"])
    finally:
        cluster.launcher = None
    assert calls == [("trainer0", ["echo", "hi"], True), ("trainer1", ["sleep", "600"], True)]
    assert sleeper in cluster._processes  # stopped with the cluster, as every host process
    cluster["trainer1"].kill(sleeper)
    assert sleeper.returncode == -signal.SIGKILL


def test_a_launcher_must_be_callable(tmp_path):
    with pytest.raises(DataflowError, match="launcher must be a callable or None, got int"):
        Cluster(["a"], workdir=tmp_path, launcher=7)  # type: ignore[arg-type]


def test_host_zygotes_fork_a_hosts_python_children_inside_its_namespace(cluster):
    from tests._host_zygotes import HostZygotes
    from tests._zygote import ForkedPopen

    host = cluster["producer1"]
    fresh = host.run([sys.executable, "-c", NETNS], capture_output=True, text=True)
    launcher = HostZygotes()
    cluster.launcher = launcher
    try:
        forked = host.popen([sys.executable, "-c", NETNS], stdout=subprocess.PIPE, text=True)
        out, _ = forked.communicate(timeout=60)
        assert isinstance(forked, ForkedPopen) and forked.returncode == 0
        assert out == fresh.stdout.replace("False", "True")  # its namespace, its own session
        assert out.split()[0] != os.readlink("/proc/self/ns/net")
        # A crash of the child is a crash: SIGKILLed through its host, the status says so.
        sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        assert isinstance(sleeper, ForkedPopen)
        host.kill(sleeper)
        assert sleeper.returncode == -signal.SIGKILL
        # What a zygote cannot run as a fresh interpreter goes to subprocess.Popen.
        assert not isinstance(host.popen(["true"]), ForkedPopen)
    finally:
        cluster.launcher = None
        launcher.close()
