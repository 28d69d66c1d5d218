"""Bad input at every public entry point: a clear error of the documented class that
names the offending value, and a ledger (and store) left exactly as it was."""

import contextlib
import dataclasses
import math
import os
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture

from dataflow import (
    Checkpoint,
    Consumer,
    DataflowError,
    IntegrityError,
    InvalidCheckpointPathError,
    InvalidIdError,
    InvalidRefError,
    InvalidSampleIdError,
    Kind,
    Ledger,
    LedgerStateError,
    NotALedgerError,
    OperationalError,
    Producer,
    SampleRef,
    TensorInRefError,
    UnknownCheckpointError,
    assert_no_tensors,
    replay,
    validate_sample_id,
)
from dataflow.recorder._ledger import NewEvent
from stores import LocalFeatureStore

ONE = {"x": torch.ones(1)}

# For checks made before any database work: one backend shows the ledger stays as it was.
sqlite_only = pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)

BAD_SAMPLE_IDS = [
    pytest.param("", "1 to 256", id="empty"),
    pytest.param("a" * 257, "got 257", id="too-long"),
    pytest.param("with space", "'with space'", id="space"),
    pytest.param("tab\there", r"'tab\\there'", id="control"),
    pytest.param("ünïcode", "'ünïcode'", id="non-ascii"),
    pytest.param("a..b", "'a..b'", id="dot-dot"),
    pytest.param("../etc/passwd", "'../etc/passwd'", id="traversal"),
    pytest.param("/abs", "'/abs'", id="absolute"),
    pytest.param(None, "NoneType None", id="none"),
    pytest.param(7, "int 7", id="int"),
    pytest.param(b"bytes", "bytes b'bytes'", id="bytes"),
]

# Run, producer and consumer ids: 1 to 256 printable characters, no outer whitespace.
BAD_IDS = [
    pytest.param("", "got ''", id="empty"),
    pytest.param("r" * 257, "at most 256", id="too-long"),
    pytest.param("nul\x00", r"'\\x00' at position 3", id="nul"),
    pytest.param("tab\there", r"'\\t' at position 3", id="tab"),
    pytest.param("new\nline", r"'\\n' at position 3", id="newline"),
    pytest.param("del\x7f", r"'\\x7f'", id="del"),
    pytest.param("esc\x1b[31m", r"'\\x1b'", id="escape-sequence"),
    pytest.param("zero\u200bwidth", r"'\\u200b'", id="zero-width-space"),
    pytest.param(" run", "starts or ends with whitespace", id="leading-space"),
    pytest.param("run ", "starts or ends with whitespace", id="trailing-space"),
    pytest.param(None, r"got None \(NoneType\)", id="none"),
    pytest.param(5, r"got 5 \(int\)", id="int"),
    pytest.param(b"run", r"got b'run' \(bytes\)", id="bytes"),
]


# A consumer option or step that must be a non-negative int.
BAD_INTS = [
    pytest.param(-1, ValueError, "got -1", id="negative"),
    pytest.param(2.0, TypeError, "float 2.0", id="float"),
    pytest.param(True, TypeError, "bool True", id="bool"),
    pytest.param("2", TypeError, "str '2'", id="str"),
    pytest.param(None, TypeError, "NoneType None", id="none"),
]


@pytest.fixture
def world(ledger, store, producer, make_consumer):
    """Two ranks of one epoch: a trained at step 1 and checkpointed (so released);
    c leased by the trainer (rank 0); b leased and d acked at step 3 by its peer (rank 1);
    e, f pending."""
    producer.emit_many((sid, ONE) for sid in "abcdef")
    trainer = make_consumer("trainer", world_size=2)
    peer = make_consumer("peer", rank=1, world_size=2)
    trainer.resume()
    peer.resume()
    assert [r.sample_id for r in trainer.lease(1)] == ["a"]
    trainer.ack(["a"], step=1)
    trainer.checkpoint(1, ckpt(1))
    assert [r.sample_id for r in trainer.lease(1)] == ["c"]
    assert [r.sample_id for r in peer.lease(2)] == ["b", "d"]
    peer.ack(["d"], step=3)
    return SimpleNamespace(
        ledger=ledger,
        store=store,
        producer=producer,
        trainer=trainer,
        peer=peer,
        fresh=make_consumer("fresh"),
        run_id=producer.run_id,
    )


def observe(w) -> tuple:
    return (
        w.ledger.head_seq(w.run_id),
        replay(w.ledger, w.run_id).snapshot(),
        w.ledger.runs(),
        w.store.stats(),
    )


@contextlib.contextmanager
def unchanged(w):
    before = observe(w)
    yield
    assert observe(w) == before


def check(w, call, error, match):
    with unchanged(w), pytest.raises(error, match=match) as got:
        call(w)
    # Whatever builtin category it also has, every error is one of ours.
    assert isinstance(got.value, DataflowError), f"{type(got.value).__name__}: {got.value}"


# -- sample ids and tensors ---------------------------------------------------------------


@sqlite_only
@pytest.mark.parametrize(("sample_id", "match"), BAD_SAMPLE_IDS)
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda w, sid: w.producer.emit(sid, ONE), id="emit"),
        pytest.param(lambda w, sid: w.producer.emit_many([("g", ONE), (sid, ONE)]), id="emit_many"),
        pytest.param(lambda w, sid: w.producer.regenerate(sid, ONE), id="regenerate"),
        pytest.param(lambda w, sid: w.trainer.ack(["c", sid], step=2), id="ack"),
        pytest.param(lambda w, sid: w.trainer.nack([sid]), id="nack"),
    ],
)
def test_invalid_sample_ids_are_refused(world, call, sample_id, match):
    check(world, lambda w: call(w, sample_id), InvalidSampleIdError, match)


@pytest.mark.parametrize(("sample_id", "match"), BAD_SAMPLE_IDS)
def test_invalid_sample_ids_are_refused_by_refs_and_validation(sample_id, match):
    with pytest.raises(InvalidSampleIdError, match=match):
        validate_sample_id(sample_id)
    with pytest.raises(InvalidSampleIdError, match=match):
        SampleRef(sample_id, "mem://s", 1)
    assert issubclass(InvalidSampleIdError, ValueError)


@pytest.mark.parametrize("sample_id", ["a", "A-z_0.9:x/y", "a" * 256, "a/b/c", "-", "x."])
def test_valid_sample_ids_pass(sample_id):
    assert validate_sample_id(sample_id) == sample_id


@sqlite_only
@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        pytest.param({"t": torch.ones(1)}, r"metadata\['t'\] holds a Tensor", id="torch"),
        pytest.param(
            {"deep": [{"n": np.zeros(2)}]},
            r"\['deep'\]\[0\]\['n'\] holds a ndarray",
            id="numpy-nested",
        ),
        pytest.param([torch.ones(1)], "holds a Tensor", id="in-a-list"),
    ],
)
def test_tensors_in_metadata_are_refused(world, metadata, match):
    check(world, lambda w: w.producer.emit("g", ONE, metadata=metadata), TensorInRefError, match)
    with pytest.raises(TensorInRefError, match=match):
        SampleRef("g", "mem://s", 1, metadata=metadata)
    assert issubclass(TensorInRefError, TypeError)


@sqlite_only
def test_a_ref_with_a_smuggled_tensor_is_refused(world):
    ref = world.store.put("g", ONE)
    object.__setattr__(ref, "metadata", {"t": torch.ones(1)})  # bypass the frozen check
    with pytest.raises(TensorInRefError, match=r"ref.metadata\['t'\]"):
        assert_no_tensors(ref)
    world.store.delete(ref)
    check(world, lambda w: w.producer.commit([ref]), TensorInRefError, "metadata")


def test_refs_are_frozen_and_round_trip_through_json():
    ref = SampleRef("s", "mem://s", 3, {}, {"k": [1, "x", None]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.sample_id = "t"  # type: ignore[misc]
    assert SampleRef.from_json(ref.to_json()) == ref
    with pytest.raises(InvalidRefError, match="not a JSON SampleRef"):
        SampleRef.from_json("{nope")
    with pytest.raises(InvalidRefError, match="keys"):
        SampleRef.from_json('{"sample_id": "s"}')


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        pytest.param(
            lambda w: w.producer.emit("g", {"x": [1, 2]}),
            InvalidRefError,
            r"tensors\['x'\] must be a torch.Tensor, got list",
            id="not-a-tensor",
        ),
        pytest.param(
            lambda w: w.producer.emit("g", torch.ones(1)),
            InvalidRefError,
            "got Tensor",
            id="tensor-not-dict",
        ),
        pytest.param(
            lambda w: w.producer.emit("g", {"bad name!": torch.ones(1)}),
            InvalidRefError,
            "'bad name!'",
            id="feature-name",
        ),
        pytest.param(
            lambda w: w.producer.emit("g", ONE, metadata={"s": {1, 2}}),
            InvalidRefError,
            r"metadata\['s'\] is a set",
            id="metadata-not-json",
        ),
        pytest.param(
            lambda w: w.producer.emit("g", ONE, metadata={"f": math.nan}),
            InvalidRefError,
            "nan",
            id="metadata-nan",
        ),
        pytest.param(
            lambda w: w.producer.emit("g", ONE, metadata="meta"),
            InvalidRefError,
            "got str",
            id="metadata-not-dict",
        ),
        pytest.param(
            lambda w: w.producer.emit_many([("g", ONE), ("h", ONE, {"t": torch.ones(1)})]),
            TensorInRefError,
            r"metadata\['t'\]",
            id="emit_many-one-bad",
        ),
        pytest.param(
            lambda w: w.producer.emit_many([("g",)]), TypeError, r"\('g',\)", id="emit_many-item"
        ),
        pytest.param(
            lambda w: w.producer.emit_many(None), TypeError, "got NoneType", id="emit_many-none"
        ),
        pytest.param(
            lambda w: w.producer.emit_many([5]), TypeError, "items, got 5", id="emit_many-int-item"
        ),
        pytest.param(
            lambda w: w.producer.emit_many({"g": ONE}), TypeError, "got dict", id="emit_many-dict"
        ),
        pytest.param(lambda w: w.producer.commit(["a"]), TypeError, "got str", id="commit-ids"),
        pytest.param(
            lambda w: w.producer.commit(w.trainer.state.ref("c")),
            TypeError,
            "SampleRef",
            id="commit-one-ref",
        ),
        pytest.param(
            lambda w: w.producer.regenerate("never", ONE),
            LedgerStateError,
            "'never' was never committed",
            id="regenerate-unknown",
        ),
        pytest.param(
            lambda w: w.producer.regenerate("d", ONE),
            LedgerStateError,
            "'d'.*still stored",
            id="regenerate-stored",
        ),
    ],
)
def test_bad_producer_input_is_refused(world, call, error, match):
    check(world, call, error, match)


# -- roles' options ----------------------------------------------------------------------------


@sqlite_only
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        pytest.param({"ledger": "sqlite:///x.db"}, TypeError, "got str", id="ledger"),
        pytest.param({"store": "mem://s"}, TypeError, "got str", id="store"),
        pytest.param({"stream": "tcp://x"}, TypeError, "RefSender, got str", id="stream"),
    ],
)
def test_bad_producer_options_are_refused(ledger, store, options, error, match):
    args = {"ledger": ledger, "store": store, "run_id": "run"} | options
    with pytest.raises(error, match=match):
        Producer(args.pop("ledger"), args.pop("store"), **args)
    assert ledger.runs() == []


@sqlite_only
@pytest.mark.parametrize(("bad_id", "match"), BAD_IDS)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda led, store, i: Producer(led, store, run_id=i), id="producer-run"),
        pytest.param(
            lambda led, store, i: Producer(led, store, run_id="run", producer_id=i),
            id="producer-id",
        ),
        pytest.param(
            lambda led, store, i: Consumer(led, store, run_id=i, consumer_id="c"),
            id="consumer-run",
        ),
        pytest.param(
            lambda led, store, i: Consumer(led, store, run_id="run", consumer_id=i),
            id="consumer-id",
        ),
        pytest.param(lambda led, store, i: list(led.events(i)), id="events"),
        pytest.param(lambda led, store, i: led.head_seq(i), id="head_seq"),
        pytest.param(lambda led, store, i: led.kind_counts(i), id="kind_counts"),
        pytest.param(lambda led, store, i: replay(led, i), id="replay"),
    ],
)
def test_bad_run_producer_and_consumer_ids_are_refused(ledger, store, make, bad_id, match):
    with pytest.raises(InvalidIdError, match=match):
        make(ledger, store, bad_id)
    assert ledger.runs() == []
    assert issubclass(InvalidIdError, ValueError)


@pytest.mark.parametrize("good_id", ["r", "run-1", "Run 1 (retry)", "训练/第一轮", "a" * 256])
def test_valid_run_ids_pass(ledger, store, good_id):
    Producer(ledger, store, run_id=good_id, producer_id=good_id).emit("s", ONE)
    assert ledger.runs() == [good_id]


@sqlite_only
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        pytest.param(
            {"rank": 2, "world_size": 2},
            ValueError,
            r"< world_size \(2\), got 2",
            id="rank-too-big",
        ),
        pytest.param({"rank": 1}, ValueError, r"< world_size \(1\), got 1", id="rank-default-ws"),
        pytest.param({"rank": -1}, ValueError, "rank must be >= 0, got -1", id="rank-negative"),
        pytest.param({"rank": "0"}, TypeError, "rank must be an int, got str '0'", id="rank-str"),
        pytest.param(
            {"world_size": 0}, ValueError, "world_size must be >= 1, got 0", id="world-zero"
        ),
        pytest.param({"world_size": 1.5}, TypeError, "float 1.5", id="world-float"),
        pytest.param({"release_policy": "on-ack"}, ValueError, "'on-ack'", id="policy"),
        pytest.param({"release_policy": None}, ValueError, "got None", id="policy-none"),
        pytest.param(
            {"max_attempts": 0}, ValueError, "max_attempts must be >= 1, got 0", id="attempts-zero"
        ),
        pytest.param({"max_attempts": True}, TypeError, "bool True", id="attempts-bool"),
        pytest.param({"stream": object()}, TypeError, "RefReceiver, got object", id="stream"),
        pytest.param({"ledger": None}, TypeError, "got NoneType", id="ledger"),
    ],
)
def test_bad_consumer_options_are_refused(ledger, store, options, error, match):
    args = {"ledger": ledger, "store": store, "run_id": "run", "consumer_id": "c"} | options
    with pytest.raises(error, match=match):
        Consumer(args.pop("ledger"), args.pop("store"), **args)
    assert ledger.runs() == []


# -- consumer calls ------------------------------------------------------------------------------


# Checkpoint paths (the process runs in tmp_path): (id, path, what the error says).
BAD_CHECKPOINT_PATHS = [
    ("empty", "", "got ''"),
    ("none", None, "got None"),
    ("int", 2, "got 2"),
    ("missing", "ckpt/never-written", r"'ckpt/never-written' \(resolved to .*\) does not exist"),
    ("missing-absolute", "/nonexistent/ckpt-2", "'/nonexistent/ckpt-2' does not exist"),
    ("dotdot", "../../etc", "'../../etc' has a '..' part"),
    ("dotdot-inside", "ckpt/../ckpt", "'ckpt/../ckpt' has a '..' part"),
    ("dotdot-absolute", "/tmp/../etc", "'/tmp/../etc' has a '..' part"),
    ("device", os.devnull, "is neither a file nor a directory"),
    ("nul", "ckpt/2\x00", "control character"),
    ("newline", "ckpt/2\n", "control character"),
    ("file-uri", "file:///tmp", "file:// URI; pass the local path"),
]

# Calls taking a non-negative int; True where None is a valid value there.
INT_CALLS = {
    "ack-step": (lambda w, v: w.trainer.ack(["c"], step=v), False),
    "checkpoint-step": (lambda w, v: w.trainer.checkpoint(v, "ckpt/x"), False),
    "resume-step": (lambda w, v: w.fresh.resume(checkpoint=v), True),
    "lease-max_refs": (lambda w, v: w.trainer.lease(v), False),
    "data-epoch-seed": (lambda w, v: w.trainer.start_data_epoch(seed=v), True),
}


@sqlite_only
@pytest.mark.parametrize(
    ("call", "value", "error", "match"),
    [
        pytest.param(call, *bad.values, id=f"{name}-{bad.id}")
        for name, (call, none_is_valid) in INT_CALLS.items()
        for bad in BAD_INTS
        if not (none_is_valid and bad.values[0] is None)
    ],
)
def test_bad_steps_and_counts_are_refused(world, call, value, error, match):
    check(world, lambda w: call(w, value), error, match)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda w, step: w.trainer.ack(["c"], step=step), id="ack"),
        pytest.param(lambda w, step: w.trainer.checkpoint(step, "ckpt/x"), id="checkpoint"),
    ],
)
def test_steps_beyond_64_bits_are_refused(world, call):
    check(world, lambda w: call(w, 2**63), ValueError, str(2**63))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # leases
        pytest.param(
            lambda w: w.fresh.lease(1),
            LedgerStateError,
            "has not resumed",
            id="lease-before-resume",
        ),
        pytest.param(
            lambda w: w.trainer.lease(0),
            ValueError,
            "max_refs must be >= 1, got 0",
            id="lease-zero",
        ),
        pytest.param(
            lambda w: w.trainer.lease(1, timeout=-1), ValueError, "got -1", id="timeout-negative"
        ),
        pytest.param(
            lambda w: w.trainer.lease(1, timeout="1"), ValueError, "got '1'", id="timeout-str"
        ),
        pytest.param(
            lambda w: w.trainer.lease(1, timeout=math.nan),
            ValueError,
            "nan",
            id="timeout-nan",
        ),
        # acks and nacks
        pytest.param(
            lambda w: w.trainer.ack(["e"], step=2),
            LedgerStateError,
            "cannot ack 'e': it is not leased",
            id="ack-pending",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["zzz"], step=2),
            LedgerStateError,
            "cannot ack 'zzz': it is not leased",
            id="ack-never-committed",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["a"], step=2),
            LedgerStateError,
            "cannot ack 'a'",
            id="ack-trained",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["b"], step=2),
            LedgerStateError,
            "cannot ack 'b': it is leased by 'peer'",
            id="ack-other-consumer",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["c", "e"], step=2),
            LedgerStateError,
            "cannot ack 'e'",
            id="ack-one-bad",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["c", "c"], step=2),
            ValueError,
            r"more than once: \['c'\]",
            id="ack-duplicate",
        ),
        pytest.param(
            lambda w: w.trainer.ack([w.trainer.state.ref("c"), "c"], step=2),
            ValueError,
            r"more than once: \['c'\]",
            id="ack-duplicate-ref",
        ),
        pytest.param(lambda w: w.trainer.ack("c", step=2), TypeError, "got 'c'", id="ack-str"),
        pytest.param(
            lambda w: w.trainer.ack(w.trainer.state.ref("c"), step=2),
            TypeError,
            "SampleRef",
            id="ack-one-ref",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["c"], step=1),
            LedgerStateError,
            "ack at step 1.*checkpoint at step 1",
            id="ack-at-checkpoint",
        ),
        pytest.param(
            lambda w: w.trainer.ack(["c"], step=0),
            LedgerStateError,
            "ack step must be >= 1, got 0",
            id="ack-step-zero",
        ),
        pytest.param(
            lambda w: w.peer.ack(["b"], step=2),
            LedgerStateError,
            "ack at step 2.*'peer' already acked step 3 in epoch 1: steps must not go backwards",
            id="ack-step-backwards",
        ),
        pytest.param(
            lambda w: w.fresh.ack(["c"], step=2),
            LedgerStateError,
            "has not resumed",
            id="ack-before-resume",
        ),
        pytest.param(
            lambda w: w.trainer.nack(["e"]),
            LedgerStateError,
            "cannot nack 'e': it is not leased",
            id="nack-pending",
        ),
        pytest.param(
            lambda w: w.peer.nack(["c"]),
            LedgerStateError,
            "cannot nack 'c': it is leased by 'trainer'",
            id="nack-other-consumer",
        ),
        pytest.param(
            lambda w: w.trainer.nack(["c", "c"]), ValueError, r"\['c'\]", id="nack-duplicate"
        ),
        pytest.param(
            lambda w: w.trainer.nack(["c"], retryable="yes"),
            TypeError,
            "got 'yes'",
            id="nack-retryable",
        ),
        pytest.param(
            lambda w: w.trainer.nack(["c"], reason=5), ValueError, "got 5", id="nack-reason"
        ),
        pytest.param(
            lambda w: w.trainer.nack(["c"], reason="x" * 1001),
            ValueError,
            "at most 1000",
            id="nack-reason-long",
        ),
        # checkpoints and resumes
        pytest.param(
            lambda w: w.trainer.checkpoint(1, ckpt("again")),
            LedgerStateError,
            "checkpoint at step 1.*already has one at step 1",
            id="checkpoint-same-step",
        ),
        pytest.param(
            lambda w: w.trainer.checkpoint(0, ckpt(0)),
            LedgerStateError,
            "checkpoint at step 0",
            id="checkpoint-older-step",
        ),
        *[
            pytest.param(
                lambda w, path=path: w.trainer.checkpoint(2, path),
                InvalidCheckpointPathError,
                match,
                id=f"checkpoint-path-{name}",
            )
            for name, path, match in BAD_CHECKPOINT_PATHS
        ],
        pytest.param(
            lambda w: w.fresh.checkpoint(2, "ckpt/2"),
            LedgerStateError,
            "has not resumed",
            id="checkpoint-before-resume",
        ),
        pytest.param(
            lambda w: w.fresh.resume(checkpoint="earliest"),
            TypeError,
            "str 'earliest'",
            id="resume-str",
        ),
        pytest.param(
            lambda w: w.fresh.resume(checkpoint=99),
            UnknownCheckpointError,
            r"no checkpoint at step 99; recorded steps: \[1\]",
            id="resume-unknown-step",
        ),
        pytest.param(
            lambda w: w.fresh.resume(checkpoint=Checkpoint(999, 1, 1, "elsewhere", 0)),
            UnknownCheckpointError,
            "elsewhere",
            id="resume-unknown-checkpoint",
        ),
        pytest.param(
            lambda w: w.trainer.checkpoint(2, "ckpt/2", digest=""),
            ValueError,
            "digest must be a non-empty str or None, got ''",
            id="checkpoint-digest-empty",
        ),
        # checkpoint removals
        pytest.param(
            lambda w: w.trainer.remove_checkpoints(
                replay(w.ledger, w.run_id).checkpoints, reason=""
            ),
            ValueError,
            "reason must be a non-empty str, got ''",
            id="remove-no-reason",
        ),
        pytest.param(
            lambda w: w.peer.remove_checkpoints(
                replay(w.ledger, w.run_id).checkpoints, reason="retention"
            ),
            LedgerStateError,
            "only rank 0 records removed checkpoints",
            id="remove-from-rank-1",
        ),
        pytest.param(
            lambda w: w.trainer.remove_checkpoints(
                [Checkpoint(999, 1, 1, "elsewhere", 0)], reason="retention"
            ),
            UnknownCheckpointError,
            "elsewhere",
            id="remove-unknown-checkpoint",
        ),
        pytest.param(
            lambda w: w.trainer.remove_checkpoints([1], reason="retention"),
            ValueError,
            "expected dataflow.Checkpoint objects, got 1",
            id="remove-a-step",
        ),
        # data epochs
        pytest.param(
            lambda w: w.trainer.start_data_epoch(),
            LedgerStateError,
            "2 samples are still leased",
            id="data-epoch-leased",
        ),
        pytest.param(
            lambda w: w.peer.start_data_epoch(),
            LedgerStateError,
            "only rank 0",
            id="data-epoch-rank",
        ),
        pytest.param(
            lambda w: w.fresh.start_data_epoch(),
            LedgerStateError,
            "has not resumed",
            id="data-epoch-before-resume",
        ),
    ],
)
def test_bad_consumer_calls_are_refused(world, call, error, match):
    check(world, call, error, match)


@pytest.mark.parametrize("step", [0, -1])
def test_steps_start_at_1_also_before_any_checkpoint(ledger, emit, make_consumer, run_id, step):
    emit("a")
    cons = make_consumer()
    cons.resume()
    refs = cons.lease(1)
    head = ledger.head_seq(run_id)
    with pytest.raises(LedgerStateError, match=f"ack step must be >= 1, got {step}"):
        cons.ack(refs, step=step)
    assert ledger.head_seq(run_id) == head
    cons.ack(refs, step=1)


def test_a_refused_regenerate_keeps_the_live_features(world):
    live = world.trainer.state.ref("d")
    check(world, lambda w: w.producer.regenerate("d", ONE), LedgerStateError, "still stored")
    assert world.store.exists(live)
    assert torch.equal(world.store.get(live)["x"], ONE["x"])


def test_a_refused_ack_leaves_the_valid_part_leased_too(world):
    check(world, lambda w: w.trainer.ack(["c", "e"], step=2), LedgerStateError, "'e'")
    world.trainer.ack(["c"], step=2)
    assert world.trainer.state.trained == {"a": 1, "d": 3, "c": 2}


# -- the ledger ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        pytest.param("sqlite://", ValueError, "in-memory SQLite", id="sqlite-memory-implicit"),
        pytest.param("sqlite:///:memory:", ValueError, "in-memory SQLite", id="sqlite-memory"),
        pytest.param(
            "mysql://u@localhost/db",
            ValueError,
            "unsupported ledger URL 'mysql://",
            id="unknown-scheme",
        ),
        pytest.param("redis://localhost", ValueError, "'redis://localhost'", id="redis"),
        pytest.param(
            "postgresql+psycopg://u:secret@[::1/db",
            ValueError,
            r"cannot parse ledger URL 'postgresql\+psycopg://u:\*\*\*@\[::1/db' \(invalid",
            id="broken-ipv6-host-password-hidden",
        ),
        pytest.param(
            "postgresql+psycopg://u@h:port/db", ValueError, "'postgresql", id="port-not-a-number"
        ),
        pytest.param("not a url", ValueError, "'not a url'", id="not-a-url"),
        pytest.param("", ValueError, "''", id="empty"),
        pytest.param(42, TypeError, "got int", id="int"),
        pytest.param(b"sqlite:///x.db", TypeError, "got bytes", id="bytes"),
    ],
)
def test_bad_ledger_urls_are_refused(tmp_path, monkeypatch, url, error, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        Ledger.open(url)
    assert list(tmp_path.iterdir()) == []


def _truncated_ledger(path: Path) -> None:
    with Ledger.open(f"sqlite:///{path}") as led:
        Producer(led, LocalFeatureStore(), run_id="run").emit("a", ONE)
    path.write_bytes(b"")  # lost its data, e.g. a crash during a copy


def _sqlite_database(*statements: str):
    def make(path: Path) -> None:
        conn = sqlite3.connect(path)
        for statement in statements:
            conn.execute(statement)
        conn.commit()
        conn.close()

    return make


# What may lie at a ledger's path: (id, make it at PATH, what the error says).
NOT_A_LEDGER = [
    ("empty-file", lambda p: p.write_bytes(b""), r"is an empty file \(0 bytes\), not a ledger"),
    ("truncated-ledger", _truncated_ledger, "empty file .* may have lost its data"),
    ("text-file", lambda p: p.write_text("a,b\n1,2\n" * 50), "not a SQLite database"),
    ("short-file", lambda p: p.write_bytes(b"x"), "not a SQLite database"),
    (
        "foreign-sqlite",
        _sqlite_database("CREATE TABLE users (name TEXT)"),
        r"not a dataflow ledger \(its tables: users; no dataflow_schema table\)",
    ),
    (
        "table-less-sqlite",
        _sqlite_database("PRAGMA user_version = 7"),
        r"not a dataflow ledger \(it has no tables",
    ),
    ("directory", lambda p: p.mkdir(), "is a directory; name the ledger's file"),
]


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("create", [True, False], ids=["create", "no-create"])
@pytest.mark.parametrize(("make", "match"), [pytest.param(*r[1:], id=r[0]) for r in NOT_A_LEDGER])
def test_what_is_not_a_ledger_is_refused_and_left_as_it_is(tmp_path, make, match, create):
    """Never initialized over: an empty or foreign file may be a ledger that lost its data."""
    path = tmp_path / "ledger.db"
    make(path)
    before = _tree(tmp_path)
    with pytest.raises(NotALedgerError, match=match):
        Ledger.open(f"sqlite:///{path}", create=create)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("where", ["ledger.db", "a/b/ledger.db"])
def test_without_create_a_missing_ledger_is_refused_and_nothing_is_made(tmp_path, where):
    with pytest.raises(NotALedgerError, match=f"no ledger at .*{where}: the file does not exist"):
        Ledger.open(f"sqlite:///{tmp_path / where}", create=False)
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_postgres_is_an_operational_error():
    with pytest.raises(OperationalError, match=r"127\.0\.0\.1:1/none: the ledger is unreachable"):
        Ledger.open("postgresql+psycopg://nobody@127.0.0.1:1/none", busy_timeout=1)


@pytest.mark.parametrize("busy_timeout", [0, -1, "30", None])
def test_bad_busy_timeouts_are_refused(sqlite_url, busy_timeout):
    with pytest.raises(ValueError, match=f"got {busy_timeout!r}"):
        Ledger.open(sqlite_url, busy_timeout=busy_timeout)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        pytest.param(lambda w: list(w.ledger.events("")), ValueError, "got ''", id="events-run"),
        pytest.param(
            lambda w: list(w.ledger.events(None)), ValueError, "got None", id="events-run-none"
        ),
        pytest.param(
            lambda w: list(w.ledger.events(w.run_id, after_seq="3")),
            (TypeError, ValueError),
            "'3'",
            id="events-after-str",
        ),
        pytest.param(
            lambda w: list(w.ledger.events(w.run_id, after_seq=None)),
            (TypeError, ValueError),
            "None",
            id="events-after-none",
        ),
        pytest.param(
            lambda w: list(w.ledger.events(w.run_id, upto_seq="9")),
            (TypeError, ValueError),
            "'9'",
            id="events-upto-str",
        ),
        pytest.param(
            lambda w: next(w.ledger.follow(w.run_id, "3", timeout=0)),
            (TypeError, ValueError),
            "'3'",
            id="follow-after-str",
        ),
        pytest.param(
            lambda w: next(w.ledger.follow(w.run_id, poll_interval=1e10, timeout=0)),
            ValueError,
            "poll_interval must be a number of seconds from 0 to 3600, got 10000000000.0",
            id="follow-poll-huge",
        ),
        pytest.param(
            lambda w: next(w.ledger.follow(w.run_id, poll_interval=float("nan"), timeout=0)),
            ValueError,
            "poll_interval must be a non-negative number, got nan",
            id="follow-poll-nan",
        ),
        pytest.param(
            lambda w: next(w.ledger.follow(w.run_id, poll_interval=None, timeout=0)),
            ValueError,
            "poll_interval must be a number of seconds from 0 to 3600, got None",
            id="follow-poll-none",
        ),
        pytest.param(lambda w: w.ledger.head_seq(7), ValueError, "got 7", id="head_seq-run"),
        pytest.param(
            lambda w: w.ledger.kind_counts(w.run_id, upto_seq=-1),
            ValueError,
            "got -1",
            id="kind_counts-upto",
        ),
        pytest.param(lambda w: w.ledger.commits("", ["a"]), ValueError, "got ''", id="commits-run"),
        pytest.param(
            lambda w: w.ledger.commits(w.run_id, "abc"),
            TypeError,
            "'abc'",
            id="commits-str",
        ),
        pytest.param(
            lambda w: replay("sqlite:///x.db", w.run_id), TypeError, "got str", id="replay-ledger"
        ),
        pytest.param(lambda w: replay(w.ledger, ""), ValueError, "got ''", id="replay-run"),
        pytest.param(
            lambda w: replay(w.ledger, w.run_id, upto_seq=-1),
            ValueError,
            "got -1",
            id="replay-upto-negative",
        ),
        pytest.param(
            lambda w: replay(w.ledger, w.run_id, upto_seq="3"),
            ValueError,
            "got '3'",
            id="replay-upto-str",
        ),
        pytest.param(
            lambda w: replay(w.ledger, w.run_id, upto_seq=True),
            ValueError,
            "got True",
            id="replay-upto-bool",
        ),
    ],
)
def test_bad_ledger_reads_are_refused(world, call, error, match):
    check(world, call, error, match)


def test_replay_reports_a_hand_written_log_instead_of_crashing(ledger, run_id):
    """Writes the roles never make (no resume first, a stranger's ack) are violations."""
    with ledger.write(run_id, "test") as tx:
        tx.append(
            [
                NewEvent(
                    Kind.COMMIT,
                    "producer",
                    "a",
                    payload=SampleRef("a", "mem://s", 1).to_json(),
                    revision=0,
                ),
                NewEvent(Kind.LEASE, "rogue", "a"),
                NewEvent(Kind.ACK, "stranger", "a", step=1),
                NewEvent(Kind.ACK, "rogue", "a", step=1),
                NewEvent(Kind.NACK, "rogue", "a"),
                NewEvent(Kind.DATA_EPOCH, "rogue"),
                NewEvent(Kind.CHECKPOINT, "rogue", step=1),
                NewEvent("bogus", "rogue"),
            ]
        )
    problems = replay(ledger, run_id).verify()
    assert any("'stranger'" in p for p in problems)
    assert any("checkpoint before any resume" in p for p in problems)
    assert any("unknown event kind 'bogus'" in p for p in problems)


def test_replay_reports_stale_and_out_of_order_writes(ledger, run_id, emit, make_consumer):
    emit("a")
    make_consumer().resume()
    with ledger.write(run_id, "test") as tx:
        tx.append(
            [
                NewEvent(Kind.LEASE, "zombie", "a", epoch=0),
                NewEvent(
                    Kind.COMMIT,
                    "producer",
                    "a",
                    payload=SampleRef("a", "mem://s", 9).to_json(),
                    revision=-1,
                ),
            ]
        )
    problems = replay(ledger, run_id).verify()
    assert any("stale epoch 0" in p for p in problems)
    assert any("duplicate commit of 'a' revision -1" in p for p in problems)


def test_the_database_refuses_a_second_commit_of_a_revision(world):
    def commit_again(w):
        with w.ledger.write(w.run_id, "test") as tx:
            tx.append(
                [
                    NewEvent(
                        Kind.COMMIT,
                        "rogue",
                        "a",
                        revision=0,
                        payload=SampleRef("a", "mem://s", 9).to_json(),
                    )
                ]
            )

    check(world, commit_again, IntegrityError, "commit in run 'run'|test in run 'run'")
