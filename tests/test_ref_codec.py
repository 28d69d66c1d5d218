"""The compiled codec (msgspec) gives exactly what the strict Python paths give.

Every valid ref round trips through the ledger's and the wire's JSON, byte for byte where
the ledger compares texts; and hostile JSON (repeated keys, NaN, huge numbers, deep
nesting, escaped keys, stray bytes) is accepted by the compiled path only where the
strict path accepts it, with the same value, so whatever the strict path refused is
still refused.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import BadFrameError, FeatureSpec, SampleRef
from dataflow.model._ref_codec import RefBatch, _valid_ids, ref_from_json, ref_json
from dataflow.model._refs import ref_from_ledger, validate_sample_id
from dataflow.streams._wire import (
    _TENSOR_MAGIC,
    _WRITER,
    MAX_INT,
    CreditFrame,
    EofAckFrame,
    EofFrame,
    HeartbeatFrame,
    RefFrame,
    RefsFrame,
    _fast_decode,
    _strict_decode,
    decode,
    encode,
    encode_ref_body,
    encode_refs,
    ref_bodies,
    ref_body,
)
from dataflow.testing import sample_ids

# Strings that make the codecs differ if anything does: colons (the repeated-key check
# counts them), quotes, backslashes, non-ASCII, DEL, control characters, surrogate pairs.
awkward_text = st.text(alphabet=st.sampled_from(list('ab:"\\é\x7f\n\t/ 😀\u2028')), max_size=8)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-5, 1e-4, 1e16, 1e300, 5e-324, -0.0, 0.0, 123.456]),
    awkward_text,
)
metadata_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(awkward_text, inner, max_size=3),
    max_leaves=8,
)
spec_values = st.builds(
    FeatureSpec,
    st.lists(st.integers(0, 2**10), max_size=4).map(tuple),  # within the wire's limits
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]),
)
refs = st.builds(
    SampleRef,
    sample_id=sample_ids(),
    store=st.sampled_from(["mem://x", "dir:///d:1", "mooncake://h:1?n=a", "é://ü"]),
    generation=st.integers(0, MAX_INT),
    specs=st.dictionaries(st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True), spec_values),
    metadata=st.dictionaries(awkward_text, metadata_values, max_size=4),
)


def same(a: SampleRef, b: SampleRef) -> bool:
    """Equal, and equal in every way the text shows (1 against 1.0, -0.0, key order)."""
    return (
        a == b
        and a.to_json() == b.to_json()
        and repr(a.metadata) == repr(b.metadata)
        and list(a.specs) == list(b.specs)
    )


# -- the ledger's JSON -----------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(ref=refs)
def test_ref_json_is_to_json_byte_for_byte(ref: SampleRef) -> None:
    assert ref_json(ref) == ref.to_json()


@settings(max_examples=300, deadline=None)
@given(ref=refs)
def test_every_valid_ref_round_trips(ref: SampleRef) -> None:
    text = ref_json(ref)
    got = ref_from_json(text)
    assert got == ref and got.to_json() == text  # the text sorts the metadata's keys
    assert same(got, ref_from_ledger(text))
    assert type(got.specs) is dict and all(type(s) is FeatureSpec for s in got.specs.values())
    assert ref_from_json(text.encode()) == ref


def outcome(decoder, data):  # type: ignore[no-untyped-def]
    try:
        ref = decoder(data)
    except (ValueError, TypeError, RecursionError):  # what the strict paths raise
        return "refused"
    return ("ok", ref.to_json(), repr(ref.metadata), list(ref.specs))


# -- hostile JSON ------------------------------------------------------------------------------
_KEY = re.compile(rb'"(?:[^"\\]|\\.)*"\s*:')
_NUMBER = re.compile(rb"(?<![\w.\"])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1.0", b"-0", b"1E2",
           b"0.1e-400", str(2**64).encode(), str(2**70).encode(), str(-(2**63) - 1).encode(),
           str(2**63).encode(), b"true", b"null", b'"7"']  # fmt: skip
VALUES = [b"1", b'"x"', b"{}", b"[]", b"null", b'"a:b"', b'{"k":1}', b'"../x"', b"-1"]


@st.composite
def hostile(draw: st.DrawFn, text: bytes) -> bytes:
    """``text`` with a few of the edits a hostile or broken peer makes."""
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["repeat", "number", "deep", "escape", "space", "byte"]))
        keys = [m for m in _KEY.finditer(text)]
        if edit == "repeat" and keys:  # a key given twice, with whatever value
            m = draw(st.sampled_from(keys))
            value = draw(st.sampled_from(VALUES))
            space = draw(st.sampled_from([b"", b" ", b"\n"]))
            text = text[: m.start()] + m.group() + space + value + b"," + text[m.start() :]
        elif edit == "number" and (numbers := list(_NUMBER.finditer(text))):
            m = draw(st.sampled_from(numbers))
            text = text[: m.start()] + draw(st.sampled_from(NUMBERS)) + text[m.end() :]
        elif edit == "deep" and b'"metadata":{' in text:
            depth = draw(st.sampled_from([31, 32, 33, 300, 2000, 50_000]))
            at = text.index(b'"metadata":{') + len(b'"metadata":{')
            nest = b'"deep":' + b"[" * depth + b"]" * depth
            text = text[:at] + nest + (b"" if text[at : at + 1] == b"}" else b",") + text[at:]
        elif edit == "escape" and (strings := list(_STRING.finditer(text))):
            m = draw(st.sampled_from(strings))  # one character of a string (or key) escaped
            inner = m.group()[1:-1]
            if inner and b"\\" not in inner:
                i = draw(st.integers(0, len(inner) - 1))
                char = inner[i : i + 1]
                escaped = draw(st.sampled_from([b"\\u%04x" % inner[i], b"\\u003a", b"\\ud800"]))
                escaped = escaped if char.isascii() else char
                new = b'"' + inner[:i] + escaped + inner[i + 1 :] + b'"'
                text = text[: m.start()] + new + text[m.end() :]
        elif edit == "space" and keys:
            m = draw(st.sampled_from(keys))
            key = m.group().rstrip(b":").rstrip()
            text = text[: m.start()] + key + b" \n\t:" + text[m.end() :]
        elif edit == "byte" and text:
            i = draw(st.integers(0, len(text) - 1))
            text = text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1 :]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ref=refs)
def test_hostile_ref_json_is_decoded_as_the_generic_path_does(data, ref: SampleRef) -> None:
    text = data.draw(hostile(ref.to_json().encode()))
    assert outcome(ref_from_json, text) == outcome(ref_from_ledger, text)


def frames() -> st.SearchStrategy[object]:
    ids = st.text(alphabet=st.sampled_from(list("ab:0é")), min_size=1, max_size=10)
    counts = st.integers(0, 2**40)
    return st.one_of(
        st.builds(RefFrame, ids, counts, refs),
        st.builds(RefsFrame, ids, counts, st.lists(refs, min_size=1, max_size=3).map(tuple)),
        st.builds(HeartbeatFrame, ids),
        st.builds(EofFrame, ids),
        st.builds(CreditFrame, ids, counts, counts),
        st.builds(EofAckFrame, ids),
    )


def strict(data: bytes) -> object:
    if data.startswith(_TENSOR_MAGIC):  # decode's first check, before any JSON
        return "tensor"
    try:
        return _strict_decode(data)
    except BadFrameError as exc:
        return exc.kind  # type: ignore[attr-defined]


def agrees(data: bytes) -> None:
    """The compiled path gives a frame only where the strict path gives the same."""
    fast = _fast_decode(data)
    if fast is None:
        return
    slow = _strict_decode(data)  # raises, and fails the test, where it refuses
    assert fast == slow
    got = fast.refs if isinstance(fast, RefsFrame) else [getattr(fast, "ref", None)]
    want = slow.refs if isinstance(slow, RefsFrame) else [getattr(slow, "ref", None)]
    for a, b in zip(got, want, strict=True):
        assert a is b is None or same(a, b)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(frame=frames())
def test_every_valid_frame_takes_the_compiled_path(frame) -> None:
    data = encode(frame)
    assert _fast_decode(data) == frame == _strict_decode(data) == decode([data])
    agrees(data)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), frame=frames(), pretty=st.booleans())
def test_hostile_frames_are_decoded_as_the_strict_path_does(data, frame, pretty: bool) -> None:
    text = encode(frame)
    if pretty:  # the same frame as another JSON writer spaces it
        text = json.dumps(json.loads(text), indent=1, ensure_ascii=data.draw(st.booleans()))
        text = text.encode()
    mutated = data.draw(hostile(text))
    agrees(mutated)
    try:
        got: object = decode([mutated])
    except BadFrameError as exc:
        got = exc.kind  # type: ignore[attr-defined]
    assert got == strict(mutated)


# -- repeated keys, everywhere they were refused -------------------------------------------------
REF = (
    '{"generation":1,"metadata":{"k":{"n":1}},"sample_id":"s-1",'
    '"specs":{"x":{"dtype":"int8","shape":[2]}},"store":"mem://m"}'
)
FRAMES = [
    '{"v":1,"type":"ref","receiver":"r","line":1,"ref":' + REF + "}",
    '{"v":2,"type":"refs","receiver":"r","line":1,"refs":[' + REF + "," + REF + "]}",
]


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("v", "1"),
        ("type", '"ref"'),
        ("receiver", '"q"'),
        ("line", "2"),
        ("generation", "2"),
        ("metadata", "{}"),
        ("k", "1"),
        ("n", "2"),
        ("sample_id", '"s-2"'),
        ("specs", "{}"),
        ("x", '{"dtype":"int8","shape":[1]}'),
        ("dtype", '"int16"'),
        ("shape", "[3]"),
        ("store", '"mem://n"'),
    ],
)
@pytest.mark.parametrize("spelling", ["plain", "space", "escaped", "same value"])
def test_a_repeated_key_is_refused_wherever_it_is(
    frame: str, key: str, value: str, spelling: str
) -> None:
    at = frame.rindex(f'"{key}":')  # the last occurrence: inside the last ref
    original = frame[at + len(key) + 3 :]
    if spelling == "same value":  # the same key and value twice: still refused
        value = json.dumps(json.JSONDecoder().raw_decode(original)[0], separators=(",", ":"))
    if key == "type" and frame is FRAMES[1]:
        value = '"refs"'
    name = f'"{key}"'
    if spelling == "escaped":
        name = '"' + "".join(f"\\u{ord(c):04x}" for c in key) + '"'
    colon = " :" if spelling == "space" else ":"
    data = (frame[:at] + f"{name}{colon}{value}," + frame[at:]).encode()
    with pytest.raises(BadFrameError, match="duplicate key") as info:
        decode([data])
    assert info.value.kind == "malformed"  # type: ignore[attr-defined]
    assert _fast_decode(data) is None


def test_the_frames_without_a_repeat_are_fine() -> None:
    for frame in FRAMES:
        assert _fast_decode(frame.encode()) is not None
        assert decode([frame.encode()]) == _strict_decode(frame.encode())


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"n":1', '"n":NaN'),
        ('"n":1', '"n":Infinity'),
        ('"n":1', '"n":1e999'),
        ('"n":1', '"n":' + "[" * 5000 + "]" * 5000),
        ('"generation":1', '"generation":' + str(2**70)),
        ('"line":1', '"line":' + str(2**64)),
        ('"shape":[2]', '"shape":[-1]'),
        ('"dtype":"int8"', '"dtype":"Tensor"'),
        ('"sample_id":"s-1"', '"sample_id":"s\\u002e\\u002e/x"'),
    ],
)
def test_what_the_strict_path_refuses_stays_refused(old: str, new: str) -> None:
    for frame in FRAMES:
        data = frame.replace(old, new, 1).encode()
        with pytest.raises(BadFrameError) as info:
            decode([data])
        assert info.value.kind == "malformed"  # type: ignore[attr-defined]


def test_huge_ints_in_metadata_are_plain_data_as_before() -> None:
    data = FRAMES[0].replace('"n":1', '"n":' + str(2**70)).encode()
    assert _fast_decode(data) == _strict_decode(data)
    assert decode([data]).ref.metadata == {"k": {"n": 2**70}}  # type: ignore[union-attr]


# -- the sender's bodies (RefWriter) and the receiver's sample id check -----------------------
@settings(max_examples=300, deadline=None)
@given(batch=st.lists(refs, min_size=1, max_size=4))
def test_a_batch_encoded_at_once_decodes_to_what_to_json_gives(batch: list[SampleRef]) -> None:
    assert _WRITER.bodies(batch) is not None  # every valid ref takes the compiled path
    bodies = ref_bodies(batch, 1 << 20)
    for ref, body in zip(batch, bodies, strict=True):
        assert json.loads(body) == json.loads(ref.to_json())
    fast = decode([encode_refs("r", 1, bodies)])
    slow = decode([encode_refs("r", 1, [encode_ref_body(ref) for ref in batch])])
    assert fast == slow
    got, want = (f.refs if isinstance(f, RefsFrame) else [f.ref] for f in (fast, slow))  # type: ignore[union-attr]
    assert all(same(a, b) for a, b in zip(got, want, strict=True))


def test_refs_of_a_frame_share_their_specs_but_not_with_later_frames() -> None:
    # One specs dict for a frame's refs with the same specs, not one each: fewer objects
    # in flight for the garbage collector (see RefReader.read_all). The dict is the
    # frame's own: nothing done to it reaches the refs of another frame.
    spec = {"x": FeatureSpec((2, 3), torch.float32)}
    other = {"y": FeatureSpec((1,), torch.int64)}
    batch = [SampleRef(f"s{i}", "mem://x", 1, specs=spec if i != 2 else other) for i in range(5)]

    def received() -> tuple[SampleRef, ...]:
        frame = decode([encode_refs("r", 1, ref_bodies(batch, 1 << 20))])
        assert isinstance(frame, RefsFrame) and list(frame.refs) == batch
        return frame.refs

    first = received()
    assert first[0].specs is first[1].specs and first[3].specs is first[4].specs
    assert first[2].specs == other and first[1].specs is not first[3].specs
    first[0].specs.clear()  # type: ignore[attr-defined]  # what no one should do to a ref
    again = received()
    assert again[0].specs == spec and again[0].specs is not first[0].specs


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(refs, min_size=2, max_size=6), cut=st.integers(0, 6))
def test_a_lazy_frame_builds_the_refs_an_eager_one_holds(batch: list[SampleRef], cut: int) -> None:
    # What a receiver buffers: refs checked on receipt, built as receive hands them out.
    data = encode_refs("r", 1, ref_bodies(batch, 1 << 20))
    eager, lazy = decode([data]), decode([data], lazy=True)
    assert isinstance(eager, RefsFrame) and isinstance(lazy, RefsFrame)
    pending = lazy.refs
    assert isinstance(pending, RefBatch) and len(pending) == len(batch)
    assert pending.build() == list(eager.refs) == batch
    assert pending[:cut].build() + pending[cut:].build() == batch
    assert [pending[i] for i in range(len(batch))] == batch
    assert all(same(a, b) for a, b in zip(pending.build(), eager.refs, strict=True))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.lists(refs, min_size=1, max_size=3))
def test_hostile_batches_are_decoded_as_the_strict_path_does(data, batch) -> None:
    mutated = data.draw(hostile(encode_refs("r", 1, ref_bodies(batch, 1 << 20))))
    agrees(mutated)
    try:
        got: object = decode([mutated])
    except BadFrameError as exc:
        got = exc.kind  # type: ignore[attr-defined]
    assert got == strict(mutated)


def _spoiled(how: str) -> SampleRef:
    ref = SampleRef("s-1", "mem://m", 1, {"x": FeatureSpec((2,), torch.int8)}, {"k": 1})
    if how == "tensor":
        ref.metadata["k"] = torch.zeros(2)  # type: ignore[index]
    elif how == "nan":
        ref.metadata["k"] = [float("nan")]  # type: ignore[index]
    elif how == "object":
        ref.metadata["k"] = {1, 2}  # type: ignore[index]
    elif how == "generation":
        object.__setattr__(ref, "generation", MAX_INT + 1)
    elif how == "store":
        object.__setattr__(ref, "store", "m" * 5000)
    elif how == "shape":
        object.__setattr__(ref, "specs", {"x": FeatureSpec((1 << 49,), torch.int8)})
    elif how == "surrogate":
        ref.metadata["k"] = "\ud800"  # type: ignore[index]
    return ref


@pytest.mark.parametrize(
    "how", ["tensor", "nan", "object", "generation", "store", "shape", "surrogate", "none"]
)
@pytest.mark.parametrize("limit", [1 << 20, 256])
def test_ref_bodies_refuse_and_accept_as_ref_body_does(how: str, limit: int) -> None:
    ref = _spoiled(how)
    good = SampleRef("s-0", "mem://m", 1)

    def result(encode):  # type: ignore[no-untyped-def]
        try:
            return [json.loads(body) for body in encode()]
        except Exception as exc:
            return type(exc), str(exc)

    want = result(lambda: [ref_body(good, limit), ref_body(ref, limit)])
    assert result(lambda: ref_bodies([good, ref], limit)) == want


@settings(max_examples=500, deadline=None)
@given(
    ids=st.lists(
        sample_ids(max_size=12) | st.text(st.sampled_from("a./\n:-é"), min_size=1, max_size=6),
        min_size=1,
        max_size=5,
    )
)
def test_sample_ids_checked_together_as_one_by_one(ids: list[str]) -> None:
    def valid(sample_id: str) -> bool:
        try:
            validate_sample_id(sample_id)
        except ValueError:
            return False
        return True

    assert _valid_ids(ids) == all(map(valid, ids))
