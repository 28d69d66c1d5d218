"""The JSON of a SampleRef, fast: what a commit's payload and a stream's ref frame carry.

Encoding a ref costs as much as inserting its row, and is most of a stream's
CPU time; :meth:`SampleRef.to_json` sorts keys and rebuilds every spec for
each ref. :func:`ref_json` gives its exact bytes (tests/test_ledger_commit_dedup.py
holds the two equal) several times faster: the refs of one producer share
their store and specs, so each distinct set of specs is encoded once (and
checked once, by the caller's ``check``), and the rest is joined in
``to_json``'s key order. The decode side is :func:`dataflow.model._refs.ref_from_parsed`.
"""

from __future__ import annotations

import dataclasses
import functools
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

from dataflow.model._refs import _JSON, _REF_FIELDS, FeatureSpec, SampleRef, SpecCheck

#: Whether SampleRef still has the fields joined here; if it ever grows another,
#: every ref goes through ``to_json``.
_FAST = tuple(f.name for f in dataclasses.fields(SampleRef)) == _REF_FIELDS


def no_check(name: str, spec: FeatureSpec) -> None:
    """The default ``check`` of :func:`ref_json`: every valid spec is fine."""


def ref_json(ref: SampleRef, check: SpecCheck = no_check) -> str:
    """``ref.to_json()``, byte for byte, after ``check(name, spec)`` of each spec.

    ``check`` runs once per distinct set of specs (a set it raises for is not
    cached, and raises every time). A ref that is not plain data (metadata
    mutated after construction, a spec that is not a FeatureSpec) goes
    through ``to_json``, which says what is wrong.
    """
    if not _FAST or type(ref.generation) is not int or type(ref.store) is not str:
        return _checked_to_json(ref, check)
    specs = ref.specs
    try:
        if len(specs) == 1:  # most refs: no list to build
            for name, spec in specs.items():
                key: tuple[Any, ...] = ((name, spec.shape, spec.dtype),)
        else:
            key = tuple([(name, spec.shape, spec.dtype) for name, spec in specs.items()])
        specs_json = _specs_json(key, check)
        metadata = _JSON.encode(ref.metadata) if ref.metadata else "{}"
        return (
            f'{{"generation":{ref.generation},"metadata":{metadata},'
            f'"sample_id":{_quote(ref.sample_id)},"specs":{specs_json},'
            f'"store":{_store_json(ref.store)}}}'
        )
    except (TypeError, AttributeError):  # not plain data after all: let to_json say what
        return _checked_to_json(ref, check)


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
