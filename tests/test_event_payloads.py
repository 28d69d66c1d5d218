"""Typed event payloads: each kind's payload is refused on write and on read when a field
is not its declared type, and every payload the library's writers make fits its type."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow import InvalidArgumentError, Kind, SampleRef
from dataflow.model._events import (
    PAYLOAD_TYPES,
    UNSET,
    check_payload,
    dump_payload,
    read_payload,
)
from dataflow.model._fold import RunState
from dataflow.recorder._ledger import NewEvent

#: Per kind: a payload with one field of the wrong type, and that field's name.
MISTYPED: dict[str, tuple[dict[str, Any], str]] = {
    Kind.COMMIT: (
        {"generation": "0", "metadata": {}, "sample_id": "a", "specs": {}, "store": "mem://s"},
        "generation",
    ),
    Kind.CLOSE: ({"streamed": "no"}, "streamed"),
    Kind.RESUME: ({"world_size": "2"}, "world_size"),
    Kind.LEASE: ({"reason": 1}, "reason"),
    Kind.ACK: ({"step": "3"}, "step"),
    Kind.NACK: ({"retryable": "no", "reason": "bad"}, "retryable"),
    Kind.CHECKPOINT: ({"path": 3}, "path"),
    Kind.RELEASE: ({"revision": "1"}, "revision"),
    Kind.DATA_EPOCH: ({"data_epoch": 1, "seed": "x"}, "seed"),
    Kind.CHECKPOINT_REMOVED: ({"checkpoint_seq": "3", "reason": "gone"}, "checkpoint_seq"),
    Kind.LOST: ({"revision": 0, "reason": 5}, "reason"),
    Kind.CLAIM: ({"host": "h", "pid": "12", "store": "mem://s"}, "pid"),
    Kind.EXCLUDE: ({"samples": ["a"], "reason": 3}, "reason"),
    Kind.INCLUDE: ({"samples": "a", "reason": "r"}, "samples"),
}


def test_every_kind_has_a_payload_type() -> None:
    assert set(PAYLOAD_TYPES) == Kind.ALL == set(MISTYPED)


@pytest.mark.parametrize("kind", sorted(MISTYPED))
def test_a_mistyped_field_is_refused_on_write_naming_kind_and_field(kind: str) -> None:
    payload, name = MISTYPED[kind]
    with pytest.raises(InvalidArgumentError, match=rf"^a {kind} event's payload: .*`{name}`"):
        NewEvent(kind, "actor", "a", epoch=1, payload=json.dumps(payload))


def test_the_write_error_says_what_the_field_must_be() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        NewEvent(Kind.NACK, "c", "a", epoch=1, payload='{"reason":1}')
    assert (
        str(caught.value) == "a nack event's payload: field `reason` must be a str | null, got int"
    )


@pytest.mark.parametrize(
    ("kind", "text", "why"),
    [
        (Kind.RESUME, "[1, 2]", "must be an object, got array"),
        (Kind.CHECKPOINT, "{not json", "not JSON"),
        (Kind.RESUME, '{"world_size": ' + "[" * 100 + "]" * 100 + "}", "nested deeper than 64"),
        (Kind.COMMIT, None, "must be a JSON str"),
    ],
)
def test_a_payload_no_kind_can_have_is_refused_on_write(kind: str, text: Any, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        check_payload(kind, text)


def test_no_payload_and_unknown_kinds_pass_the_write_check() -> None:
    for kind in Kind.ALL - {Kind.COMMIT}:
        NewEvent(kind, "actor")  # the fold's defaults stand for a missing payload
    NewEvent("bogus", "actor", payload='{"x": 1}')  # the fold reports an unknown kind


def _rows_before(kind: str) -> list[tuple[Any, ...]]:
    """A log (commit a and b, resume, lease a) after which ``kind`` is read."""
    ref = SampleRef("a", "mem://s", 0).to_json()
    rows = [
        (1, Kind.COMMIT, "a", 0, 0, None, "p", ref, 0.0),
        (2, Kind.RESUME, None, None, 1, None, "c", '{"world_size":1}', 0.0),
        (3, Kind.LEASE, "a", None, 1, None, "c", None, 0.0),
        (4, Kind.ACK, "a", None, 1, 1, "c", None, 0.0),
        (5, Kind.CHECKPOINT, None, None, 1, 1, "c", '{"path":"/ckpt"}', 0.0),
    ]
    if kind in (Kind.NACK, Kind.LOST, Kind.ACK):
        rows = rows[:3]  # a is leased
    return rows


@pytest.mark.parametrize("kind", sorted(set(MISTYPED) - {Kind.COMMIT}))
def test_a_forged_row_with_a_mistyped_field_is_a_violation_with_its_seq(kind: str) -> None:
    payload, name = MISTYPED[kind]
    rows = _rows_before(kind)
    seq = len(rows) + 1
    epoch = 2 if kind in (Kind.RESUME, Kind.CLAIM) else (0 if kind == Kind.CLOSE else 1)
    forged = (seq, kind, "a", None, epoch, 2, "c", json.dumps(payload), 0.0)
    state = RunState("r").apply_rows([*rows, forged])  # no error escapes the fold
    problems = [p for p in state.verify() if p.startswith(f"seq {seq}: unreadable {kind} event")]
    assert problems and f"`{name}`" in problems[0], state.verify()


def test_a_forged_commit_is_taken_by_the_fold_and_refused_when_its_ref_is_read() -> None:
    # As today: the fold checks that a commit names its sample, and the ref is decoded when
    # read (a lease refuses it with CorruptLedgerError, see test_ledger_tampered).
    payload, _ = MISTYPED[Kind.COMMIT]
    state = RunState("r").apply_rows(
        [
            (
                1,
                Kind.COMMIT,
                "a",
                0,
                0,
                None,
                "p",
                json.dumps(payload, separators=(",", ":"), sort_keys=True),
                0.0,
            )
        ]
    )
    assert "a" in state.committed and state.verify() == []
    with pytest.raises(ValueError, match="generation"):
        state.ref("a")


# -- what the writers make fits the types ---------------------------------------------
_text = st.text(max_size=40)
_int64 = st.integers(min_value=0, max_value=2**63 - 1)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _refs(draw: st.DrawFn) -> str:
    specs = draw(
        st.dictionaries(
            st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
            st.tuples(
                st.lists(st.integers(0, 64), max_size=3), st.sampled_from(["float32", "int64"])
            ),
            max_size=3,
        )
    )
    ref = {
        "sample_id": draw(st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True)),
        "store": draw(st.sampled_from(["mem://s", "dir:///tmp/x", "mooncake://h:1/p"])),
        "generation": draw(_int64),
        "specs": {n: {"shape": shape, "dtype": dtype} for n, (shape, dtype) in specs.items()},
        "metadata": draw(st.dictionaries(_text, _json, max_size=3)),
    }
    return json.dumps(ref, separators=(",", ":"), sort_keys=True)  # as SampleRef.to_json


def _optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


_policies = st.sampled_from(["on_checkpoint", "on_ack", "never"])
#: Per kind, the payloads the library's writers make (live/_consumer.py, live/_producer.py,
#: tools/_inspect.py): their fields, types and ranges.
WRITTEN: dict[str, st.SearchStrategy[Any]] = {
    Kind.CLOSE: st.just({"streamed": False}),
    Kind.RESUME: st.fixed_dictionaries(
        {
            "checkpoint_seq": st.none() | _int64,
            "checkpoint_step": st.none() | _int64,
            "world_size": st.integers(1, 2**63 - 1),
            "release_policy": _policies,
            "max_attempts": st.integers(1, 2**63 - 1),
        },
        optional={"order_seed": _int64},
    ),
    Kind.NACK: st.fixed_dictionaries(
        {"retryable": st.booleans(), "reason": st.text(max_size=1000)},
        optional={"rank": st.integers(0, 1024)},
    ),
    Kind.CHECKPOINT: st.fixed_dictionaries({"path": _text}, optional={"digest": _text}),
    Kind.RELEASE: st.fixed_dictionaries({"revision": _int64}),
    Kind.DATA_EPOCH: st.fixed_dictionaries({"data_epoch": _int64, "seed": _int64}),
    Kind.CHECKPOINT_REMOVED: st.fixed_dictionaries(
        {"checkpoint_seq": _int64, "step": _int64, "reason": st.text(min_size=1, max_size=40)}
    ),
    Kind.LOST: st.fixed_dictionaries(
        {"revision": _int64, "reason": st.text(min_size=1, max_size=1000)}
    ),
    Kind.CLAIM: st.fixed_dictionaries(
        {"host": _text, "pid": st.integers(1, 2**22), "store": _text}
    ),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_payload_the_writers_make_round_trips_through_its_type(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted([*WRITTEN, Kind.COMMIT])))
    written = _refs() if kind == Kind.COMMIT else WRITTEN[kind].map(dump_payload)
    text = data.draw(written)
    check_payload(kind, text)  # accepted on write
    NewEvent(kind, "actor", "a", payload=text)
    decoded = read_payload(kind, text)  # and read back as its type, losing nothing
    fields = {k: v for k, v in msgspec.structs.asdict(decoded).items() if v is not UNSET}
    again = json.loads(msgspec.json.encode(fields))
    original = json.loads(text)
    assert {k: v for k, v in again.items() if k in original} == original
    assert set(original) <= set(again)


def test_a_ref_round_trips_through_the_commit_type() -> None:
    ref = SampleRef("a", "mem://s", 3, metadata={"k": [1, {"x": None}]})
    decoded = read_payload(Kind.COMMIT, ref.to_json())
    assert json.loads(msgspec.json.encode(decoded)) == json.loads(ref.to_json())
