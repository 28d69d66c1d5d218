"""``dataflow doctor``: is this host ready for a run? Each part of a deployment, checked.

From any host of a deployment: the ledger reachable and its schema version, the
clock offset to the database server (whose clock stamps every event on
PostgreSQL), a store reachable and writable (a probe object put, read back and
removed), a stream endpoint that accepts a connection, and the free disk where
files go. Every check is bounded in time, so a stopped or unreachable server is
a finding, never a hang; each finding that is a problem says what to do.

The store is opened by a function the caller gives (the CLI passes
``stores.open_store``): the core does not import the stores built on it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dataflow.interfaces._store import FeatureStore
from dataflow.model._errors import ArgumentTypeError, DataflowError, InvalidArgumentError
from dataflow.recorder._ledger import Ledger
from dataflow.recorder._schema import SCHEMA_VERSION

#: Round trips to the database server for the clock offset (the shortest one is kept).
_CLOCK_SAMPLES = 5
#: The sample ids of the store probes start with it: no producer's id does (dataflow's
#: own ids never start with a dot), and ``dataflow gc`` removes a probe a killed doctor left.
PROBE_PREFIX = ".dataflow-doctor/"
_GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class DoctorLimits:
    """When a finding is a problem, and how long a check may take."""

    max_clock_offset_s: float = 1.0
    """A clock further than this from the database server's is a problem."""
    min_free_bytes: int = _GIB
    """Less free disk than this where files go is a problem (0: no such check)."""
    min_free_fraction: float = 0.05
    """Less than this fraction of the disk free where files go is a problem (0: none)."""
    timeout_s: float = 5.0
    """How long one check may take (a connect, a round trip, a store probe)."""

    def __post_init__(self) -> None:
        for name in ("max_clock_offset_s", "timeout_s", "min_free_fraction", "min_free_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.timeout_s == 0:
            raise InvalidArgumentError("timeout_s must be > 0 seconds, got 0")
        if self.min_free_fraction > 1:
            raise InvalidArgumentError(
                f"min_free_fraction is a fraction of the disk, from 0 to 1, got "
                f"{self.min_free_fraction!r}"
            )


@dataclass(frozen=True)
class Finding:
    """One check: what was checked, whether it is fine, what was seen, and what to do."""

    check: str
    """``ledger``, ``clock``, ``disk``, ``store`` or ``stream``."""
    target: str
    """What was checked: a URL (no password), a URI, an endpoint, a path."""
    ok: bool
    detail: str
    fix: str | None = None
    """What to do, for a problem."""
    values: dict[str, Any] = field(default_factory=dict)
    """Measured values (``schema_version``, ``offset_s``, ``free_bytes`` ...), for --json."""

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "target": self.target,
            "ok": self.ok,
            "detail": self.detail,
            "fix": self.fix,
            **self.values,
        }


@dataclass(frozen=True)
class DoctorReport:
    """Every finding of one ``doctor`` call, in the order checked."""

    findings: list[Finding]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": len(self.problems),
            "checks": [f.to_json() for f in self.findings],
        }


class _TimedOut(Exception):
    pass


def _bounded(seconds: float, work: Callable[[], Any]) -> Any:
    """``work()``, or _TimedOut after ``seconds``: a driver or file system that hangs
    (a hard NFS mount, a silent link) is left in a daemon thread, not waited for."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name="dataflow-doctor-check", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _TimedOut(f"no answer in {seconds:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


# -- the ledger, its clock, its disk ---------------------------------------------------
def check_ledger(url: str, limits: DoctorLimits) -> list[Finding]:
    """The ledger at ``url``: reachable, its schema version, its clock, its disk."""
    target = _safe_url(url)
    # The connect is bounded twice: by libpq's connect_timeout (about timeout_s, at
    # least 2 s) and by the thread; busy_timeout sets the server-side timeouts too.
    wait = limits.timeout_s + 2.0
    try:
        ledger = _bounded(
            wait,
            lambda: Ledger.open(url, create=False, read_only=True, busy_timeout=limits.timeout_s),
        )
    except _TimedOut as exc:
        return [_unreachable(target, f"it did not answer: {exc}")]
    except DataflowError as exc:
        return [_ledger_refused(target, exc)]
    try:
        findings = [_schema_finding(target, ledger)]
        findings.append(_clock_finding(target, ledger, limits))
        database = _sqlite_path(url)
        if database is not None:
            findings.append(check_disk(os.path.dirname(database) or ".", limits, "ledger file"))
        return findings
    finally:
        ledger.close()


def _safe_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def _sqlite_path(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return os.path.abspath(parsed.database)


def _unreachable(target: str, why: str) -> Finding:
    return Finding(
        "ledger",
        target,
        False,
        f"the ledger cannot be reached: {why}",
        "check that the database server runs and that this host reaches it (the host, "
        "the port, a firewall), then run doctor again",
    )


def _ledger_refused(target: str, exc: DataflowError) -> Finding:
    from dataflow.model._errors import NotALedgerError, SchemaVersionError

    if isinstance(exc, SchemaVersionError):
        return Finding(
            "ledger",
            target,
            False,
            _short(exc),
            f"upgrade dataflow on this host: it reads schema version {SCHEMA_VERSION}",
        )
    if isinstance(exc, NotALedgerError):
        return Finding(
            "ledger",
            target,
            False,
            _short(exc),
            "check the URL; a new ledger is made by the first producer or trainer that "
            "opens it (Ledger.open(url))",
        )
    return _unreachable(target, _short(exc))


def _schema_finding(target: str, ledger: Ledger) -> Finding:
    version = ledger.schema_version
    values = {"backend": ledger.backend, "schema_version": version}
    if version < SCHEMA_VERSION:
        return Finding(
            "ledger",
            target,
            False,
            f"schema version {version}, older than this dataflow's {SCHEMA_VERSION}: "
            "it needs a migration",
            "stop every process of an older dataflow that uses it, then open it once with "
            "a writer of this one (Ledger.open(url), e.g. the first producer), which "
            "migrates it in one transaction",
            values,
        )
    return Finding(
        "ledger",
        target,
        True,
        f"{ledger.backend}, schema version {version} (current)",
        None,
        values,
    )


def measure_clock_offset(ledger: Ledger, samples: int = _CLOCK_SAMPLES) -> tuple[float, float]:
    """(offset, round trip) in seconds: the ledger's clock minus this host's, from the
    round trip with the least delay, the server's reading taken as at its middle (so
    off by at most half that round trip). 0 for SQLite, whose clock is this host's."""
    ledger.clock()  # the first read also connects
    best: tuple[float, float] | None = None
    for _ in range(samples):
        before = time.time()
        started = time.perf_counter()
        server = ledger.clock()
        rtt = time.perf_counter() - started
        offset = server - (before + rtt / 2)
        if best is None or rtt < best[1]:
            best = (offset, rtt)
    assert best is not None
    return best


def _clock_finding(target: str, ledger: Ledger, limits: DoctorLimits) -> Finding:
    if ledger.backend == "sqlite":
        return Finding(
            "clock",
            target,
            True,
            "SQLite: events carry this host's clock (offset 0); a SQLite ledger serves one machine",
            None,
            {"offset_s": 0.0, "round_trip_s": 0.0},
        )
    try:
        offset, rtt = _bounded(limits.timeout_s + 2.0, lambda: measure_clock_offset(ledger))
    except (_TimedOut, DataflowError) as exc:
        return Finding(
            "clock",
            target,
            False,
            f"the database server's clock could not be read: {_short(exc)}",
            "check the link to the database server",
        )
    values = {"offset_s": round(offset, 3), "round_trip_s": round(rtt, 4)}
    side = "behind" if offset > 0 else "ahead of"
    said = f"this host's clock is {abs(offset):.3f} s {side} the database server's"
    if abs(offset) > limits.max_clock_offset_s:
        return Finding(
            "clock",
            target,
            False,
            f"{said} (more than {limits.max_clock_offset_s:g} s)",
            "synchronize this host's clock (NTP: chrony or systemd-timesyncd; "
            "`chronyc tracking` or `timedatectl` shows it); events carry the server's "
            "time, but store object times, gc's grace and checkpoint files carry this host's",
            values,
        )
    return Finding("clock", target, True, f"{said} (round trip {rtt * 1000:.1f} ms)", None, values)


# -- disk ----------------------------------------------------------------------------
def check_disk(path: str, limits: DoctorLimits, what: str) -> Finding:
    """Free disk at ``path`` (the ``what`` of a deployment: a ledger file, a store)."""
    try:
        usage = _bounded(limits.timeout_s, lambda: shutil.disk_usage(path))
    except (_TimedOut, OSError) as exc:
        return Finding(
            "disk",
            path,
            False,
            f"cannot read the free disk of the {what}: {_short(exc)}",
            "check that the path exists and its file system answers",
        )
    fraction = usage.free / usage.total if usage.total else 0.0
    values = {"free_bytes": usage.free, "total_bytes": usage.total, "free_fraction": fraction}
    said = f"{usage.free / _GIB:.1f} GiB free of {usage.total / _GIB:.1f} GiB ({fraction:.0%})"
    low = usage.free < limits.min_free_bytes or fraction < limits.min_free_fraction
    if low:
        return Finding(
            "disk",
            path,
            False,
            f"the {what} has little disk left: {said} (the limits: "
            f"{limits.min_free_bytes / _GIB:g} GiB and {limits.min_free_fraction:.0%})",
            "free disk there (`dataflow gc` removes features no ledger keeps), or grow it",
            values,
        )
    return Finding("disk", path, True, f"{what}: {said}", None, values)


# -- stores ----------------------------------------------------------------------------
def check_store(
    uri: str, open_store: Callable[[str], FeatureStore], limits: DoctorLimits
) -> list[Finding]:
    """The store at ``uri``: its server reachable (Mooncake's master), a probe object put,
    read back and removed, and the free disk of a shared directory."""
    scheme = uri.split("://", 1)[0]
    if scheme == "mem":
        return [
            Finding(
                "store",
                uri,
                False,
                "an in-process store: no other process or host sees it",
                "name a shared-directory (dir:///PATH) or Mooncake (mooncake://...) store",
            )
        ]
    findings: list[Finding] = []
    root = _dir_root(uri)
    if root is not None:
        if not os.path.isdir(os.path.join(root, "samples")):
            return [
                Finding(
                    "store",
                    uri,
                    False,
                    f"no shared-directory store at {root} (no {root}/samples): this host does "
                    "not see it",
                    "mount the shared directory at the same path on every host, or create "
                    "the store there from one host first (its first producer does)",
                )
            ]
    elif scheme == "mooncake":
        unreachable = _mooncake_servers(uri, limits)
        if unreachable:
            return unreachable
    findings.append(_probe(uri, open_store, limits))
    if root is not None:
        findings.append(check_disk(root, limits, "shared-directory store"))
    return findings


def _dir_root(uri: str) -> str | None:
    parts = urlsplit(uri)
    if parts.scheme != "dir" or parts.netloc:
        return None
    return unquote(parts.path)


def _mooncake_servers(uri: str, limits: DoctorLimits) -> list[Finding]:
    """A finding per Mooncake server that refuses a TCP connect (the master's RPC port,
    its HTTP metadata server); none when both answer."""
    parts = urlsplit(uri)
    servers = [("master", parts.hostname, parts.port)]
    metadata = parse_qs(parts.query).get("metadata", [None])[0]
    if metadata and metadata.startswith(("http://", "https://")):
        meta = urlsplit(metadata)
        servers.append(("metadata server", meta.hostname, meta.port or 80))
    problems = []
    for role, host, port in servers:
        if host is None or port is None:
            continue  # the store itself says what is wrong with its URI
        error = _tcp_connect(host, port, limits.timeout_s)
        if error is not None:
            problems.append(
                Finding(
                    "store",
                    uri,
                    False,
                    f"the Mooncake {role} at {host}:{port} does not answer: {error}",
                    f"start the Mooncake {role} there, or check the address and that this "
                    "host reaches it (a firewall, the master's -rpc_address)",
                    {"server": f"{host}:{port}"},
                )
            )
    return problems


def probe_sample_id() -> str:
    """A sample id no run uses: the prefix, this host's name (escaped to the characters of
    a sample id) and a random part."""
    host = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:64] or "host"
    return f"{PROBE_PREFIX}{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _probe(uri: str, open_store: Callable[[str], FeatureStore], limits: DoctorLimits) -> Finding:
    import torch  # before the clock starts: the import is no part of the store's answer

    def work() -> float:
        started = time.perf_counter()
        store = open_store(uri)
        try:
            sent = torch.arange(16, dtype=torch.int64)
            ref = store.put(probe_sample_id(), {"probe": sent})
            try:
                back = store.get(ref)["probe"]
                if not torch.equal(back, sent):
                    raise DataflowError(f"the probe read back differs from what was put: {back}")
            finally:
                # Not checked with exists(): Mooncake frees an object once the read
                # lease of the get above ends, so it may still be there for a moment.
                store.delete(ref)
        finally:
            store.close()
        return time.perf_counter() - started

    try:
        took = _bounded(limits.timeout_s, work)
    except _TimedOut as exc:
        return Finding(
            "store",
            uri,
            False,
            f"the probe (put, read back, remove) took too long: {exc}",
            "check that the store's server or file system answers from this host",
        )
    except Exception as exc:  # whatever a plugin store raises is a finding
        return Finding(
            "store",
            uri,
            False,
            f"a probe object could not be put, read back and removed: {_short(exc)}",
            "make the store writable from this host (a read-only mount, permissions, a "
            "full disk, the store's server), then run doctor again",
        )
    return Finding(
        "store",
        uri,
        True,
        f"a probe put, read back and removed in {took * 1000:.0f} ms",
        None,
        {"probe_s": round(took, 4)},
    )


# -- streams ---------------------------------------------------------------------------
def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint that a sender connects to;
    InvalidArgumentError for anything else (a wildcard, port 0, another transport)."""
    if not isinstance(endpoint, str):
        raise ArgumentTypeError(f"an endpoint must be a str, got {type(endpoint).__name__}")
    if not endpoint.startswith("tcp://"):
        raise InvalidArgumentError(
            f"stream endpoint {endpoint!r}: doctor checks tcp://HOST:PORT endpoints, the "
            "address a producer connects to (e.g. tcp://10.0.0.5:5555)"
        )
    host, _, port_text = endpoint[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not host or host in ("*", "0.0.0.0", "::") or not port_text.isdigit():
        raise InvalidArgumentError(
            f"stream endpoint {endpoint!r}: name the host and port a producer connects to "
            "(tcp://HOST:PORT), not the wildcard a receiver binds"
        )
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"stream endpoint {endpoint!r}: port must be 1 to 65535")
    return host, port


def _tcp_connect(host: str, port: int, timeout_s: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``; else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer in {timeout_s:g} s (a firewall, or a link that drops packets)"
    except OSError as exc:
        return exc.strerror or _short(exc)
    return None


def check_stream(endpoint: str, limits: DoctorLimits) -> Finding:
    """A TCP connect to a stream endpoint (no ZeroMQ handshake: a CURVE endpoint is
    checked the same way, its keys are not)."""
    host, port = parse_endpoint(endpoint)
    error = _tcp_connect(host, port, limits.timeout_s)
    if error is not None:
        return Finding(
            "stream",
            endpoint,
            False,
            f"nothing accepts a connection at {host}:{port}: {error}",
            "start the rank whose receiver binds it (ReceiverConfig(endpoint=...)), check "
            "that it binds an address this host reaches (not 127.0.0.1 across hosts) and "
            "that no firewall drops the port",
        )
    return Finding("stream", endpoint, True, f"{host}:{port} accepts a connection")


# -- all of it -------------------------------------------------------------------------
def doctor(
    ledger_url: str,
    *,
    stores: Iterable[str] = (),
    streams: Iterable[str] = (),
    open_store: Callable[[str], FeatureStore] | None = None,
    limits: DoctorLimits | None = None,
) -> DoctorReport:
    """Check a deployment from this host: the ledger (reachable, schema, clock, disk), each
    store in ``stores`` (opened with ``open_store``), each stream endpoint in ``streams``.

    Every check is bounded by ``limits.timeout_s`` (a few seconds more for the ledger's
    connect); bad arguments (an endpoint that is not ``tcp://HOST:PORT``) raise
    InvalidArgumentError before anything is checked.
    """
    limits = DoctorLimits() if limits is None else limits
    stores, streams = list(stores), list(streams)
    for endpoint in streams:
        parse_endpoint(endpoint)
    if stores and open_store is None:
        raise InvalidArgumentError("checking a store needs open_store (e.g. stores.open_store)")
    findings = check_ledger(ledger_url, limits)
    for uri in stores:
        assert open_store is not None
        findings.extend(check_store(uri, open_store, limits))
    findings.extend(check_stream(endpoint, limits) for endpoint in streams)
    return DoctorReport(findings)
