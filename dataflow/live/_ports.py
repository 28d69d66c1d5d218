"""Loopback ports for a listener that binds later: a gloo rendezvous, a stream's receiver.

A port from ``bind(("127.0.0.1", 0))`` is one of the kernel's ephemeral ports, the ones
it gives outgoing connections: between the probe and the listener's bind, any
connection the machine opens may take it (EADDRINUSE, and in a gloo group the other
ranks wait for a rendezvous that never comes). Ports below the ephemeral range are
never handed out that way, so a port drawn there stays free unless some listener
takes it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The kernel's ephemeral range (``low high``); 32768-60999 by default.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: How far below the ephemeral range ports are drawn.
BELOW = 12_000
#: Draws before falling back to a port from the kernel.
TRIES = 100
_LOWEST = 1024  # under it, ports are privileged


def loopback_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that no socket is bound to now, drawn below the kernel's
    ephemeral range (``EPHEMERAL_RANGE``); a port from the kernel where that range
    cannot be read or leaves no room under it, or where no draw was free."""
    low = _ephemeral_low()
    if low - BELOW >= _LOWEST:
        draw = random.SystemRandom()
        for _ in range(TRIES):
            port = draw.randrange(low - BELOW, low)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
