"""ref_from_parsed: the ledger's and the wire's decoder of parsed ref JSON equals SampleRef's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow import DataflowError, FeatureSpec, InvalidRefError, SampleRef
from dataflow.model._refs import _REF_FIELDS, ref_from_parsed
from dataflow.streams import _wire
from dataflow.streams._wire import check_limits
from tests.test_streams_wire import json_values, maybe_bad, sample_ids, spec_dicts, specs

#: Each fast decoder, and the generic path whose verdicts it must give.
DECODERS = {
    "ledger": (ref_from_parsed, SampleRef.from_dict),
    "wire": (_wire._fast_ref, lambda data: check_limits(SampleRef.from_dict(data))),
}


def test_fields_are_the_ones_it_sets() -> None:
    # A field SampleRef grows would be left unset by the fast path.
    assert tuple(f.name for f in dataclasses.fields(SampleRef)) == _REF_FIELDS


refs = st.builds(
    SampleRef,
    sample_id=sample_ids,
    store=st.just("dir:///d"),
    generation=st.integers(0, 2**62),
    specs=specs,
    metadata=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(ref=refs)
def test_round_trip(ref: SampleRef) -> None:
    got = ref_from_parsed(json.loads(ref.to_json()))
    assert got == ref
    assert type(got.specs) is dict and all(type(s) is FeatureSpec for s in got.specs.values())
    assert got.to_json() == ref.to_json()


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=400, deadline=None)
@given(
    sample_id=maybe_bad,
    store=maybe_bad,
    generation=maybe_bad,
    specs=st.one_of(
        st.dictionaries(st.sampled_from(["x", "y.z", "", "bad name"]), spec_dicts, max_size=3),
        maybe_bad,
    ),
    metadata=maybe_bad,
)
def test_fast_decode_accepts_exactly_what_sample_ref_accepts(
    decoder: str, **fields: object
) -> None:
    fast, generic = DECODERS[decoder]
    data = json.loads(json.dumps(fields))
    try:
        expected: object = generic(json.loads(json.dumps(data)))
    except (DataflowError, ValueError, TypeError):
        expected = "refused"
    try:
        got: object = fast(data)
    except (DataflowError, ValueError, TypeError):
        got = "refused"
    assert got == expected


def test_check_sees_every_spec_and_its_refusal_is_not_cached() -> None:
    data = json.loads(SampleRef("s", "mem://m", 0, {"x": FeatureSpec((3,), torch.int8)}).to_json())
    seen: list[tuple[str, FeatureSpec]] = []

    def refuse(name: str, spec: FeatureSpec) -> None:
        seen.append((name, spec))
        raise InvalidRefError(f"{name} refused")

    for _ in range(2):
        with pytest.raises(InvalidRefError, match="x refused"):
            ref_from_parsed(data, refuse)
    assert seen == [("x", FeatureSpec((3,), torch.int8))] * 2
    assert ref_from_parsed(data).specs["x"] == FeatureSpec((3,), torch.int8)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sample_id": "../up"}, "sample"),
        ({"generation": -1}, "generation"),
        ({"generation": True}, "generation"),
        ({"store": ""}, "store"),
        ({"specs": {"x": {"shape": [-1], "dtype": "float32"}}}, "shape"),
        ({"specs": {"x": {"shape": [2], "dtype": "tensor"}}}, "dtype"),
        ({"specs": {"bad name": {"shape": [2], "dtype": "float32"}}}, "name"),
        ({"extra": 1}, "keys"),
    ],
)
def test_bad_ref_names_what_is_wrong(change: dict, match: str) -> None:
    data = {**json.loads(SampleRef("s", "mem://m", 0).to_json()), **change}
    with pytest.raises(DataflowError, match=match):
        ref_from_parsed(data)


def test_a_spec_the_ledger_decoded_is_still_checked_by_the_wire() -> None:
    huge = {"x": {"shape": [2**40, 2**20], "dtype": "float32"}}  # over the wire's limits
    data = {**json.loads(SampleRef("s", "mem://m", 0).to_json()), "specs": huge}
    assert ref_from_parsed(json.loads(json.dumps(data))).specs["x"].shape == (2**40, 2**20)
    with pytest.raises(InvalidRefError, match="bytes"):
        _wire._fast_ref(json.loads(json.dumps(data)))
