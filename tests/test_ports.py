"""dataflow.live._ports: a loopback port for a listener that binds later, drawn below the
kernel's ephemeral range (a port from bind(0) can be taken by any outgoing connection
before the listener binds it)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataflow.live import _ports
from dataflow.live._ports import BELOW, loopback_port


def _ephemeral() -> tuple[int, int]:
    low, high = _ports.EPHEMERAL_RANGE.read_text().split()
    return int(low), int(high)


@pytest.fixture
def low() -> int:
    """The first port of this kernel's ephemeral range; skips where none fits below it."""
    low, _ = _ephemeral()
    if low - BELOW < 1024:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    return low


def _bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


class _Draws:
    """random.SystemRandom whose randrange gives ``ports`` in turn (then the last again)."""

    def __init__(self, ports: list[int]) -> None:
        self._ports: Iterator[int] = iter(ports)
        self.last = ports[-1]
        self.calls: list[tuple[int, int]] = []

    def __call__(self) -> _Draws:
        return self

    def randrange(self, start: int, stop: int) -> int:
        self.calls.append((start, stop))
        self.last = next(self._ports, self.last)
        return self.last


def test_a_port_is_drawn_below_the_ephemeral_range_and_is_free(low: int) -> None:
    for _ in range(20):
        port = loopback_port()
        assert low - BELOW <= port < low
        _bind(port)  # nobody holds it


def test_a_port_some_socket_holds_is_not_given_out(
    monkeypatch: pytest.MonkeyPatch, low: int
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        free = loopback_port()
        draws = _Draws([taken, free])
        monkeypatch.setattr(_ports.random, "SystemRandom", draws)
        assert loopback_port() == free
    assert draws.calls == [(low - BELOW, low), (low - BELOW, low)]


def test_without_a_free_draw_the_kernel_gives_the_port(
    monkeypatch: pytest.MonkeyPatch, low: int
) -> None:
    high = _ephemeral()[1]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        draws = _Draws([held.getsockname()[1]])
        monkeypatch.setattr(_ports.random, "SystemRandom", draws)
        port = loopback_port()
    assert len(draws.calls) == _ports.TRIES
    assert low <= port <= high
    _bind(port)


@pytest.mark.parametrize("content", [None, "", "not a range", f"{1024 + BELOW - 1} 60999"], ids=str)
def test_an_unreadable_or_too_low_range_falls_back_to_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None
) -> None:
    low, high = _ephemeral()
    path = tmp_path / "ip_local_port_range"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(_ports, "EPHEMERAL_RANGE", path)
    draws = _Draws([1])
    monkeypatch.setattr(_ports.random, "SystemRandom", draws)
    port = loopback_port()
    assert draws.calls == []
    assert low <= port <= high  # the real kernel's ephemeral range
    _bind(port)
