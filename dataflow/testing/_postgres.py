"""A throw-away PostgreSQL server for tests, and per-test databases on any server.

``PostgresServer`` runs ``initdb`` and ``pg_ctl`` from the local PostgreSQL
installation into a temporary directory, serves on a free loopback port with
trust authentication, and removes everything on exit::

    with PostgresServer() as server:
        url = server.create_database("run_a")
        ledger = Ledger.open(url)

To test against a server you already run, set ``DATAFLOW_TEST_POSTGRES_URL``
(read by :func:`postgres_url_from_env`) and use :func:`create_database` and
:func:`drop_database` with its URL.
"""

from __future__ import annotations

import glob
import ipaddress
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from dataflow.live._ports import loopback_port
from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    import pwd

ENV_URL = "DATAFLOW_TEST_POSTGRES_URL"
INSTALL_HINT = (
    "install PostgreSQL (Debian/Ubuntu: apt-get install postgresql) or set "
    f"{ENV_URL}=postgresql+psycopg://USER@HOST:PORT/DB to use a running server"
)
_TOOLS = ("initdb", "pg_ctl", "postgres")
_DATABASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# The account the server runs as when we are root (Debian's packages create it).
_SERVER_USER = "postgres"


def postgres_url_from_env() -> str | None:
    """The URL in ``DATAFLOW_TEST_POSTGRES_URL``, or None when it is unset or empty."""
    return os.environ.get(ENV_URL, "").strip() or None


def find_bin_dir() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looks where ``initdb`` on PATH points first, then in
    ``/usr/lib/postgresql/*/bin`` (newest version first); raises RuntimeError
    with an install hint when none has all three.
    """
    candidates = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates.extend(Path(d) for d in sorted(versions, key=_version_key, reverse=True))
    for directory in candidates:
        if _has_tools(directory):
            return directory
    raise RuntimeError(
        f"no PostgreSQL server binaries ({', '.join(_TOOLS)}) found on PATH or in "
        f"/usr/lib/postgresql/*/bin: {INSTALL_HINT}"
    )


def _has_tools(directory: Path) -> bool:
    return all(os.access(directory / tool, os.X_OK) for tool in _TOOLS)


def _version_key(bin_dir: str) -> tuple[int, ...]:
    version = Path(bin_dir).parent.name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _conninfo(url: str) -> str:
    """A psycopg connection string for a SQLAlchemy URL (``postgresql+psycopg://...``)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _check_database_name(name: object) -> str:
    if not isinstance(name, str) or not _DATABASE_NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"database name {name!r} must be a str of 1-63 characters from [A-Za-z0-9_], "
            "not starting with a digit: choose such a name (e.g. 'run_a')"
        )
    return name


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url``; return its URL."""
    _check_database_name(name)
    with psycopg.connect(_conninfo(server_url), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    """Drop database ``name`` (if it exists), disconnecting whoever still uses it."""
    _check_database_name(name)
    with psycopg.connect(_conninfo(server_url), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


class PostgresServer:
    """A PostgreSQL cluster in a temporary directory, serving on a free loopback port.

    ``start()`` (or entering the context) runs ``initdb`` with trust
    authentication for the ``postgres`` superuser, starts the server with
    fsync off (``durable=True``: with PostgreSQL's durable defaults, fsync,
    synchronous_commit and full_page_writes on), and waits until it accepts
    connections (``startup_timeout`` seconds). ``stop()`` (or leaving the
    context) stops it immediately and deletes the directory; a server still
    running when the interpreter exits is stopped then. Running as root, the
    server runs as the ``postgres`` system user, which must exist (PostgreSQL
    refuses to run as root).

    ``listen``: IP addresses to serve on besides 127.0.0.1 (an address of a
    network namespace's link, say; it must exist when the server starts), and
    ``trust``: networks (``10.41.0.0/24``) whose clients connect without a
    password, besides loopback. :meth:`url_at` names the server at one of them.
    """

    def __init__(
        self,
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
        durable: bool = False,
        listen: Sequence[str] = (),
        trust: Sequence[str] = (),
    ) -> None:
        if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)):
            raise ArgumentTypeError(
                f"startup_timeout must be a number of seconds (int or float), got "
                f"{startup_timeout!r} ({type(startup_timeout).__name__}): pass e.g. 60.0"
            )
        if not math.isfinite(startup_timeout) or startup_timeout <= 0:
            raise InvalidArgumentError(
                f"startup_timeout must be a finite number of seconds > 0, got "
                f"{startup_timeout!r}: pass e.g. 60.0"
            )
        self.bin_dir = find_bin_dir() if bin_dir is None else Path(bin_dir)
        if not _has_tools(self.bin_dir):
            raise RuntimeError(
                f"{self.bin_dir} lacks the PostgreSQL server binaries ({', '.join(_TOOLS)}): "
                f"{INSTALL_HINT}"
            )
        self.startup_timeout = float(startup_timeout)
        self.listen = _addresses("listen", ipaddress.ip_address, listen)
        self.trust = _addresses("trust", ipaddress.ip_network, trust)
        self.durable = bool(durable)
        self.port: int | None = None
        self.directory: Path | None = None
        self._shutdown: weakref.finalize | None = None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the server's ``postgres`` database."""
        if self.port is None:
            raise RuntimeError(f"{self!r} is not running: call start() first")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url_at(self, address: str) -> str:
        """SQLAlchemy URL of the ``postgres`` database at ``address``: 127.0.0.1 or one of
        ``listen``."""
        served = (ipaddress.ip_address("127.0.0.1"), *self.listen)
        if _checked("address", ipaddress.ip_address, address) not in served:
            raise InvalidArgumentError(
                f"{self!r} does not listen on {address!r}, only on 127.0.0.1 and "
                f"{', '.join(map(str, self.listen)) or 'nothing else'}: pass listen=[...]"
            )
        return make_url(self.url).set(host=address).render_as_string(hide_password=False)

    def create_database(self, name: str) -> str:
        """Create database ``name``; return its URL."""
        return create_database(self.url, name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists."""
        drop_database(self.url, name)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PostgresServer({f'port {self.port}' if self.port else 'stopped'})"

    def start(self) -> None:
        if self._shutdown is not None:
            raise RuntimeError(f"{self!r} is already started")
        self.directory = Path(tempfile.mkdtemp(prefix="dataflow-pg-"))
        self._shutdown = weakref.finalize(self, _shutdown, self.bin_dir, self.directory)
        try:
            if os.geteuid() == 0:
                account = _server_account()
                os.chown(self.directory, account.pw_uid, account.pw_gid)
            data = str(self.directory / "data")
            _run_tool(
                self.bin_dir,
                "initdb",
                "-D",
                data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            )
            with open(Path(data) / "pg_hba.conf", "a") as hba:
                hba.writelines(f"host all all {network} trust\n" for network in self.trust)
            self.port = self._start_on_free_port(data)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (immediate shutdown) and delete its directory; idempotent."""
        shutdown, self._shutdown, self.port = self._shutdown, None, None
        if shutdown is not None:
            shutdown()

    def _start_on_free_port(self, data: str) -> int:
        assert self.directory is not None
        log = self.directory / "server.log"
        # Another process can take the free port between the probe and the
        # server's bind; a few fresh ports make that race harmless.
        for attempt in range(3):
            port = loopback_port()
            options = self.server_options(port)
            result = _run_tool(
                self.bin_dir,
                "pg_ctl",
                "start",
                "-D",
                data,
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "-t",
                str(round(self.startup_timeout)),
                check=False,
            )
            if result.returncode == 0:
                return port
            if attempt == 2:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(
                    f"pg_ctl start failed ({result.returncode}): {result.stderr.strip()}\n{tail}"
                )
        raise AssertionError("unreachable")

    def server_options(self, port: int) -> str:
        """The server's command line (``pg_ctl -o``) on ``port``: to start it again."""
        assert self.directory is not None
        addresses = ",".join(["127.0.0.1", *map(str, self.listen)])
        options = (
            f"-p {port} -c listen_addresses='{addresses}' "
            f"-c unix_socket_directories='{self.directory}'"
        )
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        return options

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                with psycopg.connect(_conninfo(self.url), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"PostgreSQL on port {self.port} did not accept connections within "
                        f"{self.startup_timeout:g}s: {exc}"
                    ) from exc
                time.sleep(0.1)


def _addresses(name: str, parse: Any, values: Sequence[str]) -> tuple[Any, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ArgumentTypeError(
            f"{name} must be a list of str, got {type(values).__name__} {values!r}: "
            f"pass {name}=[{values!r}]"
        )
    return tuple(_checked(name, parse, value) for value in values)


def _checked(name: str, parse: Any, value: object) -> Any:
    """``parse(value)`` (an ipaddress constructor), or InvalidArgumentError naming ``value``."""
    try:
        return parse(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{name} must hold IP addresses (or networks, e.g. '10.41.0.0/24'), got {value!r}"
        ) from None


def _shutdown(bin_dir: Path, directory: Path) -> None:
    data = directory / "data"
    if (data / "postmaster.pid").exists():
        _run_tool(bin_dir, "pg_ctl", "stop", "-D", str(data), "-m", "immediate", "-w", check=False)
    shutil.rmtree(directory, ignore_errors=True)


def _run_tool(
    bin_dir: Path, tool: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool; as root, as the ``postgres`` user."""
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        account = _server_account()
        as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": [], "cwd": "/"}
    result = subprocess.run(
        [str(bin_dir / tool), *args], capture_output=True, text=True, check=False, **as_user
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{tool} failed ({result.returncode}): {(result.stderr or result.stdout).strip()}"
        )
    return result


def _server_account() -> pwd.struct_passwd:
    import pwd  # Unix only, and only needed when running as root

    try:
        return pwd.getpwnam(_SERVER_USER)
    except KeyError:
        raise RuntimeError(
            f"running as root, but there is no {_SERVER_USER!r} user to run PostgreSQL as "
            f"(PostgreSQL refuses to run as root): {INSTALL_HINT}"
        ) from None
