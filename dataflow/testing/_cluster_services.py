"""PostgreSQL and a Mooncake master on a simulated host, reached by its address.

Built by :meth:`Cluster.start_postgres` and :meth:`Cluster.start_mooncake_master`;
both servers run inside the host's network namespace, as they would on a
machine of their own, so a cut between that host and another reaches them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from dataflow.testing._netns import ClusterError, alive
from dataflow.testing._postgres import PostgresServer, _run_tool, _server_account

POSTGRES_PORT = 5432
# Mooncake's own defaults: a host of its own has them free.
_KILL_WAIT_S = 5.0
MOONCAKE_PORTS = {"rpc_port": 50051, "http_port": 8080, "metrics_port": 9003}


class _Host(Protocol):
    name: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]: ...


class ClusterPostgres(PostgresServer):
    """A :class:`PostgresServer` inside a host's namespace, on its address and ``port``.

    Unlike the plain server, :meth:`stop` keeps the data directory: a later
    :meth:`start` brings the same cluster back on the same port (a restart).
    :meth:`kill` ends it as a crash would (SIGKILL of every server process);
    :meth:`close` stops it and deletes its directory (the Cluster does this).
    """

    def __init__(
        self,
        host: _Host,
        *,
        port: int = POSTGRES_PORT,
        listen: Sequence[str] = (),
        trust: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(listen=[host.address, *listen], trust=trust, **kwargs)
        self.host = host
        self._port = port
        self._stopped = False

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database at the host's address."""
        if self.port is None:
            raise ClusterError(f"{self!r} has not started: call start() first")
        return f"postgresql+psycopg://postgres@{self.host.address}:{self.port}/postgres"

    @property
    def running(self) -> bool:
        return self.port is not None and not self._stopped

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running" if self.port else "not started"
        return f"ClusterPostgres(on {self.host.name} {self.host.address}:{self._port}, {state})"

    def start(self) -> None:
        """Start the server: the first time a fresh one, afterwards the same data again."""
        if not self._stopped:
            try:
                super().start()
            except BaseException:
                self.close()
                raise
            return
        assert self.directory is not None
        self._start_on_free_port(str(self.directory / "data"))
        self._stopped = False
        self._wait_ready()

    def stop(self) -> None:
        """Shut the server down cleanly (``pg_ctl stop -m fast``), keeping its data."""
        if self.directory is None or self._stopped:
            return
        data = self.directory / "data"
        if (data / "postmaster.pid").exists():
            _run_tool(
                self.bin_dir, "pg_ctl", "stop", "-D", str(data), "-m", "fast", "-w", check=False
            )
        self._stopped = True

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend: a crash; :meth:`start` recovers it."""
        if self.directory is None or self._stopped:
            return
        pid_file = self.directory / "data" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            postmaster = int(pid_file.read_text().split()[0])
            pids = [postmaster, *_children(postmaster)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT_S
            while any(map(alive, pids)) and time.monotonic() < deadline:
                time.sleep(0.01)
            # As after a reboot, no lock file names the dead postmaster: its pid could be a
            # zombie not yet reaped, or another process's by now.
            for lock in [pid_file, *self.directory.glob(".s.PGSQL.*.lock")]:
                lock.unlink(missing_ok=True)
        self._stopped = True

    def close(self) -> None:
        """Stop the server at once and delete its directory; idempotent."""
        self._stopped = False
        super().stop()

    def _start_on_free_port(self, data: str) -> int:
        """Start ``pg_ctl`` inside the host's namespace, as the server's account if root."""
        assert self.directory is not None
        log = self.directory / "server.log"
        argv = [str(self.bin_dir / "pg_ctl"), "start", "-D", data, "-l", str(log),
                "-o", self.server_options(self._port), "-w",
                "-t", str(round(self.startup_timeout))]  # fmt: skip
        if os.geteuid() == 0:
            # Joining the namespace needs root, the server refuses root: drop to its account
            # after `ip netns exec`.
            account = _server_account()
            argv = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}",
                    "--clear-groups", "--", *argv]  # fmt: skip
        result = subprocess.run(
            self.host.command(argv), capture_output=True, text=True, cwd="/", check=False
        )
        if result.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ClusterError(
                f"pg_ctl start on host {self.host.name!r} failed ({result.returncode}): "
                f"{result.stderr.strip()}\n{tail}"
            )
        self.port = self._port
        return self._port


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [child for child, p in parents.items() if p == parent]
        found += kids
        frontier += kids
    return found


def cluster_mooncake_master(host: _Host, **kwargs: Any) -> Any:
    """A ``stores.mooncake_master.MooncakeMaster`` whose master runs inside ``host``."""
    from stores.mooncake_master import MooncakeMaster

    class HostedMooncakeMaster(MooncakeMaster):
        def command(self) -> list[str]:
            return host.command(super().command())

    return HostedMooncakeMaster(host=host.address, **{**MOONCAKE_PORTS, **kwargs})
