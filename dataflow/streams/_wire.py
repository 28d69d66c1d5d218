"""Wire format of ref streams: one UTF-8 JSON object per ZeroMQ frame.

Nothing is pickled: frames are JSON, decoded into SampleRefs that
``SampleRef.from_dict`` would build, which rejects anything that is not plain
data, plus the wire's own limits (``check_limits``). docs/streams.md describes
every field.

Each frame type carries the version that introduced it: ``ref``, ``hb``,
``eof``, ``credit`` and ``eof_ack`` are version 1, ``refs`` (many refs in one
frame, from ``send_many``) is version 2; so a peer that predates a type reports
a version mismatch instead of guessing at it.

Decoding is compiled (:func:`_fast_decode`, msgspec) and gives a frame only
where it is sure to give the one the strict path (:func:`_strict_decode`,
Python's ``json`` refusing repeated keys, NaN and infinities) gives; anything
else, every bad frame included, is decided by the strict path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote
from typing import Annotated

import msgspec
from msgspec import Meta

from dataflow.model._errors import BadFrameError, DataflowError, InvalidRefError, TensorInRefError
from dataflow.model._ref_codec import RefReader, RefWriter, ref_json, ref_struct
from dataflow.model._refs import (
    _REF_FIELDS,
    FeatureSpec,
    SampleRef,
    assert_no_tensors,
    ref_from_parsed,
)

WIRE_VERSION = 1
#: The version of ``refs`` frames (the other types are WIRE_VERSION).
BATCH_VERSION = 2
DEFAULT_MAX_FRAME_BYTES = 1 << 20
#: Room in a ref frame for everything around the ref's own JSON; a sender
#: refuses a ref whose JSON and this overhead exceed its max_frame_bytes.
REF_OVERHEAD = 128

# Limits on what a ref may describe, the same on both ends: ``send`` refuses a
# ref beyond them and a receiver drops it (malformed). No real sample comes
# near them; they keep a forged ref from sending a consumer off to allocate
# 2^124 bytes, or to loop over a million features, before any read fails.
MAX_FEATURES = 1024
MAX_DIMS = 64
MAX_FEATURE_BYTES = 1 << 48
MAX_STORE_CHARS = 4096
MAX_INT = (1 << 63) - 1  # generation, line, granted: what a database integer holds

# Kinds of bad frames: the keys of ReceiverStats.bad_frame_kinds.
OVERSIZED = "oversized"
MALFORMED = "malformed"
VERSION = "version"
TENSOR = "tensor"
BAD_FRAME_KINDS = (MALFORMED, OVERSIZED, TENSOR, VERSION)

# Magic bytes of the usual ways a tensor travels as bytes: pickle (also
# torch.save's legacy format), torch.save's zip archive, numpy's .npy.
_TENSOR_MAGIC = (b"\x80", b"PK\x03\x04", b"\x93NUMPY")
_MAX_ID_CHARS = 256


@dataclass(frozen=True)
class RefFrame:
    """Producer to consumer: one ref, sent against credit line ``line`` of ``receiver``."""

    receiver: str
    line: int
    ref: SampleRef


@dataclass(frozen=True)
class HeartbeatFrame:
    """Producer to consumer: ``producer`` is alive (also its introduction)."""

    producer: str


@dataclass(frozen=True)
class EofFrame:
    """Producer to consumer: ``producer`` closed; nothing follows on this connection."""

    producer: str


@dataclass(frozen=True)
class CreditFrame:
    """Consumer to producer: cumulative credit ``granted`` on line ``line`` (also a heartbeat)."""

    receiver: str
    line: int
    granted: int


@dataclass(frozen=True)
class EofAckFrame:
    """Consumer to producer: ``receiver`` has seen this producer's EOF."""

    receiver: str


@dataclass(frozen=True)
class RefsFrame:
    """Producer to consumer: refs in order, sent against credit line ``line`` of ``receiver``.

    Each ref takes one credit, as in a RefFrame; version 2 (``send_many``).
    """

    receiver: str
    line: int
    refs: tuple[SampleRef, ...]
    """The refs; a RefBatch where ``decode`` was asked for ``lazy``."""


Frame = RefFrame | RefsFrame | HeartbeatFrame | EofFrame | CreditFrame | EofAckFrame

_FIELDS: dict[str, tuple[type, frozenset[str]]] = {
    "ref": (RefFrame, frozenset({"v", "type", "receiver", "line", "ref"})),
    "refs": (RefsFrame, frozenset({"v", "type", "receiver", "line", "refs"})),
    "hb": (HeartbeatFrame, frozenset({"v", "type", "producer"})),
    "eof": (EofFrame, frozenset({"v", "type", "producer"})),
    "credit": (CreditFrame, frozenset({"v", "type", "receiver", "line", "granted"})),
    "eof_ack": (EofAckFrame, frozenset({"v", "type", "receiver"})),
}
_TYPE_OF = {cls: name for name, (cls, _) in _FIELDS.items()}
_VERSION_OF = {name: BATCH_VERSION if name == "refs" else WIRE_VERSION for name in _FIELDS}
_VERSIONS = sorted(set(_VERSION_OF.values()))


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json keeps the last of repeated keys; a frame that names a field twice
    # could be read one way here and another way by any other JSON reader.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return obj


def _finite(text: str) -> float:
    # 1e999 is valid JSON that Python reads as inf, which no ref may hold.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


_decoder = json.JSONDecoder(
    parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_object
)


def _loads(data: bytes) -> object:
    return _decoder.decode(data.decode())


def bad_frame(kind: str, message: str) -> BadFrameError:
    """A BadFrameError carrying its kind (one of BAD_FRAME_KINDS) for the stats."""
    error = BadFrameError(message)
    error.kind = kind  # type: ignore[attr-defined]
    return error


def encode_ref_body(ref: SampleRef) -> bytes:
    """The JSON of ``ref``; raises TensorInRefError if a tensor hides in it, and
    BadFrameError if it is not JSON-able or beyond the wire's limits."""
    try:
        if (
            type(ref.generation) is int
            and type(ref.store) is str
            and ref.generation <= MAX_INT
            and len(ref.store) <= MAX_STORE_CHARS
            and len(ref.specs) <= MAX_FEATURES
        ):
            return ref_json(ref, _check_spec).encode()
    except (TypeError, ValueError, AttributeError):
        pass  # something in the ref is not plain data, or too large: find out what, precisely
    assert_no_tensors(ref)
    try:
        check_limits(ref)
        return ref.to_json().encode()
    except (TypeError, ValueError) as exc:
        raise bad_frame(MALFORMED, f"ref {ref.sample_id!r} cannot travel: {exc}") from exc


def ref_body(ref: object, max_frame_bytes: int) -> bytes:
    """What a sender sends for ``ref``, or the error it refuses ``ref`` with.

    InvalidRefError for a non-SampleRef, TensorInRefError for a tensor in it,
    BadFrameError when it is not JSON-able, beyond the wire's limits, or its
    frame would exceed ``max_frame_bytes``: everything a receiver would drop.
    """
    if not isinstance(ref, SampleRef):
        raise InvalidRefError(f"send takes a SampleRef, got {type(ref).__name__}")
    body = encode_ref_body(ref)
    if len(body) + REF_OVERHEAD > max_frame_bytes:
        raise bad_frame(
            OVERSIZED,
            f"ref {ref.sample_id!r} encodes to {len(body)} bytes, over max_frame_bytes="
            f"{max_frame_bytes}; keep tensors in the store, not in metadata",
        )
    return body


def ref_bodies(refs: Sequence[object], max_frame_bytes: int) -> list[bytes]:
    """``[ref_body(ref, max_frame_bytes) for ref in refs]``, in one pass where it can.

    The bodies of :class:`RefWriter` (a receiver decodes them to the same refs) where
    every ref is plainly valid and far within ``max_frame_bytes``: ``to_json``'s text
    of a ref is at most six times as long (an escaped character for a UTF-8 byte), so
    ``ref_body`` would take each of them too. Anything else is decided ref by ref.
    """
    bodies = _WRITER.bodies(refs) if refs else None
    if bodies is None or 6 * max(map(len, bodies)) + REF_OVERHEAD > max_frame_bytes:
        return [ref_body(ref, max_frame_bytes) for ref in refs]
    return bodies


def check_ref(ref: object, max_frame_bytes: int) -> None:
    """``RefSender.check``: raise BadFrameError where ``ref_body`` refuses ``ref``.

    A tensor hidden in the ref is a BadFrameError of kind ``tensor`` here
    (``send`` raises the TensorInRefError itself, which is its cause).
    """
    try:
        ref_body(ref, max_frame_bytes)
    except TensorInRefError as exc:
        raise bad_frame(TENSOR, str(exc)) from exc


def checked_bodies(refs: Sequence[object], max_frame_bytes: int) -> list[bytes]:
    """``ref_bodies`` of ``refs``, raising for the first one refused as :func:`check_ref`
    does: what ``RefSender.check`` of each, then a send of them all, would encode."""
    try:
        return ref_bodies(refs, max_frame_bytes)
    except TensorInRefError as exc:
        raise bad_frame(TENSOR, str(exc)) from exc


def check_limits(ref: SampleRef) -> SampleRef:
    """Return ``ref`` if the wire carries it, else raise InvalidRefError (see MAX_FEATURES)."""
    if len(ref.specs) > MAX_FEATURES:
        raise InvalidRefError(f"ref has {len(ref.specs)} features, over {MAX_FEATURES}")
    if ref.generation > MAX_INT:
        raise InvalidRefError(f"generation {ref.generation} is over {MAX_INT}")
    if len(ref.store) > MAX_STORE_CHARS:
        raise InvalidRefError(f"store URI of {len(ref.store)} characters, over {MAX_STORE_CHARS}")
    for name, spec in ref.specs.items():
        _check_spec(name, spec)
    return ref


def _check_spec(name: str, spec: FeatureSpec) -> None:
    shape = spec.shape
    if len(shape) > MAX_DIMS or any(d > MAX_FEATURE_BYTES for d in shape):
        raise InvalidRefError(
            f"feature {name!r} has shape {shape}: more than {MAX_DIMS} dims "
            f"or a dim over {MAX_FEATURE_BYTES}"
        )
    if spec.nbytes > MAX_FEATURE_BYTES:
        raise InvalidRefError(
            f"feature {name!r} of shape {shape} and {spec.dtype} would take {spec.nbytes} "
            f"bytes, over {MAX_FEATURE_BYTES}"
        )


# Encoding and decoding refs is most of a stream's CPU time, so both avoid the
# generic paths: SampleRef.to_json sorts keys and rebuilds every spec (the
# body is its bytes all the same, from the one fast encoder, ref_json), and
# SampleRef.__post_init__ re-checks, for tensors and by a JSON round trip,
# metadata that a JSON decoder has just built (and so is plain JSON by
# construction). The fast paths check the same rules; tests compare them
# with SampleRef.to_json/from_dict, and they fall back to the generic paths
# if SampleRef ever grows another field.
_FAST = tuple(f.name for f in dataclasses.fields(SampleRef)) == _REF_FIELDS


@functools.lru_cache(maxsize=256)
def _head(kind: str, receiver: str, line: int) -> bytes:
    # A sender's frames go to one receiver session and line for long stretches.
    version = _VERSION_OF[kind]
    field = 'refs":[' if kind == "refs" else 'ref":'
    return (
        f'{{"v":{version},"type":"{kind}","receiver":{json.dumps(receiver)},"line":{line},"{field}'
    ).encode()


def encode_ref(receiver: str, line: int, body: bytes) -> bytes:
    """A ref frame around a body from :func:`encode_ref_body`.

    Splicing the body in saves encoding a ref again for each attempt to send it.
    """
    return b"%s%s}" % (_head("ref", receiver, line), body)


def encode_refs(receiver: str, line: int, bodies: Sequence[bytes]) -> bytes:
    """A ``refs`` frame around bodies from :func:`encode_ref_body` (one: a ``ref`` frame)."""
    if len(bodies) == 1:
        return encode_ref(receiver, line, bodies[0])
    return b"%s%s]}" % (_head("refs", receiver, line), b",".join(bodies))


def frame_fit(bodies: Sequence[bytes], start: int, count: int, max_frame_bytes: int) -> int:
    """How many of ``bodies[start:start + count]`` (at least one) fit in one frame.

    Every body fits alone (``ref_body`` leaves REF_OVERHEAD bytes for the frame).
    """
    room = max_frame_bytes - REF_OVERHEAD
    chunk = bodies[start : start + count]
    if sum(map(len, chunk)) + len(chunk) <= room:  # the usual: all of them
        return max(len(chunk), 1)
    taken = 0
    for body in chunk:
        room -= len(body) + 1
        if room < 0:
            break
        taken += 1
    return max(taken, 1)


def encode(frame: Frame) -> bytes:
    """The bytes of a frame (for refs, prefer encode_ref/encode_refs with cached bodies)."""
    if isinstance(frame, RefFrame):
        return encode_ref(frame.receiver, frame.line, encode_ref_body(frame.ref))
    if isinstance(frame, RefsFrame):
        if not frame.refs:
            raise bad_frame(MALFORMED, "a refs frame carries at least one ref")
        bodies = [encode_ref_body(ref) for ref in frame.refs]
        return b"%s%s]}" % (_head("refs", frame.receiver, frame.line), b",".join(bodies))
    if (  # a receiver's most frequent frame: json.dumps' bytes, without json.dumps
        type(frame) is CreditFrame
        and type(frame.receiver) is str
        and type(frame.line) is int
        and type(frame.granted) is int
    ):
        return b'{"v":%d,"type":"credit","receiver":%s,"line":%d,"granted":%d}' % (
            WIRE_VERSION,
            _quote(frame.receiver).encode(),
            frame.line,
            frame.granted,
        )
    data = {"v": WIRE_VERSION, "type": _TYPE_OF[type(frame)], **frame.__dict__}
    return json.dumps(data, separators=(",", ":")).encode()


def decode(
    parts: list[bytes], *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, lazy: bool = False
) -> Frame:
    """Decode one message (its frames, routing id removed); raise BadFrameError on any flaw.

    With ``lazy``, a ``refs`` frame's refs may come as a :class:`RefBatch` (checked, built
    when taken) instead of a tuple: what a receiver buffers (see ``RefReader.read_all``).
    """
    if len(parts) != 1:
        raise bad_frame(
            TENSOR,
            f"message has {len(parts)} frames, expected 1: extra binary frames "
            "(the usual way a tensor is smuggled) are never accepted",
        )
    data = parts[0]
    if len(data) > max_bytes:
        raise bad_frame(
            OVERSIZED, f"frame of {len(data)} bytes exceeds max_frame_bytes={max_bytes}"
        )
    if data.startswith(_TENSOR_MAGIC):
        raise bad_frame(TENSOR, "binary payload (pickle, torch.save or .npy); never unpickled")
    frame = _fast_decode(data, lazy)
    return _strict_decode(data) if frame is None else frame


# -- the strict path: Python's json, every refusal with its reason ------------------------
def _strict_decode(data: bytes) -> Frame:
    try:
        obj = _loads(data)
    except (ValueError, RecursionError) as exc:
        raise bad_frame(MALFORMED, f"frame is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_frame(MALFORMED, f"frame is a JSON {type(obj).__name__}, expected an object")
    version = obj.get("v")
    if not _is_int(version):
        raise bad_frame(MALFORMED, f"frame has no integer version field 'v': {version!r}")
    if version not in _VERSIONS:
        raise bad_frame(
            VERSION,
            f"frame version {version}; this receiver speaks {' and '.join(map(str, _VERSIONS))} "
            "(run the same dataflow version on producers and consumers)",
        )
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:  # a JSON object is unhashable
        raise bad_frame(MALFORMED, f"unknown frame type {kind!r}")
    if version != _VERSION_OF[kind]:
        raise bad_frame(
            VERSION, f"a {kind} frame is version {_VERSION_OF[kind]}, this one says {version}"
        )
    cls, fields = _FIELDS[kind]
    if obj.keys() != fields:
        raise bad_frame(
            MALFORMED, f"{kind} frame needs the fields {sorted(fields)}, got {sorted(obj)}"
        )
    for name in ("producer", "receiver"):
        if name in obj:
            _check_id(name, obj[name])
    for name in ("line", "granted"):
        if name in obj and not (_is_int(obj[name]) and 0 <= obj[name] <= MAX_INT):
            raise bad_frame(MALFORMED, f"{name} must be an int in [0, 2^63), got {obj[name]!r}")
    if cls is RefFrame:
        return RefFrame(obj["receiver"], obj["line"], _decode_ref(obj["ref"]))
    if cls is RefsFrame:
        refs = obj["refs"]
        if not isinstance(refs, list) or not refs:
            raise bad_frame(MALFORMED, f"refs must be a list of 1 or more refs, got {refs!r:.80}")
        return RefsFrame(obj["receiver"], obj["line"], tuple(map(_decode_ref, refs)))
    return cls(**{k: v for k, v in obj.items() if k not in ("v", "type")})


def _decode_ref(data: object) -> SampleRef:
    try:
        return _fast_ref(data) if _FAST else check_limits(SampleRef.from_dict(data))
    except TensorInRefError as exc:  # unreachable from JSON; kept for the generic path
        raise bad_frame(TENSOR, str(exc)) from None
    except (DataflowError, ValueError, TypeError, RecursionError) as exc:
        raise bad_frame(MALFORMED, f"bad ref: {exc}") from None


def _fast_ref(data: object) -> SampleRef:
    """SampleRef.from_dict and check_limits, for a dict fresh from json.loads."""
    if type(data) is dict and (
        (type(specs := data.get("specs")) is dict and len(specs) > MAX_FEATURES)
        or (type(generation := data.get("generation")) is int and generation > MAX_INT)
        or (type(store := data.get("store")) is str and len(store) > MAX_STORE_CHARS)
    ):
        return check_limits(SampleRef.from_dict(data))  # raises the precise error
    return ref_from_parsed(data, _check_spec)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS:
        raise bad_frame(MALFORMED, f"{name} must be a str of 1-{_MAX_ID_CHARS} characters")


# -- the compiled path: msgspec, for the frames it is sure of --------------------------------
_Id = Annotated[str, Meta(min_length=1, max_length=_MAX_ID_CHARS)]
_Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
_Ref = ref_struct(max_generation=MAX_INT, max_store_chars=MAX_STORE_CHARS, id_pattern=False)


class _Wire(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    v: int


class _RefWire(_Wire, tag="ref"):
    receiver: _Id
    line: _Count
    ref: _Ref  # type: ignore[valid-type]


class _RefsWire(_Wire, tag="refs"):
    receiver: _Id
    line: _Count
    refs: list[_Ref]  # type: ignore[valid-type]


class _HeartbeatWire(_Wire, tag="hb"):
    producer: _Id


class _EofWire(_Wire, tag="eof"):
    producer: _Id


class _CreditWire(_Wire, tag="credit"):
    receiver: _Id
    line: _Count
    granted: _Count


class _EofAckWire(_Wire, tag="eof_ack"):
    receiver: _Id


_WIRES = (_RefWire, _RefsWire, _HeartbeatWire, _EofWire, _CreditWire, _EofAckWire)
_FRAMES = msgspec.json.Decoder(
    _RefWire | _RefsWire | _HeartbeatWire | _EofWire | _CreditWire | _EofAckWire
)
_WIRE_VERSION = {cls: _VERSION_OF[cls.__struct_config__.tag] for cls in _WIRES}  # type: ignore[index]
_READER = RefReader(_check_spec, max_features=MAX_FEATURES, unique_keys=True, check_ids=True)
_WRITER = RefWriter(
    _check_spec,
    max_generation=MAX_INT,
    max_store_chars=MAX_STORE_CHARS,
    max_features=MAX_FEATURES,
)
_reencode = msgspec.json.Encoder().encode


def _fast_decode(data: bytes, lazy: bool = False) -> Frame | None:
    """The frame in ``data``, or None where the strict path must decide.

    msgspec keeps the last of repeated keys; a frame with one is left to the strict
    path, which refuses it. It has none when it holds as many colons as the frame
    msgspec read, written again: every key is followed by one colon, other colons lie
    inside strings (and the specs, kept as they came, whose keys RefReader counts), and
    a key or string dropped for a repeated key only adds colons. A colon escaped as
    ``\\u003a`` would not count, so a frame holding ``\\u003`` is left to the strict path.
    """
    try:
        wire = _FRAMES.decode(data)
    except (ValueError, RecursionError):  # msgspec.DecodeError, UnicodeDecodeError
        return None
    kind = type(wire)
    if (
        wire.v != _WIRE_VERSION[kind]
        or (b"\\" in data and b"\\u003" in data)  # most frames hold no backslash
        or _reencode(wire).count(b":") != data.count(b":")
    ):
        return None
    if kind is _RefsWire:
        refs = _READER.read_all(wire.refs, lazy=lazy)
        if not refs:
            return None
        return RefsFrame(wire.receiver, wire.line, refs if lazy else tuple(refs))  # type: ignore[arg-type]
    if kind is _RefWire:
        ref = _READER.read(wire.ref)
        return None if ref is None else RefFrame(wire.receiver, wire.line, ref)
    if kind is _CreditWire:
        return CreditFrame(wire.receiver, wire.line, wire.granted)
    if kind is _EofAckWire:
        return EofAckFrame(wire.receiver)
    return (HeartbeatFrame if kind is _HeartbeatWire else EofFrame)(wire.producer)
