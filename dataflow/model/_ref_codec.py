"""The JSON of a SampleRef, compiled: what a commit's payload and a stream's ref frame carry.

Encoding and decoding refs is most of a stream's CPU time and a large part of
a commit's, so both go through msgspec (C) where it gives exactly what the
generic Python paths give, and fall back to those paths everywhere else:

* :func:`ref_json` is ``ref.to_json()`` byte for byte (a commit's payload is
  compared as text with the one written before: tests/test_ledger_commit_dedup.py
  holds the two equal). Each distinct set of specs is encoded once (and
  checked once, by the caller's ``check``); the metadata goes through msgspec
  when its text is provably the one ``json`` writes (see :func:`_metadata_json`).
* :class:`RefReader` decodes a ref's JSON, read by msgspec into
  :class:`RefJson`, into the SampleRef that ``SampleRef.from_dict`` would
  build; anything it is not sure of gives None, and the caller takes the
  generic path (:func:`dataflow.model._refs.ref_from_parsed` of ``json.loads``),
  which accepts and refuses exactly as before. :func:`ref_from_json` is the
  ledger's decoder.
* :class:`RefWriter` encodes many refs for a stream in one pass: JSON that
  decodes to the refs ``to_json`` describes, not its bytes (see there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _quote
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from dataflow.model._errors import DataflowError
from dataflow.model._refs import (
    _JSON,
    _REF_FIELDS,
    FeatureSpec,
    SampleRef,
    SpecCheck,
    _parsed_spec,
    ref_from_parsed,
)

#: Whether SampleRef still has the fields joined here; if it ever grows another,
#: every ref goes through ``to_json`` and ``from_dict``.
_FAST = tuple(f.name for f in dataclasses.fields(SampleRef)) == _REF_FIELDS


def no_check(name: str, spec: FeatureSpec) -> None:
    """The default ``check`` of :func:`ref_json`: every valid spec is fine."""


# -- encoding ------------------------------------------------------------------------------
def ref_json(ref: SampleRef, check: SpecCheck = no_check) -> str:
    """``ref.to_json()``, byte for byte, after ``check(name, spec)`` of each spec.

    ``check`` runs once per distinct set of specs (a set it raises for is not
    cached, and raises every time). A ref that is not plain data (metadata
    mutated after construction, a spec that is not a FeatureSpec) goes
    through ``to_json``, which says what is wrong.
    """
    generation, store, specs, metadata = ref.generation, ref.store, ref.specs, ref.metadata
    if not _FAST or type(generation) is not int or type(store) is not str:
        return _checked_to_json(ref, check)
    try:
        if len(specs) == 1:  # most refs: no list to build
            for name, spec in specs.items():
                key: tuple[Any, ...] = ((name, spec.shape, spec.dtype),)
        else:
            key = tuple([(name, spec.shape, spec.dtype) for name, spec in specs.items()])
        return (
            f'{{"generation":{generation},"metadata":'
            f"{_metadata_json(metadata) if metadata else '{}'},"
            f'"sample_id":{_quote(ref.sample_id)},"specs":{_specs_json(key, check)},'
            f'"store":{_store_json(store)}}}'
        )
    except (TypeError, AttributeError, ValueError, RecursionError):
        return _checked_to_json(ref, check)  # not plain data after all: let to_json say what


def _checked_to_json(ref: SampleRef, check: SpecCheck) -> str:
    for name, spec in ref.specs.items():
        check(name, spec)
    return ref.to_json()


@functools.lru_cache(maxsize=4096)
def _specs_json(specs: tuple[tuple[str, tuple[int, ...], Any], ...], check: SpecCheck) -> str:
    decoded = {name: FeatureSpec(shape, dtype) for name, shape, dtype in specs}
    for name, spec in decoded.items():
        check(name, spec)
    return _JSON.encode({name: spec.to_dict() for name, spec in decoded.items()})


@functools.lru_cache(maxsize=64)  # a producer writes to one store or a few
def _store_json(store: str) -> str:
    return _quote(store)


_SORTED = msgspec.json.Encoder(order="sorted")
_CACHE_SIZE = 4096


def _metadata_json(metadata: Any) -> str:
    """``json.dumps(metadata, sort_keys=True, separators=(",", ":"))``, through msgspec
    where the two write the same text.

    They differ only in floats outside [1e-4, 1e16) (``1e-05`` against ``0.00001``)
    and in strings that need escaping (``json`` escapes non-ASCII, msgspec does
    not): so msgspec's text is taken for metadata without such floats (checked
    first) and only when it came out as ASCII with no escape at all.
    """
    if type(metadata) is not dict:
        return _JSON.encode(metadata)
    for key, value in metadata.items():
        kind = type(value)
        if type(key) is not str or (kind is not int and kind is not str and not _same_text(value)):
            return _JSON.encode(metadata)
    text = _SORTED.encode(metadata)
    if text.isascii() and b"\\" not in text and b"\x7f" not in text:
        return text.decode()
    return _JSON.encode(metadata)


def _same_text(value: object) -> bool:
    """Whether msgspec writes ``value`` as ``json`` does (strings aside: see above)."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return value == 0.0 or 1e-4 <= abs(value) < 1e16  # type: ignore[arg-type]
    if kind is list:
        return all(map(_same_text, value))  # type: ignore[call-overload]
    if kind is dict:
        return all(type(k) is str for k in value) and all(map(_same_text, value.values()))  # type: ignore[attr-defined]
    return False


_SpecsKey = tuple[tuple[str, tuple[int, ...], Any], ...]
# A ref's five fields in to_json's order; specs spliced in as their cached text.
_Body = msgspec.defstruct(
    "RefBody",
    [
        ("generation", int),
        ("metadata", dict),
        ("sample_id", str),
        ("specs", msgspec.Raw),
        ("store", str),
    ],
    gc=False,
)
_BODY = msgspec.json.Encoder(order="sorted").encode


class RefWriter:
    """Encodes refs for a stream: each ref's JSON object, many refs in one pass.

    :meth:`bodies` gives JSON that decodes to the ref ``to_json`` describes (equal
    fields, keys in the same order), though not always its bytes: non-ASCII text
    is written as UTF-8 where ``json`` escapes it, and floats in msgspec's shortest
    form (``1e16`` for ``1e+16``), the same numbers. It gives None where a ref is
    not plainly valid (or beyond the bounds given), and the caller encodes the
    refs one by one on the careful path, which says what is wrong.
    """

    def __init__(
        self,
        check: SpecCheck = no_check,
        *,
        max_generation: int,
        max_store_chars: int,
        max_features: int,
    ) -> None:
        self._check = check
        self._max_generation = max_generation
        self._max_store_chars = max_store_chars
        self._max_features = max_features
        # name, shape, dtype of each spec, flat -> the specs' JSON, valid and checked.
        self._specs: dict[tuple[Any, ...], msgspec.Raw] = {}

    def bodies(self, refs: Sequence[object]) -> list[bytes] | None:
        """The JSON object of each of ``refs``, or None where one needs the careful path."""
        items = []
        append = items.append
        cache = self._specs
        max_generation, max_store = self._max_generation, self._max_store_chars
        try:
            for ref in refs:
                if type(ref) is not SampleRef or not _FAST:
                    return None
                # Attributes, not ref.__dict__: Python 3.11 builds that dict on first use
                # (3 us a ref, more than all the rest).
                generation, store, specs = ref.generation, ref.store, ref.specs
                metadata, sample_id = ref.metadata, ref.sample_id
                if (
                    type(sample_id) is not str
                    or type(generation) is not int
                    or type(store) is not str
                    or type(specs) is not dict
                    or type(metadata) is not dict
                    or not 0 <= generation <= max_generation
                    or not 0 < len(store) <= max_store
                ):
                    return None
                key = _writer_key(specs)
                text = cache.get(key)
                if text is None:
                    text = self._specs_text(key)
                    if text is None:
                        return None
                for name, value in metadata.items():
                    kind = type(value)
                    if type(name) is not str or (
                        kind is not int and kind is not str and not _plain_json(value)
                    ):
                        return None
                append(_Body(generation, metadata, sample_id, text, store))
            return list(map(_BODY, items))
        except (TypeError, AttributeError, ValueError, RecursionError):
            return None  # not plain data after all (a surrogate, a spec that is no FeatureSpec)

    def _specs_text(self, key: tuple[Any, ...]) -> msgspec.Raw | None:
        if len(key) > 3 * self._max_features:
            return None
        specs = tuple(zip(key[0::3], key[1::3], key[2::3], strict=True))
        try:
            text = msgspec.Raw(_specs_json(specs, self._check).encode())
        except (DataflowError, TypeError, ValueError):
            return None
        if len(self._specs) >= _CACHE_SIZE:
            self._specs.clear()
        self._specs[key] = text
        return text


def _writer_key(specs: dict[Any, Any]) -> tuple[Any, ...]:
    """Name, shape and dtype of each spec, one flat tuple: :class:`RefWriter`'s cache key."""
    if len(specs) > 4:
        return tuple([x for name, spec in specs.items() for x in (name, spec.shape, spec.dtype)])
    key: tuple[Any, ...] = ()
    for name, spec in specs.items():  # a third faster than a comprehension in Python 3.11
        key += (name, spec.shape, spec.dtype)
    return key


def _plain_json(value: object) -> bool:
    """Whether ``value`` is JSON that msgspec writes as the same value ``json`` writes."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)  # type: ignore[arg-type]  # msgspec writes NaN as null
    if kind is list:
        return all(map(_plain_json, value))  # type: ignore[call-overload]
    if kind is dict:
        return all(type(k) is str for k in value) and all(map(_plain_json, value.values()))  # type: ignore[attr-defined]
    return False


# -- decoding ------------------------------------------------------------------------------
# validate_sample_id as a pattern: 1-256 characters of [A-Za-z0-9._:/-], no '..', no
# leading '/' (msgspec searches it, hence the anchors; \Z, for '$' also matches before a
# trailing newline).
_SAMPLE_ID = r"^(?!/)(?!.*\.\.)[A-Za-z0-9._:/-]+\Z"
# The same for many ids at once, joined by newlines (see _valid_ids).
_JOINED_IDS = re.compile(r"[A-Za-z0-9._:/\n-]*")


def ref_struct(
    *,
    max_generation: int | None = None,
    max_store_chars: int | None = None,
    id_pattern: bool = True,
) -> type[msgspec.Struct]:
    """A Struct type that reads a ref's JSON object: exactly its five keys, in any order,
    each of its type and within SampleRef's rules (and these bounds, None: none).

    With ``id_pattern`` False the sample id's characters are left to the
    :class:`RefReader` (``check_ids``), which checks a frame's ids at once: msgspec
    calls Python's ``re`` for a pattern, once per ref, two thirds of its decoding time.

    ``specs`` stays raw text, for :meth:`RefReader.read` to decode once per distinct
    text (a producer's refs share their specs). A ref it refuses is not necessarily
    bad: the caller decodes it on the generic path, which says.
    """
    pattern = _SAMPLE_ID if id_pattern else None
    return msgspec.defstruct(
        "RefJson",
        [
            ("generation", Annotated[int, Meta(ge=0, le=max_generation)]),
            ("metadata", dict[str, Any]),
            ("sample_id", Annotated[str, Meta(min_length=1, max_length=256, pattern=pattern)]),
            ("specs", msgspec.Raw),
            ("store", Annotated[str, Meta(min_length=1, max_length=max_store_chars)]),
        ],
        forbid_unknown_fields=True,
        gc=False,  # it holds no cycle; untracked, it does not bring the next collection nearer
    )


class _SpecJson(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]


_SPECS = msgspec.json.Decoder(dict[str, _SpecJson])
_new = object.__new__


class RefReader:
    """Builds the SampleRefs ``ref_from_parsed(data, check)`` would, from :func:`ref_struct`'s.

    :meth:`read` returns None where a ref's specs are unusual (an invalid spec, more
    than ``max_features``, one that ``check`` refuses, and with ``unique_keys`` a key
    given twice), and the caller decodes that ref on the generic path, which raises
    the precise error. With ``check_ids`` it also checks the sample ids (for structs
    of ``ref_struct(id_pattern=False)``), and gives None where one is invalid.
    """

    def __init__(
        self,
        check: SpecCheck = no_check,
        *,
        max_features: int | None = None,
        unique_keys: bool = False,
        check_ids: bool = False,
    ) -> None:
        self._check = check
        self._check_ids = check_ids
        self._max_features = float("inf") if max_features is None else max_features
        self._unique_keys = unique_keys
        # The raw text of a set of specs -> its FeatureSpecs, valid and checked.
        self._specs: dict[bytes, dict[str, FeatureSpec]] = {}

    def read(self, data: Any) -> SampleRef | None:
        """The SampleRef of ``data`` (a :func:`ref_struct`), or None where the generic path
        must decide."""
        if self._check_ids and not _valid_ids([data.sample_id]):
            return None
        raw = bytes(data.specs)
        specs = self._specs.get(raw)
        if specs is None:
            specs = self._read_specs(raw)
            if specs is None:
                return None
        ref = _new(SampleRef)
        fields = ref.__dict__
        fields["sample_id"] = data.sample_id
        fields["store"] = data.store
        fields["generation"] = data.generation
        fields["specs"] = specs.copy()
        fields["metadata"] = data.metadata
        return ref

    def read_all(
        self, items: list[Any], *, lazy: bool = False
    ) -> list[SampleRef] | RefBatch | None:
        """:meth:`read` of each of ``items``; None if any gives None.

        With ``lazy``, the refs are checked now and built as they are taken
        (:class:`RefBatch`), so that a receiver's buffer holds no objects the garbage
        collector tracks, only one list per frame. Consecutive refs with the same specs
        share one specs dict (a copy of the cached one, so no ref reaches the cache).
        Why both: each tracked object per buffered ref is moved by the collections of
        the younger generations to the oldest, and so brings on full collections (in
        a process that imported torch, a tenth of a second each).
        """
        if self._check_ids and not _valid_ids([data.sample_id for data in items]):
            return None
        shared = []
        append = shared.append
        last = specs = None
        for data in items:
            if data.specs != last:  # a frame's refs mostly share their specs' text
                last = data.specs
                raw = bytes(last)
                specs = self._specs.get(raw)
                if specs is None and (specs := self._read_specs(raw)) is None:
                    return None
                specs = specs.copy()
            append(specs)
        batch = RefBatch(items, shared)
        return batch if lazy else batch.build()

    def _read_specs(self, raw: bytes) -> dict[str, FeatureSpec] | None:
        if not _FAST:
            return None
        try:
            parsed = _SPECS.decode(raw)
            if len(parsed) > self._max_features:
                return None
            # Valid names and dtypes hold no colon: each spec has three keys' colons.
            if self._unique_keys and raw.count(b":") != 3 * len(parsed):
                return None
            specs = {}
            for name, spec in parsed.items():  # _parsed_spec validates the name
                specs[name] = _parsed_spec(name, spec.dtype, spec.shape, self._check)
        except (DataflowError, ValueError, TypeError, RecursionError):
            return None
        if len(self._specs) >= _CACHE_SIZE:
            self._specs.clear()
        self._specs[raw] = specs
        return specs


class RefBatch:
    """Refs that :meth:`RefReader.read_all` checked, built when taken (:meth:`build`).

    Sliced, it gives the batch of those refs; indexed, the one ref.
    """

    __slots__ = ("_items", "_specs")

    def __init__(self, items: list[Any], specs: list[dict[str, FeatureSpec]]) -> None:
        self._items = items
        self._specs = specs

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: slice | int) -> Any:
        if isinstance(index, slice):
            return RefBatch(self._items[index], self._specs[index])
        return RefBatch([self._items[index]], [self._specs[index]]).build()[0]

    def build(self) -> list[SampleRef]:
        """The SampleRefs, in order (new ones at each call)."""
        refs = []
        append = refs.append
        for data, specs in zip(self._items, self._specs, strict=True):
            ref = _new(SampleRef)
            fields = ref.__dict__
            fields["sample_id"] = data.sample_id
            fields["store"] = data.store
            fields["generation"] = data.generation
            fields["specs"] = specs
            fields["metadata"] = data.metadata
            append(ref)
        return refs


def _valid_ids(ids: list[str]) -> bool:
    """Whether each of ``ids`` (1-256 characters each, as ref_struct checks) matches
    ``_SAMPLE_ID``: one regex over them all, joined by a newline that no id may hold."""
    joined = "\n".join(ids)
    return (
        _JOINED_IDS.fullmatch(joined) is not None
        and joined.count("\n") == len(ids) - 1
        and ".." not in joined
        and not joined.startswith("/")
        and "\n/" not in joined
    )


_REF = msgspec.json.Decoder(ref_struct())
_LEDGER = RefReader()


def ref_from_json(text: str | bytes) -> SampleRef:
    """The ref a commit event's JSON holds: ``ref_from_parsed(json.loads(text))``, compiled.

    The same refs and the same errors as that generic path (which decodes whatever
    msgspec does not, such as NaN, a lone surrogate, an integer beyond 64 bits).
    """
    try:
        ref = _LEDGER.read(_REF.decode(text))
    except (ValueError, RecursionError):  # msgspec.DecodeError, UnicodeDecodeError
        ref = None
    return ref_from_parsed(json.loads(text)) if ref is None else ref
