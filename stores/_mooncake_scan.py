"""What a Mooncake store lists: its namespace's generations, from the master's key list."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from dataflow import CorruptFeatureError, StoreUnavailableError
from dataflow.interfaces import StoredObject
from stores._mooncake_client import _OPENER
from stores._mooncake_codes import NOT_FOUND, NOT_READY
from stores._mooncake_io import _Io
from stores._mooncake_records import _UNREADABLE, _decode_record

_SCAN_BATCH = 128
log = logging.getLogger(__name__)


class _Scan:
    """``scan`` lists the namespace from the master's key list (its HTTP server at
    ``admin``) and reads the record of each generation in batches."""

    def __init__(self, io: _Io, admin: str, timeout: float) -> None:
        self._io = io
        self._admin = admin
        self._timeout = timeout

    def scan(self) -> Iterator[StoredObject]:
        """The namespace's generations with a record, as the listing goes; then the
        leftovers: generations whose tensors are stored without a record, and heads
        stored without any generation of their sample (left by a process that died
        in a delete of an older dataflow, which removed the record first)."""
        io = self._io
        prefix = io.keys.prefix
        batch: list[tuple[str, str, int]] = []
        recorded: set[tuple[str, int]] = set()
        unrecorded: set[tuple[str, int]] = set()  # generations with tensors, as listed
        heads: set[str] = set()
        for key in self.all_keys():
            if not key.startswith(prefix) or io.client.removals.is_pending(key):
                continue  # not ours, or one that this process is removing
            kind, sample_id, generation = io.keys.parse(key)
            if kind == "record":
                recorded.add((sample_id, generation))
                batch.append((key, sample_id, generation))
                if len(batch) == _SCAN_BATCH:
                    yield from self._records(batch)
                    batch = []
            elif kind == "tensor":
                unrecorded.add((sample_id, generation))
            elif kind == "head":
                heads.add(sample_id)
        yield from self._records(batch)
        unrecorded -= recorded
        heads -= {sample_id for sample_id, _ in recorded | unrecorded}
        yield from self._leftovers(sorted(unrecorded), sorted(heads))

    def all_keys(self) -> Iterator[str]:
        """Every key of the cluster, one by one, as the master's HTTP server lists them."""
        url = f"http://{self._admin}/get_all_keys"
        where = (
            f"cannot list the keys of {self._io.uri} at {url}: scan() reads them from the "
            "master's HTTP server (mooncake_master -metrics_port, by default 9003); give "
            "its address as admin=HOST:PORT"
        )
        try:
            with _OPENER.open(url, timeout=self._timeout) as response:
                for line in response:
                    key = line.decode(errors="replace").strip()
                    if key:
                        yield key
        except OSError as exc:  # URLError and HTTPError are OSErrors
            raise StoreUnavailableError(f"{where} ({exc})") from exc

    def _leftovers(
        self, generations: list[tuple[str, int]], heads: list[str]
    ) -> Iterator[StoredObject]:
        """``generations`` whose records are still missing, and what ``heads`` name.

        Their size is unknown (0) and their time is when their block of generations was
        claimed (the generation is the wall clock in nanoseconds then, see
        ``_Generations``), which is never after their put.
        """
        io = self._io
        now = time.time()
        for start in range(0, len(generations), _SCAN_BATCH):
            chunk = generations[start : start + _SCAN_BATCH]
            records = [io.keys.record(sample_id, generation) for sample_id, generation in chunk]
            for (sample_id, generation), got in zip(chunk, io.read_small(records), strict=True):
                if got == NOT_FOUND:  # anything else: a put wrote it since the listing
                    yield StoredObject(sample_id, generation, 0, min(generation / 1e9, now))
        for start in range(0, len(heads), _SCAN_BATCH):
            sample_ids = heads[start : start + _SCAN_BATCH]
            for sample_id, head in zip(sample_ids, io.read_heads(sample_ids), strict=True):
                if head is not None and head is not _UNREADABLE:
                    yield StoredObject(sample_id, head.generation, 0, head.created)

    def _records(self, batch: list[tuple[str, str, int]]) -> Iterator[StoredObject]:
        if not batch:
            return
        io = self._io
        for (key, sample_id, generation), got in zip(
            batch, io.read_small([key for key, _, _ in batch]), strict=True
        ):
            if got in (NOT_FOUND, NOT_READY):
                continue  # removed since the listing, or a put is writing it
            try:
                if not isinstance(got, bytes):
                    record = io.read_record(key, sample_id)
                    if record is None:
                        continue
                else:
                    try:
                        record = _decode_record(got, sample_id, key)
                    except CorruptFeatureError:
                        record = io.read_record(key, sample_id)  # once more, alone
                        if record is None:
                            continue
                if record.generation != generation:
                    raise CorruptFeatureError(f"{key}: it names generation {record.generation}")
            except CorruptFeatureError as exc:
                log.warning("scan of %s skips a record no delete can use: %s", io.uri, exc)
                continue
            yield StoredObject(sample_id, generation, record.nbytes, record.created)
