"""The throw-away PostgreSQL server of dataflow.testing, and PostgreSQL specifics."""

import math
import os
import re

import psycopg
import pytest
import sqlalchemy
import torch
from hypothesis import given
from hypothesis import strategies as st

from dataflow import Ledger, NotALedgerError, Producer, replay
from dataflow.recorder._postgres import connect_args
from dataflow.testing import _postgres
from dataflow.testing._postgres import (
    PostgresServer,
    create_database,
    drop_database,
    postgres_url_from_env,
)
from stores import LocalFeatureStore


def test_missing_binaries_raise_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_postgres.glob, "glob", lambda pattern: [])
    with pytest.raises(RuntimeError, match="apt-get install postgresql"):
        PostgresServer()
    with pytest.raises(RuntimeError, match=f"{re.escape(str(tmp_path))} lacks.*apt-get install"):
        PostgresServer(bin_dir=tmp_path)


def test_the_url_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("DATAFLOW_TEST_POSTGRES_URL", raising=False)
    assert postgres_url_from_env() is None
    monkeypatch.setenv("DATAFLOW_TEST_POSTGRES_URL", "  ")
    assert postgres_url_from_env() is None
    monkeypatch.setenv("DATAFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://u@db:5433/x")
    assert postgres_url_from_env() == "postgresql+psycopg://u@db:5433/x"


@pytest.mark.parametrize("name", ["", "has-dash", "1starts_with_digit", "x" * 64, 'q"uote', None])
def test_database_names_are_checked_before_connecting(name):
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:1/postgres"
    with pytest.raises(ValueError, match="database name"):
        create_database(unreachable, name)
    with pytest.raises(ValueError, match="database name"):
        drop_database(unreachable, name)


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"listen": "10.41.0.1"}, TypeError, "pass listen=\\['10.41.0.1'\\]"),
        ({"listen": ["10.41.0.300"]}, ValueError, "10.41.0.300"),
        ({"trust": ["10.41.0.1/8"]}, ValueError, "10.41.0.1/8"),
    ],
)
def test_listen_addresses_and_trusted_networks_are_checked(options, error, named):
    with pytest.raises(error, match=named):
        PostgresServer(**options)


def test_a_url_at_an_address_the_server_does_not_listen_on_is_refused():
    server = PostgresServer(listen=["10.41.0.1"])
    server.port = 5432  # as if started: url_at only formats
    assert server.url_at("10.41.0.1") == "postgresql+psycopg://postgres@10.41.0.1:5432/postgres"
    assert server.url_at("127.0.0.1") == server.url
    with pytest.raises(ValueError, match=r"does not listen on '10\.41\.0\.2'"):
        server.url_at("10.41.0.2")


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("busy_timeout", "settings"),
    [
        (
            2,
            {
                "lock_timeout": "2s",
                "statement_timeout": "4s",
                "idle_in_transaction_session_timeout": "2s",
                "tcp_keepalives_idle": "1",
                "tcp_keepalives_interval": "1",
                "tcp_user_timeout": "2000",
            },
        ),
        (
            0.05,  # the bounds on a dead peer stay at 2 s: no session ends between statements
            {
                "lock_timeout": "50ms",
                "statement_timeout": "2050ms",
                "idle_in_transaction_session_timeout": "2s",
                "tcp_user_timeout": "2000",
            },
        ),
        (
            1e7,  # ~4 months: each setting at the most it takes, not refused at connect
            {
                "lock_timeout": "2147483647ms",
                "statement_timeout": "2147483647ms",
                "tcp_keepalives_idle": "32767",
                "tcp_user_timeout": "2147483647",
            },
        ),
        (
            30,
            {
                "lock_timeout": "30s",
                "statement_timeout": "1min",
                "idle_in_transaction_session_timeout": "30s",
                "tcp_keepalives_idle": "8",
                "tcp_keepalives_interval": "8",
                "tcp_keepalives_count": "4",
                "tcp_user_timeout": "30000",
            },
        ),
    ],
)
def test_every_session_bounds_its_waits_by_the_busy_timeout(postgres_url, busy_timeout, settings):
    """The bounds docs/reliability.md ("Timeouts") documents, as the server applies them
    (the keepalives only on TCP connections, as the test server's are)."""
    with (
        Ledger.open(postgres_url, busy_timeout=busy_timeout) as ledger,
        ledger._engine.connect() as conn,
    ):
        shown = {name: conn.exec_driver_sql(f"SHOW {name}").scalar() for name in settings}
        client = conn.connection.driver_connection.info.get_parameters()
    assert shown == settings
    assert client["keepalives"] == "1"
    assert client["tcp_user_timeout"] == settings["tcp_user_timeout"]


@given(busy_timeout=st.floats(min_value=1e-6, max_value=1e12))
def test_the_session_bounds_keep_their_order_and_their_ranges(busy_timeout):
    args = connect_args(busy_timeout, synchronous_commit="on")
    session = dict(option.split("=") for option in args["options"].split(" -c ")[1:] if option)
    millis = {name: int(session[name]) for name in _MILLISECOND_SETTINGS}
    seconds = {name: int(session[name]) for name in _SECOND_SETTINGS}
    assert all(0 < value <= 2**31 - 1 for value in millis.values())
    assert all(1 <= value <= 32767 for value in seconds.values())
    dead_ms = min(math.ceil(max(busy_timeout, 2.0) * 1000), 2**31 - 1)
    assert millis["idle_in_transaction_session_timeout"] == millis["tcp_user_timeout"] == dead_ms
    assert args["tcp_user_timeout"] == dead_ms
    assert millis["lock_timeout"] <= dead_ms
    assert millis["lock_timeout"] <= millis["statement_timeout"]
    # Without tcp_user_timeout, the unanswered probes alone take at least D (or the most
    # the kernel allows).
    probes = seconds["tcp_keepalives_idle"] + 4 * seconds["tcp_keepalives_interval"]
    assert probes * 1000 >= min(dead_ms, 5 * 32767 * 1000)
    assert args["connect_timeout"] >= 2


_MILLISECOND_SETTINGS = (
    "lock_timeout",
    "statement_timeout",
    "idle_in_transaction_session_timeout",
    "tcp_user_timeout",
)
_SECOND_SETTINGS = ("tcp_keepalives_idle", "tcp_keepalives_interval")


def test_startup_timeout_must_be_positive():
    with pytest.raises(ValueError, match="got 0"):
        PostgresServer(startup_timeout=0)


@pytest.mark.postgres
def test_a_throw_away_server_starts_serves_and_leaves_nothing(postgres_server):
    if postgres_url_from_env() is not None:
        pytest.skip("the tests use the server of DATAFLOW_TEST_POSTGRES_URL; CI runs this too")
    server = PostgresServer()
    with pytest.raises(RuntimeError, match="not running"):
        server.url  # noqa: B018
    with server:
        assert re.fullmatch(r"postgresql\+psycopg://postgres@127\.0\.0\.1:\d+/postgres", server.url)
        directory = server.directory
        assert directory.is_dir()
        if os.geteuid() == 0:
            assert (directory / "data").stat().st_uid != 0
        url = server.create_database("lifecycle")
        assert url == server.url.removesuffix("/postgres") + "/lifecycle"
        with Ledger.open(url) as ledger:
            Producer(ledger, LocalFeatureStore(), run_id="r").emit("a", {"x": torch.ones(1)})
            assert ledger.runs() == ["r"]
        server.drop_database("lifecycle")
        server.drop_database("lifecycle")  # idempotent
        port = server.port
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
    assert not directory.exists()
    assert server.port is None
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2)
    server.stop()  # idempotent


@pytest.mark.postgres
def test_a_url_without_a_driver_uses_psycopg(postgres_url, store):
    plain = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with Ledger.open(plain) as ledger:
        assert ledger.backend == "postgresql"
        Producer(ledger, store, run_id="r").emit("a", {"x": torch.ones(1)})
    with Ledger.open(postgres_url) as ledger:
        assert list(replay(ledger, "r").committed) == ["a"]


def _tables(url: str) -> list[str]:
    engine = sqlalchemy.create_engine(url)
    try:
        return sorted(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_without_create_a_database_without_the_ledger_is_refused_and_left_as_it_is(
    postgres_url, store
):
    with pytest.raises(NotALedgerError, match=r"holds no dataflow ledger .*nothing was created"):
        Ledger.open(postgres_url, create=False)
    assert _tables(postgres_url) == []
    Ledger.open(postgres_url).close()  # create=True (the default) makes the ledger
    assert "dataflow_schema" in _tables(postgres_url)
    with Ledger.open(postgres_url, create=False) as ledger:
        Producer(ledger, store, run_id="r").emit("a", {"x": torch.ones(1)})
        assert ledger.runs() == ["r"]
