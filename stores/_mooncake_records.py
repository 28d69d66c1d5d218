"""The records of a Mooncake store: what a generation's record (and its head) holds.

A record is ``b"DFHEAD02" | u64 xxh3 of the JSON (little endian) | JSON``, the
JSON ``{"sample_id", "generation", "created", "nbytes", "xxh3": {name: 16 hex
digits}, "specs": {name: [dtype, shape]}}``: when it was put (seconds since the
epoch), its tensor bytes, the XXH3-64 of each non-empty tensor's bytes, and
the spec of every feature. A record that fails its checksum, or names another
sample, is corruption.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from dataflow import CorruptFeatureError
from dataflow.model import FeatureSpec, SampleRef
from stores import _tensors

#: The most bytes a record (or head) may take.
_HEAD_CAP = 16384
_HEAD_MAGIC = b"DFHEAD02"
_HEAD_FAMILY = b"DFHEAD"
_HEAD_SUM = struct.Struct("<Q")
_FIX = "delete the sample (store.delete(ref)) and put it again (regenerate it)"

# Made once: json.dumps with options builds an encoder on every call.
_RECORD_ENCODER = json.JSONEncoder(separators=(",", ":"))
_RECORD_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class _Record:
    """What a generation's record (and the head, a copy of the current one) says."""

    generation: int
    created: float  # seconds since the epoch
    nbytes: int  # tensor bytes
    checksums: dict[str, str | None]  # name -> xxh3 of each non-empty tensor, by name
    # name -> [dtype, shape] of every feature (_spec_doc); None in heads written before
    # dataflow recorded them, which are read unchecked.
    specs: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.checksums)


def _spec_doc(specs: Mapping[str, FeatureSpec]) -> dict[str, Any]:
    """``specs`` as a record holds them (and as JSON reads them back: lists). Every
    read compares a ref's with its head's; samples of one run share their specs, so
    most reads find it made (never change what it returns)."""
    return _spec_doc_of(tuple(specs.items()))


@functools.lru_cache(maxsize=1024)
def _spec_doc_of(items: tuple[tuple[str, FeatureSpec], ...]) -> dict[str, Any]:
    return {
        name: [_tensors.dtype_str(spec.dtype), list(spec.shape)] for name, spec in sorted(items)
    }


def _encode_record(
    sample_id: str,
    generation: int,
    created: float,
    nbytes: int,
    sums: dict[str, str | None],
    specs: Mapping[str, FeatureSpec],
) -> bytes:
    doc = {
        "sample_id": sample_id,
        "generation": generation,
        "created": created,
        "nbytes": nbytes,
        "xxh3": sums,
        "specs": _spec_doc(specs),
    }
    body = _RECORD_ENCODER.encode(doc).encode()
    return _HEAD_MAGIC + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body)) + body


def _decode_record(data: bytes, sample_id: str, key: str) -> _Record:
    """The record in ``data``; CorruptFeatureError unless it is intact and of ``sample_id``."""

    def corrupt(what: str) -> CorruptFeatureError:
        whose = "the head" if key.endswith("/@head") else "the record"
        return CorruptFeatureError(
            f"{key} ({whose} of sample {sample_id!r}): {what}; it is corrupt: {_FIX}"
        )

    magic, body = data[:8], data[16:]
    if magic != _HEAD_MAGIC:
        if magic[:6] == _HEAD_FAMILY or data[:1] == b"{":
            version = magic[6:].decode(errors="replace") if magic[:6] == _HEAD_FAMILY else "01"
            raise corrupt(
                f"head format version {version}, this dataflow reads only version "
                f"{_HEAD_MAGIC[6:].decode()} (heads with checksums)"
            )
        raise corrupt(f"not a dataflow head ({len(data)} bytes, bad magic)")
    if len(data) < 16 or _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body)) != data[8:16]:
        raise corrupt("it fails its checksum")
    try:
        doc = _RECORD_DECODER.decode(body.decode())
        generation, checksums = doc["generation"], doc["xxh3"]
        created, nbytes, specs = doc["created"], doc["nbytes"], doc.get("specs")
        if not (
            isinstance(generation, int)
            and isinstance(checksums, dict)
            and isinstance(created, (int, float))
            and isinstance(nbytes, int)
            and (specs is None or isinstance(specs, dict))
        ):
            raise TypeError("bad field types")
    except (ValueError, KeyError, TypeError) as exc:
        raise corrupt(f"unreadable: {exc}") from exc
    if doc.get("sample_id") != sample_id:
        raise corrupt(f"it names sample {doc.get('sample_id')!r}")
    sums = {str(name): value for name, value in checksums.items()}
    return _Record(generation, float(created), nbytes, sums, specs)


def _specs_differ(ref: SampleRef, stored: dict[str, Any], key: str) -> CorruptFeatureError:
    """The error for a ref whose specs are not those its sample was put with."""
    said = _spec_doc(ref.specs)
    name = next(n for n in sorted({*said, *stored}) if said.get(n) != stored.get(n))
    has = "not stored" if name not in stored else "{} {}".format(*stored[name])
    says = "no such feature" if name not in said else "{} {}".format(*said[name])
    return CorruptFeatureError(
        f"{key}: feature {name!r} of sample {ref.sample_id!r} is {has}, the ref says {says}: "
        "the ref does not describe what was put; read it through the ref that put returned"
    )


_UNREADABLE = _Record(-1, 0.0, 0, {})  # a head that stays corrupt: replaced, nothing to remove
