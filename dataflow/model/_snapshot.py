"""Snapshots of a run's fold, so a restart folds only the tail of the log.

A snapshot is a RunState as plain data (JSON, zlib-compressed), stored in the
ledger's ``dataflow_snapshots`` table with the seq it covers and the sha256 of
its body. It holds every field of the fold but no ref JSON: a restored state
reads refs from the ledger when asked (``RunState(ref_source=...)``), so a
snapshot costs a few dozen bytes per sample.

Sample ids appear once, in commit order (``ids``); everything else names a
sample by its index there. Decoding gives back the very state the full fold
reaches at that seq: tests/test_snapshots.py checks it against full replays.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from dataflow.model._errors import ArgumentTypeError
from dataflow.model._fold import RefSource, RunState
from dataflow.model._lineage import Checkpoint, LineageBranch, ReconcilePlan, _Acks

#: The layout of a snapshot body and the fold it was taken with. Bump it whenever
#: RunState's fields or the meaning of an event change: older snapshots are then
#: skipped (a full replay), never misread.
FORMAT = 4


_INT64 = range(-(2**63), 2**63)
_MAGIC = b"DFSNAP01"
_LENGTH = struct.Struct("<Q")


class _Columns:
    """Int columns of a body, each its own zlib segment of int64s after the JSON one.

    Decoding one makes an array, never an int object per value, and only one
    column is inflated at a time: a restart's memory peak stays near what it keeps.
    """

    def __init__(self, segments: list[bytes] | None = None) -> None:
        self.segments = segments if segments is not None else []

    def put(self, values: Iterable[Any]) -> Any:
        """A reference to ``values`` as a segment when they are all int64s; else the list."""
        values = list(values)
        if all(type(v) is int and v in _INT64 for v in values):
            self.segments.append(zlib.compress(array("q", values).tobytes(), 1))
            return {"column": len(self.segments) - 1}
        return values

    def get(self, column: Any) -> Any:
        """What :meth:`put` returned, back: an array of int64s, or the list as it was."""
        if isinstance(column, dict):
            values = array("q")
            values.frombytes(zlib.decompress(self.segments[column["column"]]))
            return values
        if not isinstance(column, list):
            raise TypeError(f"a snapshot column is a {type(column).__name__}")
        return column


def check_state(state: object) -> None:
    """ArgumentTypeError unless ``state`` is a RunState (what :func:`encode` takes)."""
    if not isinstance(state, RunState):
        raise ArgumentTypeError(f"state must be a RunState, got {type(state).__name__}")


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def encode(state: RunState) -> bytes:
    """``state`` as a snapshot body: magic, then length-prefixed zlib segments."""
    columns = _Columns()
    header = zlib.compress(json.dumps(_dump(state, columns), separators=(",", ":")).encode(), 1)
    parts = [_MAGIC]
    for segment in (header, *columns.segments):
        parts += [_LENGTH.pack(len(segment)), segment]
    return b"".join(parts)


def decode(run_id: str, body: bytes, *, ref_source: RefSource | None) -> RunState:
    """The RunState a snapshot body holds; ValueError/KeyError/TypeError if it is damaged."""
    view = memoryview(body)
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise ValueError("a snapshot body must start with " + _MAGIC.decode())
    segments, offset = [], len(_MAGIC)
    while offset < len(view):
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + length > len(view):
            raise ValueError("a snapshot segment runs past the end of the body")
        segments.append(view[offset : offset + length])
        offset += length
    if not segments:
        raise ValueError("a snapshot body holds no segment")
    data = json.loads(zlib.decompress(segments[0]))
    if data.get("format") != FORMAT or data.get("run_id") != run_id:
        raise ValueError(f"snapshot of format {data.get('format')!r}, run {data.get('run_id')!r}")
    return _load(data, _Columns(segments[1:]), RunState(run_id, ref_source=ref_source))


def _dump(state: RunState, columns: _Columns | None = None) -> dict[str, Any]:
    """``state`` as plain data; int columns go to ``columns`` (lists when None: for tests)."""
    put = columns.put if columns is not None else list
    ids = list(state._commits)
    index = {sid: i for i, sid in enumerate(ids)}

    def many(sids: Iterable[str]) -> Any:
        return put(index[s] for s in sids)

    def sorted_many(sids: Iterable[str]) -> Any:
        return put(sorted(index[s] for s in sids))

    def pairs(mapping: Mapping[str, Any]) -> list[Any]:
        return [many(mapping), put(mapping.values())]

    return {
        "format": FORMAT,
        "run_id": state.run_id,
        "head_seq": state.head_seq,
        "epoch": state.epoch,
        "data_epoch": state.data_epoch,
        "ids": ids,
        "first_seqs": put(state._first_seqs),
        "revisions": pairs(state._revisions),
        "leased": pairs(state.leased),
        "trained": pairs(state.trained),
        "released": sorted_many(state.released),
        "dead": pairs(state.dead),
        "lost": pairs(state.lost),
        "attempts": pairs(state.attempts),
        "regenerate": many(state.regenerate),
        "excluded": pairs(state.excluded),
        "excluded_total": state.excluded_total,
        "checkpoints": [_checkpoint_row(c) for c in state.checkpoints],
        "removed_checkpoints": list(state.removed_checkpoints.items()),
        "producers": sorted(state.producers),
        "producer_commits": [[p, many(ids)] for p, ids in state.producer_commits.items()],
        "closed": sorted(state.closed),
        "unstreamed": sorted(state.unstreamed),
        "producer_epochs": state.producer_epochs,
        "store_uris": list(state.store_uris),
        "plans": [_plan_row(plan, many, sorted_many) for plan in state.plans.values()],
        "violations": state.violations,
        "pending": [[rank, many(queue)] for rank, queue in state._pending.items()],
        "requeued": sorted_many(state._requeued),
        "queue_pos": pairs(state._queue_pos),
        "lessee_rank": pairs(state._lessee_rank),
        "lost_rank": pairs(state._lost_rank),
        "next_pos": state._next_pos,
        "next_owner": state._next_owner,
        "unreleased_acks": pairs(state._unreleased_acks),
        "epochs": [_epoch_row(node, many, put) for node in state._epochs.values()],
        "world_size": state._world_size,
        "resumes": state._resumes,
        "order_args": list(state._order_args),
    }


def _checkpoint_row(c: Checkpoint) -> list[Any]:
    return [c.seq, c.epoch, c.step, c.path, c.data_epoch, c.digest]


def _plan_row(plan: ReconcilePlan, many: Any, sorted_many: Any) -> dict[str, Any]:
    return {
        "epoch": plan.epoch,
        "checkpoint_step": plan.checkpoint_step,
        "requeued": many(plan.requeued),
        "released": many(plan.released),
        "regenerate": many(plan.regenerate),
        "data_epoch": plan.data_epoch,
        "world_size": plan.world_size,
        "rank": plan.rank,
        "checkpoint": None if plan.checkpoint is None else _checkpoint_row(plan.checkpoint),
    }


def _epoch_row(node: LineageBranch, many: Any, put: Any) -> dict[str, Any]:
    return {
        "number": node.number,
        "parent": node.parent,
        "cut_step": node.cut_step,
        "cut_seq": node.cut_seq,
        "base_data_epoch": node.base_data_epoch,
        "policy": node.policy,
        "world_size": node.world_size,
        "max_attempts": node.max_attempts,
        "order_seed": node.order_seed,
        "ack_sids": many(node.acks.sids),
        "ack_steps": put(node.acks.steps),
        "ack_data_epochs": put(node.acks.data_epochs),
        "data_epochs": node.data_epochs,
        "last_checkpoint_step": node.last_checkpoint_step,
        "ack_steps_by_consumer": node.ack_steps,
    }


def _load(data: dict[str, Any], columns: _Columns, state: RunState) -> RunState:
    ids: list[str] = data["ids"]
    steps: dict[int, int] = {}  # one int object per step, as the fold keeps them

    def many(column: Any) -> list[str]:
        return list(map(ids.__getitem__, columns.get(column)))

    def mapping(row: list[Any], *, shared: bool = False) -> dict[str, Any]:
        keys, values = columns.get(row[0]), columns.get(row[1])
        if len(keys) != len(values):
            raise ValueError("a snapshot mapping has keys and values of different lengths")
        if shared and isinstance(values, array):
            values = values.tolist()
            values = map(steps.setdefault, values, values)
        return dict(zip(map(ids.__getitem__, keys), values, strict=True))  # loops in C

    state.head_seq = data["head_seq"]
    state.epoch = data["epoch"]
    state.data_epoch = data["data_epoch"]
    state._commits = dict(zip(ids, ids, strict=True))
    if len(state._commits) != len(ids):
        raise ValueError("a snapshot lists a sample id twice")
    state._first_seqs = array("q", columns.get(data["first_seqs"]))
    if len(state._first_seqs) != len(ids):
        raise ValueError("a snapshot has a first seq per id missing")
    state._revisions = mapping(data["revisions"])
    state.leased = mapping(data["leased"])
    state.trained = mapping(data["trained"], shared=True)
    state._steps = steps
    state.released = set(many(data["released"]))
    state.dead = mapping(data["dead"])
    state.lost = mapping(data["lost"])
    state.attempts = mapping(data["attempts"])
    state.regenerate = dict.fromkeys(many(data["regenerate"]))
    state.excluded = mapping(data["excluded"])
    state.excluded_total = int(data["excluded_total"])
    state.checkpoints = [Checkpoint(*row) for row in data["checkpoints"]]
    state.removed_checkpoints = {seq: reason for seq, reason in data["removed_checkpoints"]}
    state.producers = set(data["producers"])
    state.producer_commits = {str(p): many(ids) for p, ids in data["producer_commits"]}
    state.closed = set(data["closed"])
    state.unstreamed = set(data["unstreamed"])
    state.producer_epochs = {str(p): int(e) for p, e in data["producer_epochs"].items()}
    state.store_uris = dict.fromkeys(map(str, data["store_uris"]))
    state.plans = {}
    for row in data["plans"]:
        checkpoint = None if row["checkpoint"] is None else Checkpoint(*row["checkpoint"])
        plan = ReconcilePlan(
            epoch=row["epoch"],
            checkpoint_step=row["checkpoint_step"],
            requeued=tuple(many(row["requeued"])),
            released=tuple(many(row["released"])),
            regenerate=tuple(many(row["regenerate"])),
            trained=state._trained_at(checkpoint),
            data_epoch=row["data_epoch"],
            world_size=row["world_size"],
            rank=row["rank"],
            checkpoint=checkpoint,
        )
        state.plans[plan.epoch] = plan
    state.violations = list(data["violations"])
    state._pending = {rank: dict.fromkeys(many(queue)) for rank, queue in data["pending"]}
    state._requeued = set(many(data["requeued"]))
    state._queue_pos = mapping(data["queue_pos"])
    state._lessee_rank = mapping(data["lessee_rank"])
    state._lost_rank = mapping(data["lost_rank"])
    state._next_pos = data["next_pos"]
    state._next_owner = data["next_owner"]
    state._unreleased_acks = mapping(data["unreleased_acks"], shared=True)
    state._epochs = {}
    for row in data["epochs"]:
        acks = _Acks()
        acks.sids = many(row["ack_sids"])
        acks.steps = array("q", columns.get(row["ack_steps"]))
        acks.data_epochs = array("l", columns.get(row["ack_data_epochs"]))
        if not len(acks.sids) == len(acks.steps) == len(acks.data_epochs):
            raise ValueError("a snapshot's acks have columns of different lengths")
        node = LineageBranch(
            number=row["number"],
            parent=row["parent"],
            cut_step=row["cut_step"],
            cut_seq=row["cut_seq"],
            base_data_epoch=row["base_data_epoch"],
            policy=row["policy"],
            world_size=row["world_size"],
            max_attempts=row["max_attempts"],
            order_seed=row["order_seed"],
            acks=acks,
            data_epochs=[tuple(d) for d in row["data_epochs"]],  # type: ignore[misc]
            last_checkpoint_step=row["last_checkpoint_step"],
            ack_steps=dict(row["ack_steps_by_consumer"]),
        )
        state._epochs[node.number] = node
    state._world_size = data["world_size"]
    state._resumes = list(data["resumes"])
    state._order_args = tuple(data["order_args"])  # type: ignore[assignment]
    return state
