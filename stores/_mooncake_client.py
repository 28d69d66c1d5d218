"""The Mooncake client a process shares among its MooncakeFeatureStores, and what it needs.

One ``mooncake.store`` client per master, metadata server, protocol and
device (:func:`_acquire` / :func:`_release` count its users), the generation
numbers it hands out (:class:`_Generations`), and the checks of a store URI's
addresses. Its return codes and their translation into the dataflow error
tree are in :mod:`stores._mooncake_codes`, its removals that wait for read
leases in :mod:`stores._mooncake_removals`, its log in
:mod:`stores._mooncake_log`; the keys and records are ``stores._mooncake``'s.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dataflow import (
    InvalidRefError,
    StoreDependencyError,
    StoreError,
    StoreUnavailableError,
)
from stores._mooncake_codes import (
    _TRANSIENT,
    _UNAVAILABLE,
    ALREADY_EXISTS,
    NO_AVAILABLE_HANDLE,
    OK,
    TRANSFER_FAIL,
    _error,
)
from stores._mooncake_log import _log_wanted, _setup_log
from stores._mooncake_removals import _Removals
from stores._pool import Chunk, ChunkPool
from stores._registry import MOONCAKE_HINT

_CLAIM_BYTES = 8
_BLOCK = 1 << 20
#: Seconds between the checks that the master still holds a client's claim of generations.
_CLAIM_CHECK_S = 1.0
#: Seconds after a call last found the master away (or this client's memory not listed)
#: during which a write that finds no memory is tried again instead of reported full: a
#: master that just took the client back can list its segment a moment before a put
#: finds it.
_REMOUNT_GRACE_S = 2.0
log = logging.getLogger(__name__)
# The master's HTTP server is on the cluster's network: never through a proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _require_mooncake() -> ModuleType:
    try:
        import mooncake.store as mooncake_store
    except ImportError as exc:
        raise StoreDependencyError(
            f"the mooncake:// store needs mooncake.store ({exc}): {MOONCAKE_HINT}"
        ) from exc
    return mooncake_store


def _split_host_port(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidRefError(f"{what} {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def _refused(address: str, what: str, timeout: float) -> OSError | None:
    """Why a TCP connection to ``address`` fails (a master that is down refuses it); None
    when it succeeds."""
    host, port = _split_host_port(address, what)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return exc
    return None


def _answers(address: str) -> bool:
    return _refused(address, "master address", 0.2) is None


def _probe(address: str, what: str, timeout: float) -> None:
    # Mooncake's own setup retries an unreachable master for about 90 s; a
    # plain TCP connect answers in milliseconds and names the address.
    exc = _refused(address, what, timeout)
    if exc is not None:
        raise StoreUnavailableError(
            f"cannot reach the Mooncake {what} at {address}: {exc}; is mooncake_master running "
            "there (see stores.mooncake_master.MooncakeMaster)?"
        ) from exc


# -- generation numbers -------------------------------------------------------
class _Generations:
    """Generation numbers that no other client of a namespace hands out.

    A client claims a block of 2**20 numbers at a time by starting a put
    session on the block's key, which the master grants to one client only (a
    plain put of an existing key reports success and keeps the old bytes, so it
    could not tell), and then hands out the block's numbers in order with no
    round trip. Claims are kept (8 bytes each), so that no later client claims a
    block again while a generation of it may still be stored. A block starts at
    the wall clock in nanoseconds, or above the floor that a put asks for (one
    more than its sample's current generation), rounded up to a block boundary;
    so two clients that claim at once race for one key, and the loser takes
    the next block.

    A master that restarts forgets every claim, and another client could then
    claim this client's block again: so at most once a second while puts
    come, and at once after the client saw the master unreachable, a take
    checks that the master still holds the claim, and claims a fresh block if
    it does not.
    """

    def __init__(self, client: _Client, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._lock = threading.Lock()
        self._next = self._end = 0
        self._claim_key = ""
        self._checked_at = 0.0
        self._checked_troubles = 0

    def take(self, floors: list[int]) -> list[int]:
        """One fresh generation per floor, each at least its floor, in increasing order."""
        out = []
        with self._lock:
            if self._end and (
                time.monotonic() - self._checked_at >= _CLAIM_CHECK_S
                or self._client.troubles != self._checked_troubles
            ):
                self._check_claim()
            for floor in floors:
                generation = max(self._next, floor)
                if generation >= self._end:
                    generation = self._claim(max(generation, time.time_ns()))
                    self._end = generation + _BLOCK
                out.append(generation)
                self._next = generation + 1
        return out

    def _check_claim(self) -> None:
        client = self._client
        self._checked_at, self._checked_troubles = time.monotonic(), client.troubles
        if client.call(client.raw.is_exist, self._claim_key) == 0:
            log.warning(
                "the Mooncake master %s no longer holds the claim %s (it restarted): "
                "claiming a fresh block of generations",
                client.settings.master,
                self._claim_key,
            )
            self._end = 0  # the next take claims a block above self._next

    def _claim(self, at_least: int) -> int:
        client = self._client
        base = -(-at_least // _BLOCK) * _BLOCK
        for _ in range(64):
            key = f"{self._prefix}{base}"
            start = client.raw.batch_put_session_start
            (code,) = client.call(start, [key], [_CLAIM_BYTES], client.config)
            if code == ALREADY_EXISTS:
                base += _BLOCK
                continue
            what = f"claiming the generations of {key}"
            if code != OK:
                raise _error(code, what)
            # The claim is never read for its bytes: the session ends without a transfer.
            (code,) = client.call(client.raw.batch_put_session_end, [key])
            if code != OK:
                client.raw.batch_put_session_revoke([key])
                raise _error(code, what)
            self._claim_key = key
            self._checked_at, self._checked_troubles = time.monotonic(), client.troubles
            return base
        raise StoreError(f"could not claim a free block of generations under {self._prefix}")


# -- removals that wait for read leases --------------------------------------
# -- one Mooncake client per process and cluster -----------------------------
@dataclass(frozen=True)
class _Settings:
    master: str
    metadata: str
    protocol: str
    device: str
    local_hostname: str
    segment_size: int
    buffer_size: int
    connect_timeout: float
    max_idle_bytes: int
    admin: str  # HOST:PORT of the master's HTTP server

    @property
    def key(self) -> tuple[str, ...]:
        return (self.master, self.metadata, self.protocol, self.device, self.local_hostname)


class _Client:
    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        quiet = not _log_wanted()
        mooncake_store = _require_mooncake()
        _probe(settings.master, "master", settings.connect_timeout)
        parsed = urllib.parse.urlsplit(settings.metadata)
        if parsed.scheme in ("http", "https") and parsed.port:
            _probe(f"{parsed.hostname}:{parsed.port}", "metadata server", settings.connect_timeout)
        self.raw = mooncake_store.MooncakeDistributedStore()
        with _setup_log(quiet) as mooncake_log:
            code = self.raw.setup(
                settings.local_hostname,
                settings.metadata,
                settings.segment_size,
                settings.buffer_size,
                settings.protocol,
                settings.device,
                settings.master,
            )
        if code != OK:
            said = b"\n".join(mooncake_log[-10:]).decode(errors="replace")
            raise StoreUnavailableError(
                f"Mooncake setup against master {settings.master} (metadata "
                f"{settings.metadata}, protocol {settings.protocol}) failed with code {code}"
                + (f"; Mooncake's log:\n{said}" if said else "")
            )
        self.config = mooncake_store.ReplicateConfig()
        self.config.replica_num = 1
        self.config.with_hard_pin = True  # never evicted: a ref must stay readable until deleted
        self.pool = ChunkPool(
            settings.max_idle_bytes, register=self._register, unregister=self._unregister
        )
        self.removals = _Removals(self.raw, self.reachable)
        # Puts and deletes of one sample id in this process take turns, so that
        # threads never race on its head; other processes still can (see _put_batch).
        self._id_locks = [threading.Lock() for _ in range(64)]
        self._generations: dict[str, _Generations] = {}
        self._generations_lock = threading.Lock()
        self.users = 0
        #: Calls that found the master unreachable or without this client's memory (see call).
        self.troubles = 0
        self._unreachable = False
        #: When a call last found the master away or this client's memory not listed.
        self._troubled_at = -float("inf")

    def call(self, op: Callable[..., Any], *args: Any) -> Any:
        """``op(*args)`` on the Mooncake client, again for up to ``connect_timeout`` while it
        cannot be served yet; what it returned last.

        That is while the master is unreachable, and while it does not list this
        client's memory (see :meth:`mounted`). A master that restarts forgets
        every object and every client; the Mooncake client reconnects on its own
        and is taken back at its next heartbeat (about a second), when its
        segment is mounted again: until then a write finds no memory
        (NO_AVAILABLE_HANDLE), and a read of anything put before the restart
        finds nothing (a stale ref, which is the truth); for ``_REMOUNT_GRACE_S``
        after a call last found it so, a write that finds no memory is tried again
        even once the segment is listed (the listing can come a moment before a put
        finds the memory), and only then is the store full. While the master seems
        down, its port is probed before each try: a Mooncake call to a master
        that is down takes seconds to fail. At the deadline it raises
        StoreUnavailableError naming the master (StoreFullError for a write that
        still finds no memory while the master's HTTP server does not answer).
        """
        got = None if self._unreachable else op(*args)
        if got is not None and self._settled(got):
            return got
        master, timeout = self.settings.master, self.settings.connect_timeout
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            self.troubles += 1
            if time.monotonic() >= deadline:
                if got is None:
                    raise StoreUnavailableError(
                        f"the Mooncake master at {master} refused connections for {timeout:g}s "
                        "(connect_timeout); is mooncake_master running there?"
                    )
                codes = got if isinstance(got, list) else (got,)
                code = next(code for code in codes if code in _TRANSIENT)
                if code == TRANSFER_FAIL and _answers(master):
                    raise StoreUnavailableError(
                        f"the Mooncake master at {master} answers, but moving the bytes failed "
                        f"for {timeout:g}s (TRANSFER_FAIL, {code}): the process whose memory "
                        "holds them may have died; once the master drops it (after its "
                        "client_ttl) a read of what it held raises StaleRefError"
                    )
                what = f"no answer from the Mooncake master at {master} in {timeout:g}s"
                mounted = self.mounted() if code == NO_AVAILABLE_HANDLE else True
                raise _error(code, what, mounted=mounted)
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
            if _answers(master):
                got = op(*args)
                if self._settled(got):
                    return got
            else:
                self._unreachable, self._troubled_at = True, time.monotonic()

    def reachable(self) -> bool:
        """Whether the master answers, as far as the last call tells (probed while it did not)."""
        return not self._unreachable or _answers(self.settings.master)

    def _settled(self, got: Any) -> bool:
        """Whether what a call returned is its answer, not the master being away or not
        listing this client's memory (yet)."""
        codes = got if isinstance(got, list) else (got,)
        if _TRANSIENT.isdisjoint(codes):
            self._unreachable = False
            return True
        self._unreachable = not _UNAVAILABLE.isdisjoint(codes)
        now = time.monotonic()
        if self._unreachable or self.mounted() is not True:
            self._troubled_at = now
            return False
        # Listed, and still no memory: a full store, unless the master took this client
        # back only just now (its segment listed before a put finds it: try again a little).
        return now - self._troubled_at >= _REMOUNT_GRACE_S

    def mounted(self) -> bool | None:
        """Whether the master lists this client's segment (or, for a client that mounts
        none, any segment), as its HTTP server (``admin``) says; None if that does not
        answer. What tells a full store from a master that restarted and has not
        taken this client back: both answer a write with NO_AVAILABLE_HANDLE, and the
        client's own health_check() can report healthy before its segment is back."""
        url = f"http://{self.settings.admin}/get_all_segments"
        try:
            with _OPENER.open(url, timeout=0.5) as response:
                segments = response.read().decode(errors="replace").split()
        except OSError:  # URLError and HTTPError are OSErrors
            return None
        if self.settings.segment_size:
            return self.raw.get_hostname() in segments
        return bool(segments)

    def _register(self, chunk: Chunk) -> None:
        code = self.raw.register_buffer(chunk.ptr, chunk.size)
        if code != OK:
            raise _error(code, f"registering {chunk.size} bytes of memory")

    def _unregister(self, chunk: Chunk) -> None:
        self.raw.unregister_buffer(chunk.ptr)

    def generations(self, namespace: str) -> _Generations:
        with self._generations_lock:
            found = self._generations.get(namespace)
            if found is None:
                prefix = f"{namespace}/@generations/"
                found = self._generations[namespace] = _Generations(self, prefix)
            return found

    def id_locks(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[Any]:
        """Hold the locks of ``keys`` (taken in one order, so batches cannot deadlock)."""
        indices = sorted({hash(key) % len(self._id_locks) for key in keys})
        if len(indices) == 1:  # a put of one sample: its lock, without an ExitStack
            return self._id_locks[indices[0]]
        return self._hold(indices)

    @contextlib.contextmanager
    def _hold(self, indices: list[int]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for index in indices:
                stack.enter_context(self._id_locks[index])
            yield

    def close(self, drain_timeout: float) -> list[str]:
        left = self.removals.drain("", drain_timeout)
        self.removals.stop()
        if self.settings.segment_size:
            # What this client lent goes with it: the caller must see it gone.
            self._teardown()
        else:
            # Mooncake's own teardown of a client takes about a second (its threads wind
            # down), and a client that lends nothing holds nothing anyone waits for. A
            # thread that is no daemon finishes it; the interpreter waits for it at exit.
            threading.Thread(target=self._teardown, name="mooncake-teardown").start()
        return left

    def _teardown(self) -> None:
        self.pool.close()  # the registered buffers, while the client still knows them
        self.raw.close()


_clients: dict[tuple[str, ...], _Client] = {}
_clients_lock = threading.Lock()


def _acquire(settings: _Settings) -> _Client:
    with _clients_lock:
        client = _clients.get(settings.key)
        if client is None:
            client = _clients[settings.key] = _Client(settings)
        client.users += 1
        return client


def _release(settings: _Settings, drain_timeout: float) -> list[str]:
    with _clients_lock:
        client = _clients[settings.key]
        client.users -= 1
        if client.users:
            return []
        del _clients[settings.key]
    return client.close(drain_timeout)
