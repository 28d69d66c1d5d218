"""A cluster of machines on one machine: a network namespace per host, one bridge between them.

::

    with Cluster(workdir=tmp) as cluster:
        server = cluster.start_postgres()              # on host "pg", at its address
        url = cluster.postgres_url(server)
        trainer = cluster["trainer0"].popen([sys.executable, "train.py", url])
        cluster.cut("trainer0", "pg")                  # frames vanish: no FIN, RST or ICMP
        ...
        cluster.heal()

Each host is a network namespace with ``lo``, an ``eth0`` holding its own
address on ``10.213.S.0/24`` and a default route through the *gateway*: the
bridge's address in the root namespace, where the test process itself and its
:class:`Relay` s live. The hosts share the filesystem (``workdir`` is seen by
all) and the clock, unless ``skew`` moves a host's wall clock (libfaketime;
CLOCK_MONOTONIC stays true; Python's ``time.sleep`` there waits in ``select``,
since libfaketime 0.9.10 makes its ``clock_nanosleep`` fail; see :meth:`Host.command`).

Faults: :meth:`Cluster.cut` (silent: permanent neighbour entries to a MAC
nobody has, so frames vanish; loud: unreachable routes, so sends fail at
once), :meth:`Cluster.link_down` (carrier loss), :meth:`Cluster.isolate`,
:meth:`Cluster.partition`, and relays that delay, stall or reset a TCP
connection. :meth:`Cluster.stop` undoes everything and kills every process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from sqlalchemy.engine import make_url

from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError
from dataflow.testing import _netns
from dataflow.testing._cluster_services import ClusterPostgres, cluster_mooncake_master
from dataflow.testing._netns import NOWHERE_MAC, ClusterError, ip
from dataflow.testing._postgres import PostgresServer
from dataflow.testing._relay import Relay

DEFAULT_HOSTS = ("pg", "master", "producer0", "producer1", "trainer0", "trainer1")
GATEWAY = "gateway"
INTERFACE = "eth0"
_GRACE_S = 3.0


class Host:
    """One simulated machine: a network namespace with one interface, ``eth0``."""

    def __init__(self, cluster: Cluster, name: str, index: int, skew_s: float) -> None:
        self.name = name
        self.index = index
        self.netns = f"{_netns.names(cluster.slot)[0]}{index}"
        self.address = f"{_netns.subnet(cluster.slot)}.{index + 2}"
        self.interface = INTERFACE
        self.skew_s = skew_s
        self._cluster = cluster

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns {self.netns})"

    @property
    def root_interface(self) -> str:
        """The root namespace's end of this host's veth (a port of the bridge)."""
        return self.netns

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """``argv`` prefixed to run on this host (``ip netns exec``, libfaketime if skewed).

        The prefix execs in place: the process id is the command's own. ``env``:
        the environment the command will get (``os.environ`` when None), whose
        ``PYTHONPATH`` a skewed host extends.
        """
        prefix = [_netns.IP, "netns", "exec", self.netns]
        if self.skew_s:
            # libfaketime 0.9.10 cannot fake the wall clock alone for Python: with
            # CLOCK_MONOTONIC faked too, timed lock and event waits sleep for the skew;
            # without, time.sleep fails with EINVAL. So the monotonic clock stays true
            # and a sitecustomize makes time.sleep wait in select(), which works.
            site = _skew_site(self._cluster.workdir)
            inherited = (os.environ if env is None else env).get("PYTHONPATH")
            prefix += [
                _netns.ENV,
                f"LD_PRELOAD={_netns.libfaketime()}",
                f"FAKETIME={self.skew_s:+.3f}",
                "FAKETIME_DONT_FAKE_MONOTONIC=1",
                f"PYTHONPATH={os.pathsep.join(filter(None, [str(site), inherited]))}",
            ]
        return [*prefix, *map(str, argv)]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host in its own process group; :meth:`Cluster.stop` kills it.

        The cluster's ``launcher``, if it has one, starts it (on a host without skew).
        """
        launcher = self._cluster.launcher
        process = None
        if launcher is not None and not self.skew_s:
            process = launcher(
                self, list(argv), env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                start_new_session=True, **kw,
            )  # fmt: skip
        if process is None:
            process = subprocess.Popen(
                self.command(argv, env),
                env=env,
                cwd=cwd,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                **kw,
            )
        self._cluster._processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60, **kw: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this host to its end (``subprocess.run``)."""
        command = self.command(argv, kw.get("env"))
        return subprocess.run(command, check=check, timeout=timeout, **kw)

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``proc``'s whole process group (a crash of all it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


_SKEW_SITE = '''"""Written by dataflow.testing.Cluster for its skewed hosts (see Host.command).

libfaketime 0.9.10, leaving CLOCK_MONOTONIC alone, makes time.sleep fail with
EINVAL; a timeout of select() works, so time.sleep waits in select().
"""

import select
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
'''


def _skew_site(workdir: Path) -> Path:
    """The directory holding the skewed hosts' ``sitecustomize`` (written once)."""
    site = workdir / ".skewed-host-site"
    target = site / "sitecustomize.py"
    if not target.exists():
        site.mkdir(parents=True, exist_ok=True)
        temp = site / f".sitecustomize.{os.getpid()}.tmp"
        temp.write_text(_SKEW_SITE)
        os.replace(temp, target)
    return site


#: See :attr:`Cluster.launcher`.
Launcher = Callable[..., "subprocess.Popen[Any] | None"]


class Cluster:
    """Hosts in network namespaces joined by a bridge; faults between them. See the module."""

    def __init__(
        self,
        hosts: Sequence[str] = DEFAULT_HOSTS,
        *,
        workdir: str | os.PathLike[str],
        skew: Mapping[str, float] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        if launcher is not None and not callable(launcher):
            raise ArgumentTypeError(
                f"launcher must be a callable or None, got {type(launcher).__name__}"
            )
        if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
            raise ArgumentTypeError(
                f"hosts must be a non-empty list of host names, got {hosts!r}: "
                "pass e.g. ['pg', 'trainer0']"
            )
        for name in hosts:
            if not isinstance(name, str) or not name.isidentifier() or name == GATEWAY:
                raise InvalidArgumentError(
                    f"host name {name!r} must be an identifier other than {GATEWAY!r}: "
                    "pass e.g. 'trainer0'"
                )
        if len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise InvalidArgumentError(
                f"hosts must be at most 250 distinct names, got {list(hosts)!r}"
            )
        skew = dict(skew or {})
        for name, seconds in skew.items():
            if name not in hosts:
                raise InvalidArgumentError(
                    f"skew names host {name!r}, which is not one of {list(hosts)!r}"
                )
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise ArgumentTypeError(
                    f"skew[{name!r}] must be seconds (int or float), got {seconds!r}"
                )
        if any(skew.values()):
            _netns.libfaketime()  # refuse at once, naming the package
        self._names = tuple(hosts)
        self._skew = {name: float(seconds) for name, seconds in skew.items()}
        #: Starts the commands of :meth:`Host.popen` instead of ``subprocess.Popen`` (None:
        #: that does): ``launcher(host, argv, **popen_kwargs)`` returns the started
        #: process, running in ``host.netns`` in a session of its own, or None to leave
        #: ``argv`` to ``subprocess.Popen``. A test suite forks Python children from a warm
        #: interpreter in each host's namespace this way. Not used on a skewed host: its
        #: processes need libfaketime preloaded at their start.
        self.launcher = launcher
        self.workdir = Path(workdir)
        self.slot = 0
        self.hosts: dict[str, Host] = {}
        self.gateway = ""
        self._lock: IO[bytes] | None = None
        self._owner = os.getpid()
        self._processes: list[subprocess.Popen[Any]] = []
        self._services: list[Any] = []
        self._relays: list[Relay] = []
        self._cuts: dict[frozenset[str], bool] = {}

    def __repr__(self) -> str:
        state = f"slot {self.slot}" if self._lock else "stopped"
        return f"Cluster({list(self._names)!r}, {state})"

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise InvalidArgumentError(
                f"no host {name!r} in this cluster: its hosts are {list(self.hosts)!r}"
            ) from None

    # -- building and tearing down -------------------------------------------------------

    def start(self) -> Cluster:
        """Build the namespaces, the bridge, the veths and the addresses; return self."""
        if self._lock is not None:
            raise ClusterError(f"{self!r} is already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.slot, self._lock = _netns.take_slot()
        self._owner = os.getpid()
        atexit.register(self.stop)
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        _, bridge = _netns.names(self.slot)
        net = _netns.subnet(self.slot)
        self.gateway = f"{net}.1"
        # No STP and no forward delay: a port forwards the moment its link is up.
        ip("link", "add", bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        ip("addr", "add", f"{self.gateway}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for index, name in enumerate(self._names):
            host = Host(self, name, index, self._skew.get(name, 0.0))
            self.hosts[name] = host
            ns = host.netns
            ip("netns", "add", ns)
            ip("link", "add", host.root_interface, "type", "veth",
               "peer", "name", INTERFACE, "netns", ns)  # fmt: skip
            ip("link", "set", host.root_interface, "master", bridge, "up")
            ip("link", "set", "lo", "up", netns=ns)
            ip("addr", "add", f"{host.address}/24", "dev", INTERFACE, netns=ns)
            ip("link", "set", INTERFACE, "up", netns=ns)
            ip("route", "add", "default", "via", self.gateway, netns=ns)
            # No host reaches this machine's DNS servers: a lookup fails at once instead
            # of after the resolver's timeouts (gloo's reverse lookup of every peer's
            # address took 10 s a join).
            for server in _netns.nameservers():
                ip("route", "add", "unreachable", server, netns=ns, check=False)
        for host in self.hosts.values():
            _netns.wait_forwarding(host.root_interface)

    def stop(self) -> None:
        """Kill every process started here, remove namespaces, bridge and routes. Idempotent."""
        if self._lock is None or os.getpid() != self._owner:
            return  # a forked child's copy of the cluster is not its to tear down
        lock, self._lock = self._lock, None
        atexit.unregister(self.stop)
        try:
            for relay in self._relays:
                relay.close()
            for service in reversed(self._services):
                with contextlib.suppress(Exception):  # the namespaces' end kills what is left
                    getattr(service, "close", service.stop)()
            self._end_processes()
            for host in self.hosts.values():
                _netns.kill_namespace(host.netns)
            _netns.remove_slot(self.slot)
            if any(host.skew_s for host in self.hosts.values()):
                _netns.remove_dead_faketime_files()
        finally:
            self._relays.clear()
            self._services.clear()
            self._processes.clear()
            self._cuts.clear()
            lock.close()

    def _end_processes(self) -> None:
        alive = [p for p in self._processes if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for process in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
            deadline = time.monotonic() + _GRACE_S
            while alive and time.monotonic() < deadline:
                alive = [p for p in alive if p.poll() is None]
                time.sleep(0.02)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)

    # -- faults ---------------------------------------------------------------------------

    def cut(self, a: str, b: str, *, silent: bool = True) -> None:
        """Cut both directions between ``a`` and ``b`` (host names or ``"gateway"``).

        Silent: frames vanish (no FIN, RST or ICMP), as when a machine loses
        power. Loud (``silent=False``): an unreachable route on each side, so
        sends fail at once with EHOSTUNREACH.
        """
        pair = self._pair(a, b)
        if pair in self._cuts:
            self._undo(pair)
        for this, other in ((a, b), (b, a)):
            address = self._address(other)
            if silent:
                mac = NOWHERE_MAC.format(self._index(other) + 2)
                ip("neigh", "replace", address, "lladdr", mac, "nud", "permanent",
                   "dev", self._device(this), netns=self._netns_of(this))  # fmt: skip
            else:
                ip("route", "replace", "unreachable", f"{address}/32", netns=self._netns_of(this))
        self._cuts[pair] = silent

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Undo the cut between ``a`` and ``b``; with neither, every cut."""
        if a is None and b is None:
            pairs = list(self._cuts)
        elif a is None or b is None:
            raise InvalidArgumentError(
                f"heal takes two hosts or none, got a={a!r}, b={b!r}: pass both, or neither "
                "to heal every cut"
            )
        else:
            pairs = [self._pair(a, b)]
        for pair in pairs:
            if pair in self._cuts:
                self._undo(pair)

    def _undo(self, pair: frozenset[str]) -> None:
        silent = self._cuts.pop(pair)
        a, b = sorted(pair)
        for this, other in ((a, b), (b, a)):
            address = self._address(other)
            if silent:
                # Without the permanent entry ARP resolves the real address again.
                ip("neigh", "del", address, "dev", self._device(this),
                   netns=self._netns_of(this), check=False)  # fmt: skip
            else:
                ip("route", "del", "unreachable", f"{address}/32",
                   netns=self._netns_of(this), check=False)  # fmt: skip

    def isolate(self, host: str, *, silent: bool = True) -> None:
        """Cut ``host`` from every other host and from the gateway."""
        self[host]
        for other in [*self.hosts, GATEWAY]:
            if other != host:
                self.cut(host, other, silent=silent)

    @contextmanager
    def partition(self, a: str, b: str, *, silent: bool = True) -> Iterator[None]:
        """Cut ``a`` from ``b`` for the ``with`` block, then heal."""
        self.cut(a, b, silent=silent)
        try:
            yield
        finally:
            self.heal(a, b)

    def link_down(self, host: str) -> None:
        """Take ``host``'s interface down: carrier lost, its sends fail at once."""
        ip("link", "set", INTERFACE, "down", netns=self[host].netns)

    def link_up(self, host: str) -> None:
        """Bring ``host``'s interface up again, with its default route."""
        h = self[host]
        ip("link", "set", INTERFACE, "up", netns=h.netns)
        # The kernel dropped the routes through the interface when it went down.
        ip("route", "replace", "default", "via", self.gateway, netns=h.netns)
        _netns.wait_forwarding(h.root_interface)

    def relay(
        self,
        to_host: str,
        to_port: int,
        *,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int | None = None,
    ) -> Relay:
        """A TCP relay on ``gateway:<free port>`` to ``to_host``'s address:``to_port``."""
        self._require_started()
        relay = Relay(
            self.gateway,
            self[to_host].address,
            to_port,
            delay_s=delay_s,
            jitter_s=jitter_s,
            seed=seed,
        )
        self._relays.append(relay)
        return relay

    # -- services ------------------------------------------------------------------------

    def start_postgres(self, host: str = "pg", **kwargs: Any) -> PostgresServer:
        """A PostgreSQL server inside ``host``, listening on its address (and its loopback).

        Other hosts use ``server.url_at(cluster[host].address)`` (or
        :meth:`postgres_url`). ``server.stop()`` and ``server.start()`` restart
        it with the same data on the same port; :meth:`stop` removes it.
        """
        self._require_started()
        trust = [f"{_netns.subnet(self.slot)}.0/24", *kwargs.pop("trust", ())]
        server = ClusterPostgres(self[host], trust=trust, **kwargs)
        self._services.append(server)
        server.start()
        return server

    def postgres_url(self, server: PostgresServer, database: str | None = None) -> str:
        """The URL other hosts use for ``server`` (a database of it, if named)."""
        url = server.url
        if database is not None:
            url = make_url(url).set(database=database).render_as_string(hide_password=False)
        return url

    def start_mooncake_master(self, host: str = "master", **kwargs: Any) -> Any:
        """A ``stores.mooncake_master.MooncakeMaster`` inside ``host``, bound to its address."""
        self._require_started()
        master = cluster_mooncake_master(self[host], **kwargs)
        self._services.append(master)
        master.start()
        return master

    # -- names ---------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self._lock is None:
            raise ClusterError(f"{self!r} is not started: call start() or use it in a with block")

    def _pair(self, a: str, b: str) -> frozenset[str]:
        for name in (a, b):
            if name != GATEWAY:
                self[name]
        if a == b:
            raise InvalidArgumentError(f"cannot cut {a!r} from itself: name two different hosts")
        return frozenset((a, b))

    def _index(self, name: str) -> int:
        return -1 if name == GATEWAY else self.hosts[name].index

    def _address(self, name: str) -> str:
        return self.gateway if name == GATEWAY else self.hosts[name].address

    def _netns_of(self, name: str) -> str | None:
        return None if name == GATEWAY else self.hosts[name].netns

    def _device(self, name: str) -> str:
        return _netns.names(self.slot)[1] if name == GATEWAY else INTERFACE
