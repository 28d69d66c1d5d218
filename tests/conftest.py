"""Fixtures shared by the test suite: ledgers on SQLite and PostgreSQL, a store,
and the two roles writing one run.

PostgreSQL comes from ``DATAFLOW_TEST_POSTGRES_URL`` when set, else from a
throw-away server started once per session; Mooncake from a real
``mooncake_master`` started once per session. Where that is impossible the
tests skip, except under ``CI=true``, where they fail.

Under pytest-xdist (``-n N``, as ``scripts/dev.sh test`` runs the suite) each worker
starts its own servers, on free ports; ``tests/_schedule.py`` says how tests share
the workers (module fixtures on one worker, ``alone`` tests with no other running).

Temporary files (``tmp_path``, ``tempfile``, the throw-away PostgreSQL server's
directory, and those of every child process) go to ``/dev/shm`` when it is a
writable tmpfs with room (``TMPDIR`` or ``PYTEST_DEBUG_TEMPROOT``, when set, win):
the SQLite ledgers are as real there, but a commit's fsync costs nothing instead of
1-7 ms on a shared disk. No test pulls the power, so none needs that fsync.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from dataflow import (
    Consumer,
    Ledger,
    OperationalError,
    Producer,
    SampleRef,
    StoreDependencyError,
)
from dataflow.testing._postgres import (
    PostgresServer,
    create_database,
    drop_database,
    postgres_url_from_env,
)
from stores import LocalFeatureStore
from stores.mooncake_master import MooncakeMaster, find_master_binary
from tests import _schedule

_FAST_TMP = "/dev/shm"
_FAST_TMP_ROOM = 4 << 30  # bytes free, or the disk's temporary directory stays


def _temporary_files_on_tmpfs() -> None:
    """Point ``TMPDIR`` (so pytest's ``tmp_path`` too, and the children) at ``/dev/shm``
    when it has room and the user chose no directory: see the module docstring."""
    if "TMPDIR" in os.environ or "PYTEST_DEBUG_TEMPROOT" in os.environ:
        return
    try:
        fs = os.statvfs(_FAST_TMP)
    except OSError:
        return
    if fs.f_bavail * fs.f_frsize >= _FAST_TMP_ROOM and os.access(_FAST_TMP, os.W_OK | os.X_OK):
        os.environ["TMPDIR"] = _FAST_TMP
        tempfile.tempdir = None  # computed again, from TMPDIR, at the next use


_temporary_files_on_tmpfs()


def unavailable(reason: str) -> None:
    """Skip for a missing real component, but fail under CI=true, where all must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: every real component must be available)")
    pytest.skip(reason)  # only outside CI: under CI=true the line above failed


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the quick tier for development: leave out the slow tests (tests/_schedule.py "
        "says which); a real PostgreSQL, mooncake_master and processes still run",
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return _schedule.make_scheduler(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--quick"):
        kept, left_out = _schedule.quick_tier(items)
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
    _schedule.arrange(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under xdist: an ``alone`` test (setup and teardown included) runs with no other."""
    if _schedule.worker() is None:
        return (yield)
    root = item.config._tmp_path_factory.getbasetemp().parent  # shared by the workers
    with _schedule.turn(root, alone=item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/ledger.db"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of a PostgreSQL server on which tests may create databases."""
    url = postgres_url_from_env()
    if url is not None:
        yield url
        return
    try:
        server = PostgresServer()
        server.start()
    except (RuntimeError, OSError) as exc:
        unavailable(f"no PostgreSQL server for the ledger tests: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mooncake_installed() -> None:
    try:
        import mooncake.store  # noqa: F401

        find_master_binary()
    except (ImportError, StoreDependencyError) as exc:
        unavailable(f"Mooncake is not usable here: {exc}")


@pytest.fixture(scope="session")
def mooncake_master(mooncake_installed) -> Iterator[MooncakeMaster]:
    """A real mooncake_master with its HTTP metadata server, on free loopback ports."""
    with MooncakeMaster(lease_ttl_ms=200) as master:
        yield master


@pytest.fixture
def postgres_url(postgres_server) -> Iterator[str]:
    """A fresh, empty database, dropped after the test."""
    name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    url = create_database(postgres_server, name)
    yield url
    drop_database(postgres_server, name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request) -> str:
    """A fresh ledger URL on each backend."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def ledger(ledger_url) -> Iterator[Ledger]:
    led = Ledger.open(ledger_url)
    yield led
    led.close()


@pytest.fixture
def store() -> Iterator[LocalFeatureStore]:
    with LocalFeatureStore() as feature_store:
        yield feature_store


@pytest.fixture
def run_id() -> str:
    return "run"


@pytest.fixture
def producer(ledger, store, run_id) -> Producer:
    return Producer(ledger, store, run_id=run_id)


@pytest.fixture
def emit(producer) -> Callable[..., list[SampleRef | None]]:
    """``emit(*sample_ids)``: commit the ids in one transaction; their refs (None: duplicate).

    Each sample's one feature ``"x"`` holds the bytes of its id (uint8).
    """

    def emit(*sample_ids: str) -> list[SampleRef | None]:
        return producer.emit_many(
            (sid, {"x": torch.tensor(list(sid.encode()), dtype=torch.uint8)}) for sid in sample_ids
        )

    return emit


@pytest.fixture
def make_consumer(ledger, store, run_id) -> Callable[..., Consumer]:
    """``make_consumer(consumer_id="trainer", **options)``: a Consumer of the run."""

    def make(consumer_id: str = "trainer", **options: object) -> Consumer:
        return Consumer(ledger, store, run_id=run_id, consumer_id=consumer_id, **options)

    return make


@pytest.fixture
def failing_commits(ledger, monkeypatch):
    """``fail(n, landed=...)``: the next ``n`` COMMITs of ``ledger`` raise the driver's
    OperationalError, after the database committed (``landed``) or instead of committing
    (a connection lost during COMMIT, the one place where a write's outcome is unknown)."""
    dialect = ledger._engine.dialect
    real = type(dialect).do_commit
    plan = {"left": 0, "landed": True}

    def do_commit(dbapi_connection) -> None:
        if plan["left"] <= 0:
            return real(dialect, dbapi_connection)
        plan["left"] -= 1
        if plan["landed"]:
            real(dialect, dbapi_connection)
        raise dialect.dbapi.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(dialect, "do_commit", do_commit)

    def fail(times: int, *, landed: bool) -> None:
        plan["left"], plan["landed"] = times, landed

    return fail


@pytest.fixture
def unreadable(monkeypatch):
    """``unreadable(consumer, reads=2)``: its reads of the ledger after a failed COMMIT (the
    refold and the read-back: two) raise OperationalError, as on a link that just died."""

    def make(consumer, reads: int = 2) -> None:
        view = consumer._view
        real = {name: getattr(view, name) for name in ("catch_up", "refold")}
        left = {"reads": reads}

        def failing(name):
            def read(*args, **kwargs):
                if view.stale and left["reads"] > 0:
                    left["reads"] -= 1
                    raise OperationalError("the ledger is unreachable (injected)")
                return real[name](*args, **kwargs)

            return read

        for name in real:
            monkeypatch.setattr(view, name, failing(name))

    return make
