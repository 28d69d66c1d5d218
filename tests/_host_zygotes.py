"""The simulated hosts' Python children forked warm, inside each host's namespace.

:class:`HostZygotes` is a :class:`dataflow.testing.Cluster` launcher (``Cluster(launcher=
...)``) built on :mod:`tests._zygote`: a zygote per host, started through ``ip netns exec``,
forks that host's ``python -c``/``-m`` children, which then import nothing afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from tests import _zygote


class HostZygotes:
    """A :class:`dataflow.testing.Cluster` launcher: each host's ``python -c``/``-m``
    children forked from a zygote started in that host's network namespace (on first
    use), so that they run there without importing torch and dataflow afresh. Other
    commands, and what a zygote refuses, are left to the cluster (None). The zygotes
    die with their namespaces when the cluster stops; :meth:`close` stops them before."""

    def __init__(self, preload: Sequence[str] = _zygote.PRELOAD) -> None:
        self.preload = tuple(preload)
        self._zygotes: dict[str, _zygote.Zygote] = {}

    def __call__(self, host: Any, argv: Sequence[str], **kwargs: Any) -> _zygote.ForkedPopen | None:
        try:
            _zygote._parse(argv)
        except ValueError:
            return None
        server = self._zygotes.get(host.netns)
        if server is None or server.server.poll() is not None:
            server = _zygote.Zygote(self.preload, prefix=host.command([]))
            self._zygotes[host.netns] = server
        try:
            return _zygote.ForkedPopen(argv, zygote=server, **kwargs)
        except ValueError:  # a setting only a fresh interpreter takes
            return None

    def close(self) -> None:
        for server in self._zygotes.values():
            server.close()
        self._zygotes.clear()


@contextlib.contextmanager
def warm_cluster(*args: Any, **kwargs: Any) -> Iterator[Any]:
    """A started :class:`dataflow.testing.Cluster` (its arguments) whose hosts' Python
    children fork from :class:`HostZygotes`; stopped, with the zygotes, at the end."""
    from dataflow.testing import Cluster

    launcher = HostZygotes()
    try:
        with Cluster(*args, launcher=launcher, **kwargs) as cluster:
            yield cluster
    finally:
        launcher.close()
