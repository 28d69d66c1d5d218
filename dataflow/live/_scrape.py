"""The HTTP side of a metrics endpoint: a server with a cap on connections, a deadline
on silent and slow clients, and an exposition rendered at most once per interval.

What is served (collectors, a registry) is dataflow.live._metrics's; this module only
serves bytes, so it imports no prometheus_client.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: How many connections an endpoint serves at once (``serve_metrics(max_connections=)``).
MAX_CONNECTIONS = 8
#: Seconds a connection may stay silent, or take to send its request (``idle_timeout=``).
IDLE_TIMEOUT_S = 5.0
#: Seconds between two runs of the collectors, however many clients scrape (``min_interval=``).
MIN_INTERVAL_S = 0.5
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)
_served_log = logging.getLogger("dataflow.metrics")


class _Exposition:
    """A text exposition (``render``), made at most once per ``min_interval``.

    A scrape gets a rendering that started after its request came (never older values);
    the scrapes that come while one waits or renders share the next one. However many
    clients scrape, the collectors (a RunMetrics folds the ledger's new events) run at
    most once per interval, on a server thread, so the training thread gives up a
    bounded share of the interpreter to them.
    """

    def __init__(self, render: Callable[[], bytes], content_type: str, min_interval: float) -> None:
        self._render = render
        self.content_type = content_type
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._tried = -math.inf  # when the newest rendering started, done or not
        self._rendered = -math.inf  # when the one in ``_body`` started
        self._body = b""

    def latest(self, asked: float) -> bytes:
        with self._lock:
            if self._rendered >= asked:
                return self._body
            pause = self._tried + self._min_interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            self._tried = started = time.monotonic()
            self._body = self._render()
            self._rendered = started
            return self._body


class _ScrapeHandler(BaseHTTPRequestHandler):
    server: _ScrapeServer

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers: the deadline holds till then
        if not self.server.request_read(self.connection):
            self.close_connection = True
            return False  # shut down at its deadline: nothing to answer
        return parsed

    def do_GET(self) -> None:
        asked = time.monotonic()
        if urllib.parse.urlsplit(self.path).path not in ("/", "/metrics"):
            self.send_error(404, "the metrics are at /metrics")
            return
        try:
            body = self.server.exposition.latest(asked)
        except Exception:
            _served_log.exception("a collector failed while serving %s", self.path)
            self.send_error(500, "a collector failed; see the exporter's log")
            return
        self.send_response(200)
        self.send_header("Content-Type", self.server.exposition.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        _served_log.debug("%s: " + format, self.address_string(), *args)


class _ScrapeServer(ThreadingHTTPServer):
    """An HTTP server with a cap on connections and a deadline on requests.

    prometheus_client's own server takes a thread and a file descriptor for every
    client that connects, for as long as the client stays silent. Here at most
    ``max_connections`` are served at once (one more is answered 503 and closed at
    once); each socket operation times out after ``idle_timeout``, and a connection that
    has not sent its whole request ``idle_timeout`` after it was accepted is shut down
    (so one byte every few seconds does not hold a slot either).
    """

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[Any, ...],
        family: int,
        exposition: _Exposition,
        max_connections: int,
        idle_timeout: float,
    ) -> None:
        self.address_family = family
        self.exposition = exposition
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}  # -> deadline of its request (inf: read)
        super().__init__(address, _ScrapeHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host's name up (getfqdn), which can take seconds.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        request.settimeout(self.idle_timeout)
        with self._lock:
            self._open[request] = time.monotonic() + self.idle_timeout
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.shutdown_request(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def request_read(self, request: socket.socket) -> bool:
        """The request is in: its deadline no longer holds. False if it was shut down."""
        with self._lock:
            if request not in self._open:
                return False
            self._open[request] = math.inf
            return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-answer: no traceback on stderr (socketserver's way).
        _served_log.debug("serving metrics to %s failed", client_address, exc_info=True)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # before the close: the reaper never touches a closed socket
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Between accepts (every poll interval): shut down requests past their deadline."""
        self._shut_down(time.monotonic())

    def server_close(self) -> None:
        super().server_close()
        self._shut_down(math.inf)

    def _shut_down(self, now: float) -> None:
        with self._lock:
            late = [request for request, deadline in self._open.items() if deadline <= now]
            for request in late:
                del self._open[request]
                # Wakes the handler's read with an end of file; the handler closes it.
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


def _refuse(request: socket.socket) -> None:
    """Answer a connection beyond the cap "503, retry after 1 s" without waiting on it."""
    try:
        request.setblocking(False)
        request.send(_BUSY)
    except OSError:
        pass


def _bind_address(host: str, port: int) -> tuple[int, tuple[Any, ...]]:
    """The address family and socket address to bind ``host``:``port`` (IPv4 or IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    return family, address
