"""``dataflow doctor`` against real components: it says what is wrong, and exits 1.

Each problem is made for real: a PostgreSQL server started and stopped, a store on
a read-only bind mount (root ignores permission bits, so a mode of 0o555 would not
stop a write; a read-only mount stops root too: EROFS), a clock 2 h ahead
(libfaketime) against a real PostgreSQL server, a port nobody listens on, a
ledger of schema version 3 (tests/data/), a Mooncake master that is not there.
Every run is a real ``dataflow`` process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dataflow import Ledger
from dataflow.recorder._schema import SCHEMA_VERSION
from dataflow.streams import ReceiverConfig, ZmqRefReceiver
from dataflow.testing._postgres import PostgresServer, create_database, drop_database
from stores import open_store
from tests._zygote import run_cli
from tests.conftest import unavailable

DATA = Path(__file__).parent / "data"
#: The healthy runs leave the machine's free disk out: a CI machine may be nearly full.
NO_DISK_LIMITS = ("--min-free-gib", "0", "--min-free-percent", "0")
#: Every check of a bad deployment is bounded: the doctor runs with short timeouts.
QUICK = ("--timeout", "2")


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _doctor(*args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Any:
    if not prefix:
        return run_cli("doctor", *args, env=env, timeout=120)
    env = dict(os.environ if env is None else env)
    env.pop("DATAFLOW_LEDGER", None)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "dataflow.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _problems(done: Any) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("PROBLEM")]


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory) -> str:
    """A shared-directory store laid out (its first producer would make it)."""
    uri = f"dir://{tmp_path_factory.mktemp('doctor_store')}"
    open_store(uri).close()
    return uri


@pytest.fixture(scope="module")
def sqlite_ledger(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('doctor_ledger')}/ledger.db"
    Ledger.open(url).close()
    return url


@pytest.fixture(scope="module")
def pg_ledger(postgres_server) -> Iterator[str]:
    name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    url = create_database(postgres_server, name)
    Ledger.open(url).close()
    yield url
    drop_database(postgres_server, name)


@pytest.fixture(scope="module")
def stream_endpoint() -> Iterator[str]:
    """A rank's real ZeroMQ receiver, bound on loopback."""
    with ZmqRefReceiver(ReceiverConfig(expected_producers=1)) as receiver:
        yield receiver.endpoint


# -- healthy --------------------------------------------------------------------------
def test_a_healthy_sqlite_deployment_exits_0(sqlite_ledger, store_uri, stream_endpoint):
    done = _doctor(
        "--ledger", sqlite_ledger, "--store", store_uri, "--stream", stream_endpoint,
        *NO_DISK_LIMITS,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "all well"
    assert any(f"schema version {SCHEMA_VERSION} (current)" in line for line in lines)
    assert any("offset 0" in line for line in lines)  # SQLite: this host's clock, said so
    assert any(line.startswith("ok      store") and "probe" in line for line in lines)
    assert any(line.startswith("ok      stream") for line in lines)
    # The probe object was removed: nothing is left in the store.
    with open_store(store_uri) as store:
        assert list(store.scan()) == []


def test_a_healthy_postgres_deployment_exits_0_and_reports_json(
    pg_ledger, store_uri, stream_endpoint
):
    done = _doctor(
        "--ledger", pg_ledger, "--store", store_uri, "--stream", stream_endpoint,
        *NO_DISK_LIMITS, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["problems"] == 0
    checks = {c["check"]: c for c in report["checks"]}
    assert set(checks) == {"ledger", "clock", "store", "disk", "stream"}
    for check in report["checks"]:
        assert set(check) >= {"check", "target", "ok", "detail", "fix"}
        assert check["ok"] is True and check["fix"] is None
    assert checks["ledger"]["backend"] == "postgresql"
    assert checks["ledger"]["schema_version"] == SCHEMA_VERSION
    assert abs(checks["clock"]["offset_s"]) < 1.0  # the same machine's clock
    assert checks["clock"]["round_trip_s"] >= 0
    assert checks["stream"]["target"] == stream_endpoint
    assert checks["disk"]["free_bytes"] > 0


# -- problems -------------------------------------------------------------------------
def test_a_stopped_postgresql_is_found_in_bounded_time():
    try:
        server = PostgresServer()
        server.start()
    except (RuntimeError, OSError) as exc:
        unavailable(f"no PostgreSQL server for the doctor tests: {exc}")
    try:
        url = server.create_database("doctor_stopped")
        Ledger.open(url).close()
        port = server.port
    finally:
        server.stop()
    done = _doctor("--ledger", url, *QUICK)  # the subprocess timeout bounds it
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert "ledger" in problem and "cannot be reached" in problem
    assert f":{port}/doctor_stopped" in problem
    assert "What to do: check that the database server runs" in problem


def test_an_unwritable_store_is_found(sqlite_ledger, store_uri):
    # root writes through permission bits; a read-only bind mount, in a mount namespace of
    # the doctor's own (unshare -m), stops it as it would a read-only NFS export.
    root = store_uri[len("dir://") :]
    mount = f"mount --bind {root} {root} && mount -o remount,bind,ro {root}"
    check = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mount} && ! touch {root}/probe"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if check.returncode != 0:
        unavailable(f"no read-only bind mount here (root in a mount namespace): {check.stderr!r}")
    done = _doctor(
        "--ledger", sqlite_ledger, "--store", store_uri, *NO_DISK_LIMITS, *QUICK,
        prefix=("unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh"),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert problem.startswith(f"PROBLEM store  {store_uri}: a probe object could not be put")
    assert "Read-only file system" in problem
    assert "make the store writable from this host" in problem


def test_a_skewed_clock_is_found_with_its_offset(pg_ledger):
    if shutil.which("faketime") is None:
        unavailable("no faketime here (apt-get install faketime; scripts/dev.sh installs it)")
    env = dict(os.environ, FAKETIME_DONT_FAKE_MONOTONIC="1")
    skewed = ("faketime", "-f", "+2h")
    done = _doctor("--ledger", pg_ledger, "--json", *QUICK, prefix=skewed, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    (problem,) = [c for c in report["checks"] if not c["ok"]]
    assert problem["check"] == "clock"
    assert 7200 - 60 < -problem["offset_s"] < 7200 + 60  # this host is 2 h ahead
    assert "ahead of the database server's" in problem["detail"]
    assert "NTP" in problem["fix"]
    # The text names it too, and a larger limit lets it pass.
    text = _doctor("--ledger", pg_ledger, *QUICK, prefix=skewed, env=env)
    assert text.returncode == 1
    assert "PROBLEM clock" in text.stdout and "s ahead of the database server's" in text.stdout
    lenient = _doctor(
        "--ledger", pg_ledger, "--max-clock-offset", "10000", *NO_DISK_LIMITS,
        prefix=skewed, env=env,
    )  # fmt: skip
    assert lenient.returncode == 0, lenient.stdout


def test_a_stream_endpoint_nobody_listens_on_is_found(sqlite_ledger):
    endpoint = f"tcp://127.0.0.1:{_closed_port()}"
    done = _doctor("--ledger", sqlite_ledger, "--stream", endpoint, *NO_DISK_LIMITS, *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert problem.startswith(f"PROBLEM stream {endpoint}: nothing accepts a connection")
    assert "start the rank whose receiver binds it" in problem


def test_a_ledger_that_needs_a_migration_is_found(tmp_path):
    path = tmp_path / "old.db"
    shutil.copyfile(DATA / "ledger_v3.db", path)
    done = _doctor("--ledger", f"sqlite:///{path}", *NO_DISK_LIMITS, *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert f"schema version 3, older than this dataflow's {SCHEMA_VERSION}" in problem
    assert "migrates it" in problem
    assert shutil.disk_usage(path) and sqlite3.connect(path).execute(
        "SELECT version FROM dataflow_schema"
    ).fetchone() == (3,)  # the doctor migrated nothing


def test_a_ledger_newer_than_this_dataflow_is_found(tmp_path):
    url = f"sqlite:///{tmp_path}/new.db"
    Ledger.open(url).close()
    with sqlite3.connect(tmp_path / "new.db") as db:
        db.execute("UPDATE dataflow_schema SET version = 99")
    done = _doctor("--ledger", url, *NO_DISK_LIMITS, *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert "schema version 99" in problem and "upgrade dataflow" in problem


def test_no_ledger_at_the_url_is_found(tmp_path):
    done = _doctor("--ledger", f"sqlite:///{tmp_path}/nothing.db", *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert "check the URL" in problem
    assert not (tmp_path / "nothing.db").exists()  # nothing created


def test_an_unreachable_mooncake_master_is_found(sqlite_ledger):
    port = _closed_port()
    uri = f"mooncake://127.0.0.1:{port}?protocol=tcp&namespace=doctor"
    done = _doctor("--ledger", sqlite_ledger, "--store", uri, *NO_DISK_LIMITS, *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = _problems(done)
    assert f"the Mooncake master at 127.0.0.1:{port} does not answer" in problem
    assert "start the Mooncake master there" in problem


def test_a_missing_shared_directory_and_an_in_process_store_are_found(sqlite_ledger, tmp_path):
    done = _doctor(
        "--ledger", sqlite_ledger, "--store", f"dir://{tmp_path}/absent", "--store", "mem://x",
        *NO_DISK_LIMITS, *QUICK,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    first, second = _problems(done)
    assert "no shared-directory store at" in first and "mount the shared directory" in first
    assert "an in-process store" in second
    assert not (tmp_path / "absent").exists()  # the doctor lays out no store


def test_little_free_disk_is_found(sqlite_ledger, store_uri):
    done = _doctor("--ledger", sqlite_ledger, "--store", store_uri, "--min-free-percent", "100")
    assert done.returncode == 1, done.stdout + done.stderr
    problems = _problems(done)
    assert len(problems) == 2  # the ledger file's disk and the store's
    assert all("little disk left" in p and "dataflow gc" in p for p in problems)


@pytest.mark.parametrize(
    "args",
    [
        ("--stream", "tcp://*:5555"),
        ("--stream", "ipc:///tmp/x"),
        ("--stream", "tcp://127.0.0.1:0"),
        ("--store", "not-a-uri"),
        ("--max-clock-offset", "-1"),
        ("--min-free-percent", "200"),
        ("--min-free-gib", "lots"),
        ("--timeout", "0"),
    ],
)
def test_bad_arguments_exit_2(sqlite_ledger, args):
    done = _doctor("--ledger", sqlite_ledger, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dataflow doctor: error:" in done.stderr and done.stdout == ""


def test_no_ledger_named_or_a_bad_url_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "DATAFLOW_LEDGER"}
    done = _doctor(env=env)
    assert done.returncode == 2 and "--ledger URL or $DATAFLOW_LEDGER" in done.stderr
    done = _doctor("--ledger", "nosuchdb://x")
    assert done.returncode == 2, done.stderr


@pytest.mark.mooncake
def test_a_healthy_mooncake_store_exits_0(sqlite_ledger, mooncake_master):
    # The doctor's own client lends the memory its probe goes into (segment_size).
    uri = mooncake_master.store_uri(namespace="doctor") + "&segment_size=16M"
    done = _doctor("--ledger", sqlite_ledger, "--store", uri, *NO_DISK_LIMITS, "--timeout", "30")
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("ok      store") for line in done.stdout.splitlines())


# -- across simulated hosts -------------------------------------------------------------
RECEIVER = """
import sys
from dataflow.streams import ReceiverConfig, ZmqRefReceiver
with ZmqRefReceiver(ReceiverConfig(endpoint=sys.argv[1], expected_producers=1)):
    print("ready", flush=True)
    sys.stdin.read()  # until the cluster stops it
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A cluster: PostgreSQL on host pg, a rank's receiver on trainer0, doctors on producer0
    and on producer1, whose clock is 2 h ahead; the store on the directory every host sees."""
    from dataflow.testing import Cluster, cluster_unavailable

    reason = cluster_unavailable()
    if reason is not None:
        unavailable(f"no simulated cluster here: {reason}")
    workdir = tmp_path_factory.mktemp("doctor_cluster")
    hosts = ["pg", "producer0", "producer1", "trainer0"]
    with Cluster(hosts, workdir=workdir, skew={"producer1": 7200.0}) as cluster:
        server = cluster.start_postgres()
        server.create_database("doctor")
        ledger = cluster.postgres_url(server, "doctor")
        Ledger.open(ledger).close()
        store = f"dir://{workdir}/store"
        open_store(store).close()
        stream = f"tcp://{cluster['trainer0'].address}:5555"
        receiver = cluster["trainer0"].popen(
            [sys.executable, "-c", RECEIVER, stream],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert receiver.stdout.readline().strip() == "ready"
        yield SimpleNamespace(cluster=cluster, ledger=ledger, store=store, stream=stream)


def _doctor_on(deployment: SimpleNamespace, host: str, *args: str) -> Any:
    argv = [sys.executable, "-m", "dataflow.cli", "doctor", "--ledger", deployment.ledger, *args]
    return deployment.cluster[host].run(
        argv, check=False, timeout=120, capture_output=True, text=True
    )


def test_a_producer_host_checks_the_ledger_store_and_stream_by_address(deployment):
    done = _doctor_on(
        deployment, "producer0", "--store", deployment.store, "--stream", deployment.stream,
        "--json",
        *NO_DISK_LIMITS,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    assert deployment.cluster["pg"].address in checks["ledger"]["target"]
    assert abs(checks["clock"]["offset_s"]) < 1.0


def test_a_host_cut_off_silently_finds_every_link_down_in_bounded_time(deployment):
    # Frames vanish, no FIN, RST or ICMP: only the doctor's own timeouts end each check.
    cluster, stream = deployment.cluster, deployment.stream
    with cluster.partition("producer0", "pg"), cluster.partition("producer0", "trainer0"):
        done = _doctor_on(deployment, "producer0", "--stream", stream, *QUICK)
    assert done.returncode == 1, done.stdout + done.stderr
    to_ledger, to_rank = _problems(done)
    assert to_ledger.startswith("PROBLEM ledger") and "cannot be reached" in to_ledger
    assert to_rank.startswith(f"PROBLEM stream {stream}") and "no answer in 2 s" in to_rank


def test_a_host_whose_clock_is_2_hours_ahead_is_found(deployment):
    done = _doctor_on(deployment, "producer1", "--json", *NO_DISK_LIMITS)
    assert done.returncode == 1, done.stdout + done.stderr
    (problem,) = [c for c in json.loads(done.stdout)["checks"] if not c["ok"]]
    assert problem["check"] == "clock"
    assert 7200 - 60 < -problem["offset_s"] < 7200 + 60
