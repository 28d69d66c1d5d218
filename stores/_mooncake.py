"""Feature store on a Mooncake distributed store (``mooncake.store``), zero-copy.

One Mooncake object per non-empty tensor, a record per generation and a head
per sample (the keys: :mod:`stores._mooncake_keys`; the records:
:mod:`stores._mooncake_records`). Every get reads the head with the tensors
and checks both: a head that fails its checksum, or names another sample, is
corruption; an intact head of another generation makes the ref stale.

The store is the public face; each concern is a helper of its own: the round
trips every other one goes through (:mod:`stores._mooncake_io`), puts
(:mod:`stores._mooncake_put`), gets (:mod:`stores._mooncake_get`), deletes in
the order that a crash cannot lose track of (:mod:`stores._mooncake_delete`),
and the listing (:mod:`stores._mooncake_scan`). Every Mooncake return code is
translated into the dataflow error tree in
:func:`stores._mooncake_codes._error`, and nowhere else; the client a process
shares, and its generation numbers, are in :mod:`stores._mooncake_client`.
"""

from __future__ import annotations

import logging
import re
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import torch

from dataflow import InvalidRefError
from dataflow.interfaces import FeatureStore, StoredObject
from dataflow.model import SampleRef
from stores._mooncake_client import _acquire, _release, _Settings, _split_host_port
from stores._mooncake_delete import _Deletes
from stores._mooncake_get import _Gets
from stores._mooncake_io import _Io
from stores._mooncake_keys import KeyLayout
from stores._mooncake_put import _distinct_runs, _Puts
from stores._mooncake_scan import _Scan

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Port of the master's HTTP server (``mooncake_master -metrics_port``) by default.
ADMIN_PORT = 9003
_MiB = 1 << 20
_SIZE_RE = re.compile(r"(\d+)\s*([KMG]i?B?)?", re.IGNORECASE)
log = logging.getLogger(__name__)


def store_uri(master: str, metadata: str, protocol: str, namespace: str) -> str:
    """The canonical ``mooncake://`` URI (identity only: no tuning knobs)."""
    query = urllib.parse.urlencode(
        {"metadata": metadata, "protocol": protocol, "namespace": namespace},
        quote_via=urllib.parse.quote,
        safe="",
    )
    return f"mooncake://{master}?{query}"


def _parse_size(text: str, what: str) -> int:
    match = _SIZE_RE.fullmatch(text.strip())
    if not match:
        raise InvalidRefError(f"{what}={text!r} is not a size like 536870912, 512M or 1GiB")
    unit = (match.group(2) or "")[:1].upper()
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]


def _local_address_towards(host: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # UDP: picks the route, sends nothing
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostname()


class MooncakeFeatureStore(FeatureStore):
    """Features in a Mooncake cluster; URI
    ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

    One Mooncake object per non-empty tensor, hard-pinned. A get reads the
    sample's head and tensors in one batch straight into registered memory
    that the returned tensors are views of (recycled when they are dropped); a
    put sends straight from the tensors over TCP, and over RDMA (which reads
    only registered memory) copies them into registered memory first.

    A put reads the sample's head, takes a generation above it from a block
    of generations that this client claimed from the master (unique across
    processes, see ``_Generations``), writes tensors and record in one batch
    (with the head, when the sample has none yet), then makes the new head
    current and removes the generation it superseded. ``put_many`` does the
    same for a whole batch in as many round trips. Deletes never wait for read
    leases (see ``_Removals``).

    Two processes that put one id at once both succeed with their own
    generations: the head written last is current, the other ref reads as
    stale, and its objects stay stored until its ref is deleted or a
    ``delete_stored`` of what ``scan`` listed frees them.

    ``scan`` lists the namespace from the master's key list (its HTTP server:
    ``admin``, by default port 9003 of the master's host) and reads the record
    of each generation in batches. Handles in one process share one Mooncake
    client per cluster (the first handle's ``segment_size`` / ``buffer_size``
    win). ``stats()`` counts what ``scan`` lists: the namespace's generations,
    whichever process put them (it counted only this handle's puts).

    The head holds the XXH3-64 of every tensor and a checksum of its own; a get
    checks the head and every tensor it reads, and raises CorruptFeatureError
    (naming sample, feature and key) on a mismatch.

    A master that restarts loses every object: what was put before reads as
    stale. Calls wait up to ``connect_timeout`` for a master that is down, and
    for one that restarted to take this client back (see ``_Client.call``).
    """

    def __init__(
        self,
        master: str,
        *,
        metadata: str | None = None,
        protocol: str = "tcp",
        namespace: str = "dataflow",
        local_hostname: str | None = None,
        device: str = "",
        segment_size: int = 512 * _MiB,
        buffer_size: int = 16 * _MiB,
        admin: str | None = None,
        max_idle_bytes: int = 1 << 30,
        connect_timeout: float = 5.0,
        drain_timeout: float = 0.0,
    ) -> None:
        host, _ = _split_host_port(master, "master address")
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise InvalidRefError(f"namespace {namespace!r} must be 1-64 of [A-Za-z0-9_.-]")
        if protocol not in ("tcp", "rdma"):
            raise InvalidRefError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        metadata = metadata or f"http://{host}:8080/metadata"
        admin = admin or f"{master.rpartition(':')[0]}:{ADMIN_PORT}"
        _split_host_port(admin, "admin address")
        super().__init__(store_uri(master, metadata, protocol, namespace))
        self.namespace = namespace
        #: HOST:PORT of the master's HTTP server, where ``scan`` reads the key list.
        self.admin = admin
        self.drain_timeout = drain_timeout
        self._settings = _Settings(
            master=master,
            metadata=metadata,
            protocol=protocol,
            device=device,
            local_hostname=local_hostname or _local_address_towards(host),
            segment_size=segment_size,
            buffer_size=buffer_size,
            connect_timeout=connect_timeout,
            max_idle_bytes=max_idle_bytes,
            admin=admin,
        )
        self._client = _acquire(self._settings)
        # TCP transfers read any memory of this process, so puts send straight
        # from the tensors; RDMA reads only registered memory, so there puts
        # copy the tensors into the registered pool first.
        self._io = _Io(self._client, KeyLayout(namespace), self.uri, stage=protocol != "tcp")
        self._puts = _Puts(self._io)
        self._gets = _Gets(self._io)
        self._deletes = _Deletes(self._io)
        self._listing = _Scan(self._io, admin, connect_timeout)

    @property
    def _checksums(self) -> bool:
        """Benchmarks only: False skips the checksums (none computed on put, none
        checked on get). What such a handle puts, a checking handle refuses."""
        return self._io.checksums

    @_checksums.setter
    def _checksums(self, on: bool) -> None:
        self._io.checksums = on

    @property
    def _stage_puts(self) -> bool:
        """Whether puts copy the tensors into registered memory first (RDMA)."""
        return self._io.stage

    @_stage_puts.setter
    def _stage_puts(self, on: bool) -> None:
        self._io.stage = on

    @property
    def segment_size(self) -> int:
        """Bytes of memory this process's client lends the cluster (0: none)."""
        return self._settings.segment_size

    @property
    def open_uri(self) -> str:
        """``uri`` and ``admin``: what ``dataflow gc`` opens this store by (``scan`` needs it)."""
        return f"{self.uri}&admin={urllib.parse.quote(self.admin, safe='')}"

    @classmethod
    def from_uri(cls, uri: str) -> MooncakeFeatureStore:
        """Open ``mooncake://HOST:PORT?metadata=URL&protocol=tcp&namespace=NS``.

        Optional tuning parameters (not part of the store's identity, so not
        in :attr:`uri`): ``local_hostname``, ``device``, ``segment_size`` and
        ``buffer_size`` (bytes, or 512M / 1G), and ``admin`` (HOST:PORT of the
        master's HTTP server, for ``scan``).
        """
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != "mooncake" or not parts.netloc or parts.path not in ("", "/"):
            raise InvalidRefError(f"{uri!r} is not a mooncake://HOST:PORT?... URI")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
        allowed = {
            "metadata",
            "protocol",
            "namespace",
            "local_hostname",
            "device",
            "segment_size",
            "buffer_size",
            "admin",
        }
        unknown = sorted(set(query) - allowed)
        if unknown or any(len(v) != 1 for v in query.values()):
            got = unknown or query
            raise InvalidRefError(
                f"{uri!r}: each query parameter once, from {sorted(allowed)}; {got}"
            )
        args: dict[str, Any] = {k: v[0] for k, v in query.items()}
        for size in ("segment_size", "buffer_size"):
            if size in args:
                args[size] = _parse_size(args[size], size)
        return cls(parts.netloc, **args)

    # -- keys (tests reach the stored objects by them) --------------------
    def _head_key(self, sample_id: str) -> str:
        return self._io.keys.head(sample_id)

    def _keys(self, sample_id: str, generation: int, names: list[str]) -> list[str]:
        """The generation's record first, then one key per named tensor."""
        return self._io.keys.generation(sample_id, generation, names)

    def _all_keys(self) -> Iterator[str]:
        """Every key of the cluster, as the master's HTTP server lists them."""
        return self._listing.all_keys()

    # -- the hooks of FeatureStore ------------------------------------------
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef:
        return self._puts.put_batch([(sample_id, tensors, metadata)])[0]

    def _put_many(
        self, items: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]
    ) -> list[SampleRef]:
        return self._all_or_none(self._puts.put_batch(run) for run in _distinct_runs(items))

    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        return self._gets.get(ref, names)

    def _get_many_into(self, items: list[tuple[SampleRef, dict[str, torch.Tensor]]]) -> None:
        self._gets.get_many_into(items)

    def _exists(self, ref: SampleRef) -> bool:
        return self._gets.exists(ref)

    def _delete(self, ref: SampleRef) -> None:
        self._deletes.delete(ref)

    def _delete_stored(self, obj: StoredObject) -> bool:
        return self._deletes.delete_stored(obj)

    def _scan(self) -> Iterator[StoredObject]:
        return self._listing.scan()

    def _close(self) -> None:
        # Waiting out read leases (10 s by default) would stall every shutdown: what
        # a lease still holds stays stored with its record, for `dataflow gc`.
        left = self._client.removals.drain(f"{self.namespace}/", self.drain_timeout)
        left += _release(self._settings, 0.0)
        if left:
            log.info(
                "%s: %d Mooncake keys were under a read lease at close and stay stored "
                "until `dataflow gc` removes them, e.g. %s",
                self.uri,
                len(left),
                left[:3],
            )
