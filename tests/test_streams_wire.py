"""The ref stream wire format: round trips, a property test, and every kind of bad frame."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflow.streams
from dataflow import BadFrameError, FeatureSpec, SampleRef, TensorInRefError
from dataflow.streams import _wire
from dataflow.streams._wire import (
    WIRE_VERSION,
    CreditFrame,
    EofAckFrame,
    EofFrame,
    HeartbeatFrame,
    RefFrame,
    decode,
    encode,
    encode_ref,
    encode_ref_body,
    ref_body,
)

RECEIVER = "0" * 32


def make_ref(sample_id: str = "s-1", **metadata: object) -> SampleRef:
    specs = {"x": FeatureSpec((2, 3), torch.float32), "mask": FeatureSpec((), torch.bool)}
    return SampleRef(sample_id, "mem://store", 7, specs=specs, metadata=metadata)


def kind_of(parts: list[bytes], max_bytes: int = 1 << 20) -> str:
    with pytest.raises(BadFrameError) as info:
        decode(parts, max_bytes=max_bytes)
    return info.value.kind  # type: ignore[attr-defined]


def test_public_names() -> None:
    assert dataflow.streams.__all__ == sorted(dataflow.streams.__all__)
    assert set(dataflow.streams.__all__) == {
        "CurveClientConfig",
        "CurveServerConfig",
        "MemoryRefReceiver",
        "MemoryRefSender",
        "MemoryStream",
        "ReceiverConfig",
        "ReceiverStats",
        "SenderConfig",
        "SenderStats",
        "ZmqRefReceiver",
        "ZmqRefSender",
    }


@pytest.mark.parametrize(
    "frame",
    [
        RefFrame(RECEIVER, 3, make_ref(step=1, tags=["a", "b"], nested={"f": 0.5})),
        HeartbeatFrame("p0"),
        EofFrame("p0"),
        CreditFrame(RECEIVER, 1, 64),
        EofAckFrame(RECEIVER),
    ],
)
def test_round_trip(frame: object) -> None:
    data = encode(frame)  # type: ignore[arg-type]
    obj = json.loads(data)
    assert obj["v"] == WIRE_VERSION == 1
    assert decode([data]) == frame


@settings(max_examples=200, deadline=None)
@given(receiver=st.text(min_size=1, max_size=40), line=st.integers(0, 2**63 - 1))
def test_credit_frames_are_json_dumps_bytes(receiver: str, line: int) -> None:
    frame = CreditFrame(receiver, line, line // 2)
    want = {"v": WIRE_VERSION, "type": "credit", "receiver": receiver, "line": line}
    want["granted"] = line // 2
    assert encode(frame) == json.dumps(want, separators=(",", ":")).encode()


def test_ref_frame_layout() -> None:
    ref = make_ref()
    obj = json.loads(encode_ref(RECEIVER, 2, encode_ref_body(ref)))
    assert obj == {"v": 1, "type": "ref", "receiver": RECEIVER, "line": 2, "ref": ref.to_dict()}


def test_sender_side_refuses_tensors() -> None:
    ref = make_ref()
    ref.metadata["hidden"] = torch.ones(2)  # type: ignore[index]
    with pytest.raises(TensorInRefError):
        encode_ref_body(ref)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
sample_ids = st.from_regex(r"[A-Za-z0-9_:-][A-Za-z0-9._:/-]{0,60}", fullmatch=True).filter(
    lambda s: ".." not in s
)
specs = st.dictionaries(
    st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True),
    st.builds(
        FeatureSpec,
        st.lists(st.integers(0, 1024), max_size=4).map(tuple),  # within MAX_FEATURE_BYTES
        st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]),
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    sample_id=sample_ids,
    generation=st.integers(0, 2**62),
    specs=specs,
    metadata=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    line=st.integers(0, 2**40),
)
def test_ref_round_trip_property(
    sample_id: str, generation: int, specs: dict, metadata: dict, line: int
) -> None:
    ref = SampleRef(sample_id, "dir:///tmp/store", generation, specs=specs, metadata=metadata)
    frame = decode([encode_ref(RECEIVER, line, encode_ref_body(ref))])
    assert frame == RefFrame(RECEIVER, line, ref)


@settings(max_examples=200, deadline=None)
@given(sample_id=sample_ids, generation=st.integers(0, 2**62), specs=specs, metadata=json_values)
def test_fast_codec_matches_sample_ref_json(
    sample_id: str, generation: int, specs: dict, metadata: object
) -> None:
    ref = SampleRef(sample_id, "mem://s", generation, specs=specs, metadata={"m": metadata})
    assert json.loads(encode_ref_body(ref)) == json.loads(ref.to_json())
    assert _wire._fast_ref(json.loads(ref.to_json())) == SampleRef.from_json(ref.to_json())


maybe_bad = st.one_of(
    json_values,
    st.sampled_from(["s-1", "", "../x", "/abs", "a b", 0, -1, 2**70, True, 1.5, [], {}]),
)
spec_dicts = st.one_of(
    st.fixed_dictionaries({"shape": st.lists(maybe_bad, max_size=3), "dtype": maybe_bad}),
    st.fixed_dictionaries(
        {
            "shape": st.lists(st.integers(-2, 9), max_size=3),
            "dtype": st.sampled_from(["float32", "bool", "int8", "Tensor", "float"]),
        }
    ),
    maybe_bad,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_decode_only_ever_raises_bad_frame(data: bytes) -> None:
    try:
        decode([data])
    except BadFrameError as exc:
        assert exc.kind in {"malformed", "oversized", "tensor", "version"}  # type: ignore[attr-defined]


def good_ref_frame() -> dict:
    return {"v": 1, "type": "ref", "receiver": RECEIVER, "line": 1, "ref": make_ref().to_dict()}


def dumps(obj: object) -> bytes:
    return json.dumps(obj).encode()


def with_spec(shape: list[int], dtype: str = "float32") -> bytes:
    ref = {**make_ref().to_dict(), "specs": {"x": {"shape": shape, "dtype": dtype}}}
    return dumps({**good_ref_frame(), "ref": ref})


def with_ref(**fields: object) -> bytes:
    return dumps({**good_ref_frame(), "ref": {**make_ref().to_dict(), **fields}})


def repeat_key(data: bytes, key: str, value: str) -> bytes:
    """``data`` with ``"key": value`` written a second time, after the first."""
    first = data.index(f'"{key}": '.encode())
    return data[:first] + f'"{key}": {value}, '.encode() + data[first:]


@pytest.mark.parametrize(
    ("parts", "kind"),
    [
        ([b"\xff\xfe not utf-8"], "malformed"),
        ([b"{not json"], "malformed"),
        ([b"[1, 2]"], "malformed"),
        ([b"[" * 100_000], "malformed"),
        ([dumps({"type": "hb", "producer": "p"})], "malformed"),
        ([dumps({"v": "1", "type": "hb", "producer": "p"})], "malformed"),
        ([dumps({"v": 1, "type": "gossip", "producer": "p"})], "malformed"),
        ([dumps({"v": 1, "type": {}, "producer": "p"})], "malformed"),  # unhashable type
        ([dumps({"v": 1, "type": ["hb"], "producer": "p"})], "malformed"),
        ([dumps({"v": 1, "type": "hb", "producer": "p", "extra": 1})], "malformed"),
        ([dumps({"v": 1, "type": "hb", "producer": ""})], "malformed"),
        (
            [dumps({"v": 1, "type": "credit", "receiver": RECEIVER, "line": 1, "granted": -1})],
            "malformed",
        ),
        ([dumps({**good_ref_frame(), "ref": {"sample_id": "../etc"}})], "malformed"),
        ([dumps({**good_ref_frame(), "line": True})], "malformed"),
        ([dumps({**good_ref_frame(), "line": 2**63})], "malformed"),
        # a key given twice: json.loads keeps the last, another reader the first
        (
            [repeat_key(dumps({"v": 1, "type": "hb", "producer": "p"}), "producer", '"q"')],
            "malformed",
        ),
        ([repeat_key(dumps(good_ref_frame()), "sample_id", '"s-2"')], "malformed"),
        ([repeat_key(dumps(good_ref_frame()), "receiver", f'"{"1" * 32}"')], "malformed"),
        (
            [repeat_key(dumps(good_ref_frame()), "x", '{"shape": [1], "dtype": "int8"}')],
            "malformed",
        ),
        ([repeat_key(with_ref(metadata={"k": 1}), "k", "2")], "malformed"),
        # numbers no ref may hold: 1e999 is valid JSON that reads as inf
        ([with_ref(metadata={"k": 1.5}).replace(b"1.5", b"1e999")], "malformed"),
        ([with_ref(metadata={"k": 1.5}).replace(b"1.5", b"-1e999")], "malformed"),
        ([with_ref(metadata={"k": 1.5}).replace(b"1.5", b"NaN")], "malformed"),
        # beyond the wire's limits on what a ref describes
        ([with_spec([2**62, 2**62])], "malformed"),
        ([with_spec([2**48, 2])], "malformed"),
        ([with_spec([0, 2**49])], "malformed"),
        ([with_spec([1] * 65)], "malformed"),
        ([with_spec([-1, 4])], "malformed"),
        (
            [with_ref(specs={f"f{i}": {"shape": [1], "dtype": "int8"} for i in range(1025)})],
            "malformed",
        ),
        ([with_ref(generation=2**63)], "malformed"),
        ([with_ref(store="m" * 4097)], "malformed"),
        ([dumps({"v": 2, "type": "hb", "producer": "p"})], "version"),
        ([dumps({"v": 0, "type": "ref"})], "version"),
        ([dumps(good_ref_frame()), b"\x00" * 64], "tensor"),
        ([pickle.dumps(torch.ones(3))], "tensor"),
        ([pickle.dumps(np.ones(3))], "tensor"),
        ([b"\x93NUMPY\x01\x00"], "tensor"),
        ([b"PK\x03\x04 torch.save archive"], "tensor"),
    ],
)
def test_bad_frames_are_classified(parts: list[bytes], kind: str) -> None:
    assert kind_of(parts) == kind


def test_the_limits_themselves_are_accepted() -> None:
    frames = [
        with_spec([2**48], "int8"),
        with_spec([2**46], "float32"),
        with_spec([1] * 64),
        with_spec([0, 2**48]),
        with_ref(specs={f"f{i}": {"shape": [1], "dtype": "int8"} for i in range(1024)}),
        with_ref(generation=2**63 - 1),
        with_ref(store="m" * 4096),
        dumps({**good_ref_frame(), "line": 2**63 - 1}),
    ]
    for data in frames:
        assert isinstance(decode([data]), RefFrame)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.sampled_from([0, 1, 3, 2**16, 2**24, 2**46, 2**48, 2**49, 2**62]), max_size=4)
    | st.lists(st.just(1), min_size=60, max_size=70),
    dtype=st.sampled_from([torch.int8, torch.float32, torch.float64]),
    features=st.sampled_from([0, 1, 1024, 1025]),
    generation=st.sampled_from([0, 2**63 - 1, 2**63, 2**70]),
    store=st.sampled_from(["mem://s", "m" * 4096, "m" * 4097]),
)
def test_what_a_sender_refuses_is_what_a_receiver_drops(
    shape: list[int], dtype: torch.dtype, features: int, generation: int, store: str
) -> None:
    specs = {"x": FeatureSpec(tuple(shape), dtype)}
    specs.update({f"f{i}": FeatureSpec((1,), torch.int8) for i in range(features)})
    ref = SampleRef("s-1", store, generation, specs=specs)
    try:
        ref_body(ref, 1 << 20)
        refused = False
    except BadFrameError as exc:
        assert exc.kind == "malformed"  # type: ignore[attr-defined]
        refused = True
    try:  # the same ref, encoded by hand as a peer that skips our checks would
        decode([encode_ref(RECEIVER, 1, ref.to_json().encode())])
        dropped = False
    except BadFrameError:
        dropped = True
    assert refused == dropped


def test_oversized_frame() -> None:
    data = dumps({**good_ref_frame(), "ref": make_ref(blob="x" * 5000).to_dict()})
    assert kind_of([data], max_bytes=4096) == "oversized"
    assert isinstance(decode([data], max_bytes=len(data)), RefFrame)


def test_tensor_metadata_spelled_as_json_is_only_data() -> None:
    # JSON cannot carry a tensor object; lists of numbers are plain metadata.
    frame = decode([dumps({**good_ref_frame(), "ref": make_ref(v=[1.0, 2.0]).to_dict()})])
    assert frame.ref.metadata == {"v": [1.0, 2.0]}  # type: ignore[union-attr]
