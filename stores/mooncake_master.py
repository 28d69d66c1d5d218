"""Run a throw-away ``mooncake_master`` for tests, demos and benchmarks.

The master binary ships in the Mooncake wheel (``pip install
'dataflow[mooncake-cpu]'``). :class:`MooncakeMaster` starts it with its
embedded HTTP metadata server on free loopback ports, waits until both ports
answer, and stops it again::

    with MooncakeMaster(lease_ttl_ms=200) as master:
        store = stores.open_store(master.store_uri(namespace="demo"))

:meth:`MooncakeMaster.kill` ends it as a crash would (SIGKILL), and
:meth:`MooncakeMaster.start` brings a fresh one up on the same ports: a
master restarted mid-run, which has forgotten every object.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from dataflow import StoreDependencyError, StoreUnavailableError
from stores._registry import MOONCAKE_HINT

BINARY = "mooncake_master"


def find_master_binary() -> Path:
    """Path of ``mooncake_master``: $MOONCAKE_MASTER, next to sys.executable, PATH, the wheel.

    Raises FileNotFoundError with the install hint when there is none.
    """
    candidates = [
        os.environ.get("MOONCAKE_MASTER"),
        str(Path(sys.executable).parent / BINARY),
        shutil.which(BINARY),
    ]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(p) / BINARY) for p in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise StoreDependencyError(
        f"no {BINARY} executable found (looked at $MOONCAKE_MASTER, next to "
        f"{sys.executable}, on PATH and in the mooncake package); {MOONCAKE_HINT}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(host: str, count: int, *, taken: tuple[int | None, ...] = ()) -> list[int]:
    """``count`` distinct free ports, none of ``taken``: each probe socket stays bound
    until all are chosen (one at a time, the kernel may hand out the same port twice)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in taken and port not in ports:
                ports.append(port)
        return ports


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


class MooncakeMaster:
    """A ``mooncake_master`` child process with its HTTP metadata server, on loopback.

    ``lease_ttl_ms`` is the read lease of every object (``-default_kv_lease_ttl``;
    Mooncake's default is 10 s, tests want ~200 ms so that removals after reads
    go through quickly). Ports default to free ones, chosen once: after
    :meth:`stop` or :meth:`kill`, :meth:`start` starts a new master on the same
    ports. The master's log goes to :attr:`log_path`, removed at :meth:`stop`
    and :meth:`kill` unless ``keep_log``.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        lease_ttl_ms: int | None = None,
        binary: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 30.0,
        keep_log: bool = False,
    ) -> None:
        if lease_ttl_ms is not None and lease_ttl_ms <= 0:
            raise ValueError(f"lease_ttl_ms must be positive, got {lease_ttl_ms}")
        self.host = host
        given = (rpc_port or None, http_port or None, metrics_port or None)
        free = iter(free_ports(host, given.count(None), taken=given))
        self.rpc_port, self.http_port, self.metrics_port = (
            port if port is not None else next(free) for port in given
        )
        self.lease_ttl_ms = lease_ttl_ms
        self.binary = Path(binary) if binary is not None else None
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.keep_log = keep_log
        self.log_path: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def admin_address(self) -> str:
        """HOST:PORT of the master's HTTP server (``-metrics_port``), where stores list keys."""
        return f"{self.host}:{self.metrics_port}"

    def store_uri(self, *, namespace: str = "dataflow", protocol: str = "tcp") -> str:
        """A ``mooncake://`` URI that opens a store on this master.

        It carries the tuning parameter ``admin`` (this master's HTTP server,
        for ``scan``), which is not part of the store's identity: the store's
        ``uri`` is the same URI without it.
        """
        from stores._mooncake import store_uri

        uri = store_uri(self.master_address, self.metadata_url, protocol, namespace)
        return f"{uri}&admin={urllib.parse.quote(self.admin_address, safe='')}"

    def command(self) -> list[str]:
        binary = self.binary or find_master_binary()
        args = [
            str(binary),
            f"-rpc_address={self.host}",  # without it the master listens on every interface
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            "-logtostderr",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"-default_kv_lease_ttl={self.lease_ttl_ms}")
        return args + list(self.extra_args)

    def start(self) -> MooncakeMaster:
        if self._process is not None:
            raise RuntimeError("this MooncakeMaster is already started")
        command = self.command()
        fd, log = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as log_file:
            self._process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + self.startup_timeout
        ports = (self.rpc_port, self.http_port, self.metrics_port)
        while not all(port_open(self.host, port) for port in ports):
            if self._process.poll() is not None or time.monotonic() > deadline:
                code = self._process.poll()
                state = f"exited with {code}" if code is not None else "did not open its ports"
                message = (
                    f"{BINARY} {state} within {self.startup_timeout:g}s (rpc "
                    f"{self.master_address}, metadata {self.metadata_url}, admin "
                    f"{self.admin_address}); its log:\n{self.log_tail()}"
                )
                self.stop()
                raise StoreUnavailableError(message)
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the master, kill it if it does not exit within ``timeout``; idempotent."""
        self._end(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """End the master with SIGKILL, as a crash would; idempotent.

        Its objects are gone with it. :meth:`start` starts a fresh master on
        the same ports, which the clients of the old one reconnect to.
        """
        self._end(signal.SIGKILL, 5.0)

    @property
    def pid(self) -> int | None:
        """The master's process id while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.log_path is not None and not self.keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
