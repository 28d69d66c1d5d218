"""A network namespace joined to the host by a veth pair, and links cut without a word.

``veth_namespace(prefix, subnet)`` makes namespace ``PREFIX-XXXX`` with one end of a
veth pair in it and the other on the host, each with an address of a /24 of ``subnet``;
it removes both on exit. ``Link.exec(...)`` is the argv that runs a command inside it.

``Link.cut()`` cuts the link silently: both ends send their frames to a MAC address
nobody has (permanent neighbour entries), so packets vanish with no FIN, no RST and
no ICMP, as when a machine loses power or a switch port dies; ``heal()`` puts the real
addresses back. No netem, no iptables: only ``ip``, as root.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from tests._schedule import worker_index

NOWHERE_MAC = "02:00:00:00:00:01"  # locally administered, owned by no interface


def why_unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) for network namespaces"
    return None


def _ip(*args: str, namespace: str | None = None) -> str:
    argv = ["ip", *args] if namespace is None else ["ip", "-n", namespace, *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Link:
    """A namespace and its veth link to the host."""

    namespace: str
    host_interface: str
    namespace_interface: str
    host_address: str
    namespace_address: str
    host_mac: str
    namespace_mac: str

    def exec(self, *argv: str) -> list[str]:
        """The argv that runs ``argv`` inside the namespace (environment inherited)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Make every frame on the link vanish, both ways, without FIN, RST or ICMP."""
        self._point_neighbours(NOWHERE_MAC, NOWHERE_MAC)

    def heal(self) -> None:
        """Undo :meth:`cut`: frames reach the other end again."""
        self._point_neighbours(self.namespace_mac, self.host_mac)

    def _point_neighbours(self, from_host: str, from_namespace: str) -> None:
        """Pin where each end sends frames for the other's address (no ARP to undo it)."""
        for address, mac, interface, namespace in (
            (self.namespace_address, from_host, self.host_interface, None),
            (self.host_address, from_namespace, self.namespace_interface, self.namespace),
        ):
            _ip("neigh", "replace", address, "lladdr", mac, "nud", "permanent", "dev", interface,
                namespace=namespace)  # fmt: skip


def _mac(interface: str, namespace: str | None = None) -> str:
    words = _ip("-o", "link", "show", "dev", interface, namespace=namespace).split()
    return words[words.index("link/ether") + 1]


@contextlib.contextmanager
def veth_namespace(prefix: str, subnet: str) -> Iterator[Link]:
    """A fresh namespace ``PREFIX-XXXX`` linked to the host on a random /24 of ``subnet``.

    Interface names are the first three letters of the part of ``prefix`` after ``df-``
    plus the same four hex digits (15 characters at most, as Linux requires). Under
    pytest-xdist the first hex digit and the /24 are the worker's own, so namespaces
    made by workers running at once never share a name or a network.
    """
    index = worker_index() % 16
    tag = f"{index:x}{random.getrandbits(12):03x}"
    short = prefix.removeprefix("df-")[:3]
    networks = list(ipaddress.ip_network(subnet).subnets(new_prefix=24))[1:-1]
    network = random.choice([n for i, n in enumerate(networks) if i % 16 == index])
    host_address, namespace_address = (str(a) for a in list(network.hosts())[:2])
    namespace = f"{prefix}-{tag}"
    host_if, namespace_if = f"{short}{tag}h", f"{short}{tag}n"
    _ip("netns", "add", namespace)
    try:
        _ip(
            "link", "add", host_if, "type", "veth", "peer", "name", namespace_if, "netns", namespace
        )
        _ip("addr", "add", f"{host_address}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{namespace_address}/24", "dev", namespace_if, namespace=namespace)
        _ip("link", "set", namespace_if, "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        link = Link(
            namespace=namespace,
            host_interface=host_if,
            namespace_interface=namespace_if,
            host_address=host_address,
            namespace_address=namespace_address,
            host_mac=_mac(host_if),
            namespace_mac=_mac(namespace_if, namespace),
        )
        link.heal()  # permanent entries: no ARP to race with a cut
        yield link
    finally:
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", host_if)  # takes its peer in the namespace with it
        _ip("netns", "del", namespace)
