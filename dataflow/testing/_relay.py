"""A TCP relay that delays, stalls or resets the connections through it, for fault tests.

One thread runs a ``selectors`` loop. Every chunk read from one side waits
in its direction's queue until ``arrival + delay (+/- jitter)``, never before
the chunk ahead of it (order is kept), and is then written to the other side.
A stalled direction keeps reading, so the peer's kernel still ACKs what it
sent, and holds the bytes until :meth:`Relay.resume`. :meth:`Relay.reset`
closes every connection with RST on both sides.
"""

from __future__ import annotations

import contextlib
import errno
import math
import queue
import random
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError
from dataflow.testing._netns import ClusterError

DIRECTIONS = ("to_server", "to_client")
_CHUNK = 65536
_HELD_MAX = 8 << 20  # a direction holding this much stops reading its source
_TICK_S = 0.1
_CALL_TIMEOUT_S = 10.0


class _Pipe:
    """One direction of a connection: bytes read from ``src``, due for ``dst``."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.queue: deque[tuple[float, bytes | None]] = deque()  # None: the source's EOF
        self.out = bytearray()
        self.held = 0
        self.read_eof = False
        self.eof_due = False
        self.done = False  # EOF passed on with shutdown(SHUT_WR)


class _Connection:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.connected = False
        self.pipes = {"to_server": _Pipe(client, server), "to_client": _Pipe(server, client)}


class Relay:
    """A TCP relay on ``host:port`` (the gateway) to ``to_address:to_port``.

    Components connect to :attr:`address` instead of the server's. Built by
    :meth:`Cluster.relay`; it runs until :meth:`close` (or the cluster's stop).
    """

    def __init__(
        self,
        listen_address: str,
        to_address: str,
        to_port: int,
        *,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if isinstance(to_port, bool) or not isinstance(to_port, int) or not 0 < to_port < 65536:
            raise InvalidArgumentError(f"to_port must be a TCP port 1..65535, got {to_port!r}")
        self._check_delay(delay_s, jitter_s)
        self.to_address, self.to_port = to_address, to_port
        self.delay_s, self.jitter_s = float(delay_s), float(jitter_s)
        self.connections = 0
        self._random = random.Random(seed)
        self._stalled = dict.fromkeys(DIRECTIONS, False)
        self._live: list[_Connection] = []
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._listener = socket.create_server((listen_address, 0))
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"relay-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``"gateway:port"``: where clients connect."""
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"Relay({self.address} -> {self.to_address}:{self.to_port})"

    def set_delay(self, delay_s: float, jitter_s: float = 0.0) -> None:
        """One-way delay of each chunk from now on, uniformly jittered by +/- ``jitter_s``."""
        self._check_delay(delay_s, jitter_s)

        def apply() -> None:
            self.delay_s, self.jitter_s = float(delay_s), float(jitter_s)

        self._call(apply)

    def stall(self, direction: str = "both") -> None:
        """Stop forwarding ``direction`` ("both", "to_server", "to_client"); bytes are held."""
        directions = self._directions(direction)

        def apply() -> None:
            for name in directions:
                self._stalled[name] = True

        self._call(apply)

    def resume(self) -> None:
        """Forward every direction again, the held bytes first."""

        def apply() -> None:
            self._stalled = dict.fromkeys(DIRECTIONS, False)

        self._call(apply)

    def reset(self) -> None:
        """Close every open connection with RST (SO_LINGER 0) on both sides."""

        def apply() -> None:
            for connection in list(self._live):
                self._drop(connection, rst=True)

        self._call(apply)

    def close(self) -> None:
        """Stop the relay: close every connection (RST) and the listening socket. Idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(ClusterError):
                self._call(self._shut)
            self._thread.join(_CALL_TIMEOUT_S)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    # -- inside the relay's thread ----------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the relay's thread and wait until it has run."""
        if not self._thread.is_alive():
            raise ClusterError(f"{self!r} is closed")
        done = threading.Event()
        self._calls.put((fn, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if not done.wait(_CALL_TIMEOUT_S):
            raise ClusterError(f"{self!r} did not answer within {_CALL_TIMEOUT_S:g}s")

    def _shut(self) -> None:
        for connection in list(self._live):
            self._drop(connection, rst=True)
        self._closing = True

    def _loop(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._closing:
                self._pump()
                for key, events in self._selector.select(self._timeout()):
                    self._ready(key, events)
        finally:
            self._selector.close()
            while not self._calls.empty():  # nobody waits forever on a closed relay
                self._calls.get()[1].set()

    def _timeout(self) -> float:
        now = time.monotonic()
        dues = [
            pipe.queue[0][0]
            for connection in self._live
            for name, pipe in connection.pipes.items()
            if pipe.queue and not self._stalled[name]
        ]
        return max(0.0, min([now + _TICK_S, *dues]) - now)

    def _ready(self, key: selectors.SelectorKey, events: int) -> None:
        if key.data == "accept":
            self._accept()
        elif key.data == "wake":
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)
            while not self._calls.empty():
                fn, done = self._calls.get()
                try:
                    fn()
                finally:
                    done.set()
        else:
            connection, sock = key.data
            if connection not in self._live:
                return
            try:
                if events & selectors.EVENT_WRITE and sock is connection.server:
                    self._connected(connection)
                if events & selectors.EVENT_READ:
                    self._read(connection, sock)
            except OSError:
                self._drop(connection, rst=True)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            client, _ = self._listener.accept()
            client.setblocking(False)
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setblocking(False)
            connection = _Connection(client, server)
            self.connections += 1
            self._live.append(connection)
            code = server.connect_ex((self.to_address, self.to_port))
            if code not in (0, errno.EINPROGRESS):
                self._drop(connection, rst=True)
                return
            connection.connected = code == 0
            for sock in (client, server):
                self._selector.register(sock, selectors.EVENT_READ, (connection, sock))

    def _connected(self, connection: _Connection) -> None:
        if not connection.connected:
            code = connection.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, f"relay could not connect to {self.to_address}")
            connection.connected = True

    def _read(self, connection: _Connection, sock: socket.socket) -> None:
        name = "to_server" if sock is connection.client else "to_client"
        pipe = connection.pipes[name]
        with contextlib.suppress(BlockingIOError):
            data = sock.recv(_CHUNK)
            now = time.monotonic()
            jitter = self._random.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
            due = max(now, now + self.delay_s + jitter)
            if pipe.queue:
                due = max(due, pipe.queue[-1][0])  # never reorder
            pipe.queue.append((due, data or None))
            pipe.held += len(data)
            pipe.read_eof = not data

    def _pump(self) -> None:
        """Move due chunks out, write what the sockets take, renew what the selector watches."""
        now = time.monotonic()
        for connection in list(self._live):
            try:
                for name, pipe in connection.pipes.items():
                    while pipe.queue and not self._stalled[name] and pipe.queue[0][0] <= now:
                        _, data = pipe.queue.popleft()
                        if data is None:
                            pipe.eof_due = True
                        else:
                            pipe.out += data
                    if connection.connected and pipe.out:
                        with contextlib.suppress(BlockingIOError):
                            sent = pipe.dst.send(pipe.out)
                            del pipe.out[:sent]
                            pipe.held -= sent
                    if connection.connected and pipe.eof_due and not pipe.out and not pipe.done:
                        pipe.dst.shutdown(socket.SHUT_WR)
                        pipe.done = True
            except OSError:
                self._drop(connection, rst=True)
                continue
            if all(pipe.done for pipe in connection.pipes.values()):
                self._drop(connection, rst=False)
            else:
                self._watch(connection)

    def _watch(self, connection: _Connection) -> None:
        for sock, reading, writing in (
            (connection.client, connection.pipes["to_server"], connection.pipes["to_client"]),
            (connection.server, connection.pipes["to_client"], connection.pipes["to_server"]),
        ):
            events = 0
            if not reading.read_eof and reading.held < _HELD_MAX:
                events |= selectors.EVENT_READ
            if writing.out or (sock is connection.server and not connection.connected):
                events |= selectors.EVENT_WRITE
            registered = sock in self._selector.get_map()
            if events and registered:
                self._selector.modify(sock, events, (connection, sock))
            elif events:
                self._selector.register(sock, events, (connection, sock))
            elif registered:
                self._selector.unregister(sock)  # back on a later pump, once there is work

    def _drop(self, connection: _Connection, *, rst: bool) -> None:
        if connection in self._live:
            self._live.remove(connection)
        for sock in (connection.client, connection.server):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            if rst:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    # -- arguments -----------------------------------------------------------------------------

    @staticmethod
    def _check_delay(delay_s: Any, jitter_s: Any) -> None:
        for name, value in (("delay_s", delay_s), ("jitter_s", jitter_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ArgumentTypeError(f"{name} must be seconds (int or float), got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"{name} must be finite seconds >= 0, got {value!r}")

    @staticmethod
    def _directions(direction: object) -> tuple[str, ...]:
        if direction == "both":
            return DIRECTIONS
        if direction in DIRECTIONS:
            return (direction,)  # type: ignore[return-value]
        raise InvalidArgumentError(
            f"direction must be 'both', 'to_server' or 'to_client', got {direction!r}"
        )
