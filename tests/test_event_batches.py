"""Batch rows (a lease, ack, nack or release naming many samples, schema 4) fold exactly as
the rows of one sample they stand for (the only shape before schema 4).

A property over random runs, folded in the model alone (no ledger): the same events
written one row per sample and in batches give the same state and the same violations.
The ledger-level paths (the consumer's writes, the migration of a schema-3 ledger) are in
tests/test_ledger_migration.py and the consumer tests.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow.model._errors import InvalidArgumentError
from dataflow.model._events import (
    MAX_BATCH_SAMPLES,
    Event,
    Kind,
    ack_payloads,
    batch_payloads,
    check_payload,
    dump_payload,
    expand_row,
    read_payload,
    row_samples,
    row_steps,
)
from dataflow.model._fold import RunState

RUN = "r"
IDS = [f"s{i}" for i in range(8)]
#: What a random run does next (leases and acks twice as often).
OPS = ["resume", "lease", "ack", "nack", "release", "checkpoint", "lease", "ack", "commit"]


def _ref(sample_id: str) -> str:
    ref = {"generation": 0, "metadata": {}, "sample_id": sample_id, "specs": {}, "store": "mem://x"}
    return json.dumps(ref, separators=(",", ":"), sort_keys=True)


class TwoLogs:
    """One run written twice: one row per sample, and in batch rows. A batch row takes the
    seq of the last of its single rows, so every other row has the same seq in both."""

    def __init__(self) -> None:
        self.single: list[tuple[Any, ...]] = []
        self.batched: list[tuple[Any, ...]] = []
        self.seq = 0
        self.batch_seq: dict[int, int] = {}  # seq of a single row -> seq of its batch row
        self.state = RunState(RUN)  # the single rows folded so far: what the next op draws from

    def plain(self, kind: str, *, sample_id: str | None = None, epoch: int = 0, **kw: Any) -> None:
        self.seq += 1
        row = (
            self.seq,
            kind,
            sample_id,
            kw.get("revision"),
            epoch,
            kw.get("step"),
            kw.get("actor", "c0"),
            kw.get("payload"),
            float(self.seq),
        )
        self.single.append(row)
        self.batched.append(row)
        self.state.apply(row)

    def batch(
        self, kind: str, ids: list[str], *, epoch: int, actor: str, step: Any = None, **fields: Any
    ) -> None:
        first = self.seq + 1
        revisions = fields.get("revisions")
        rows = []
        for n, sid in enumerate(ids):
            self.seq += 1
            if revisions is not None:
                payload = dump_payload({"revision": revisions[n]})
            else:
                payload = dump_payload(fields)
            rows.append((self.seq, kind, sid, None, epoch, step, actor, payload, float(self.seq)))
        (payload,) = batch_payloads(kind, ids, **fields)
        batched = (self.seq, kind, None, None, epoch, step, actor, payload, float(self.seq))
        assert expand_row(batched) == [(self.seq, *row[1:8], float(self.seq)) for row in rows]
        for seq in range(first, self.seq + 1):
            self.batch_seq[seq] = self.seq
        self.single += rows
        self.batched.append(batched)
        self.state.apply_rows(rows)

    def acks(self, steps: list[tuple[list[str], int]], *, epoch: int, actor: str) -> None:
        """The acks of several steps in one transaction (``Consumer.ack_many``): one row per
        sample and step in the single log, one ACK row for them all in the batched one."""
        first = self.seq + 1
        rows = []
        for ids, step in steps:
            for sid in ids:
                self.seq += 1
                rows.append((self.seq, Kind.ACK, sid, None, epoch, step, actor, None, 0.0))
        ids = [sid for batch, _ in steps for sid in batch]
        (payload, top), *_ = ack_payloads(ids, [step for batch, step in steps for _ in batch])
        batched = (self.seq, Kind.ACK, None, None, epoch, top, actor, payload, 0.0)
        assert [r[2] for r in expand_row(batched)] == ids
        assert [r[5] for r in expand_row(batched)] == row_steps(Kind.ACK, None, top, payload)
        assert row_steps(Kind.ACK, None, top, payload) == [r[5] for r in rows]
        for seq in range(first, self.seq + 1):
            self.batch_seq[seq] = self.seq
        self.single += rows
        self.batched.append(batched)
        self.state.apply_rows(rows)

    def violations(self, state: RunState, *, mapped: bool) -> list[str]:
        """verify() with each single row's seq named as its batch row's, duplicates once."""
        found = state.verify()
        if mapped:
            found = [
                re.sub(
                    r"^seq (\d+):", lambda m: f"seq {self.batch_seq.get(int(m[1]), int(m[1]))}:", v
                )
                for v in found
            ]
        return list(dict.fromkeys(found))


@st.composite
def runs(draw: st.DrawFn) -> TwoLogs:
    logs = TwoLogs()
    for sid in IDS[:5]:
        logs.plain(Kind.COMMIT, sample_id=sid, revision=0, actor="p", payload=_ref(sid))
    epoch = 0
    for _ in range(draw(st.integers(0, 25))):
        state = logs.state
        op = draw(
            st.sampled_from(
                [
                    "resume",
                    "lease",
                    "ack",
                    "nack",
                    "release",
                    "checkpoint",
                    "lease",
                    "ack",
                    "commit",
                    "acks",
                    "acks",
                ]
            )
        )
        if op == "resume" or (epoch == 0 and draw(st.booleans())):
            epoch += 1
            ckpt = draw(st.sampled_from([None, *state.checkpoints]))
            payload = {"world_size": 1, "max_attempts": draw(st.integers(1, 3))}
            payload["release_policy"] = draw(st.sampled_from(["on_checkpoint", "on_ack", "never"]))
            if ckpt is not None:
                payload["checkpoint_seq"], payload["checkpoint_step"] = ckpt.seq, ckpt.step
            logs.plain(Kind.RESUME, epoch=epoch, actor="c0", payload=dump_payload(payload))
            continue
        if op == "commit":
            sid = draw(st.sampled_from(IDS))
            revision = draw(
                st.sampled_from([0, state.revision(sid) + 1 if sid in state.committed else 0])
            )
            logs.plain(Kind.COMMIT, sample_id=sid, revision=revision, actor="p", payload=_ref(sid))
            continue
        row_epoch = draw(st.sampled_from([epoch] * 6 + [max(epoch - 1, 0)]))
        actor = draw(st.sampled_from(["c0"] * 4 + ["c1"]))
        if op == "checkpoint":
            step = draw(st.integers(0, 8))
            logs.plain(
                Kind.CHECKPOINT, epoch=row_epoch, step=step, actor=actor, payload='{"path":"/c"}'
            )
            continue
        likely = {
            "lease": list(state.pending),
            "ack": list(state.leased),
            "acks": list(state.leased),
            "nack": list(state.leased),
            "release": list(state.trained) + list(state.dead),
        }[op]
        ids = draw(
            st.lists(st.sampled_from(likely or IDS) | st.sampled_from(IDS), min_size=1, max_size=6)
        )
        if op == "lease":
            logs.batch(Kind.LEASE, ids, epoch=row_epoch, actor=actor)
        elif op == "ack":
            step = draw(st.integers(0, 8))
            logs.batch(Kind.ACK, ids, epoch=row_epoch, actor=actor, step=step)
        elif op == "acks":  # several steps in one transaction, in step order (or not)
            steps = draw(st.lists(st.integers(1, 8), min_size=len(ids), max_size=len(ids)))
            if draw(st.integers(0, 4)):
                steps.sort()
            cuts = sorted(draw(st.sets(st.integers(1, len(ids)), max_size=3)) | {len(ids)})
            groups, start = [], 0
            for cut in cuts:
                groups.append((ids[start:cut], steps[start]))
                start = cut
            logs.acks(groups, epoch=row_epoch, actor=actor)
        elif op == "nack":
            fields: dict[str, Any] = {"retryable": draw(st.booleans()), "reason": "why"}
            if draw(st.booleans()):
                fields["rank"] = 0
            logs.batch(Kind.NACK, ids, epoch=row_epoch, actor=actor, **fields)
        else:
            revisions = [draw(st.sampled_from([0, 0, 1])) for _ in ids]
            logs.batch(Kind.RELEASE, ids, epoch=row_epoch, actor=actor, revisions=revisions)
    return logs


@settings(max_examples=150, deadline=None)
@given(runs())
def test_batch_rows_fold_as_the_single_rows_they_stand_for(logs: TwoLogs) -> None:
    single = RunState(RUN).apply_rows(logs.single)
    batched = RunState(RUN).apply_rows(logs.batched)
    assert batched.observable() == single.observable()
    assert logs.violations(batched, mapped=False) == logs.violations(single, mapped=True)
    # Folding the batch rows one at a time, as a live fold does, gives the same.
    live = RunState(RUN)
    for row in logs.batched:
        live.apply(row)
    assert live.observable() == batched.observable()


def commit(state: RunState, *ids: str) -> int:
    for sid in ids:
        state.apply((state.head_seq + 1, Kind.COMMIT, sid, 0, 0, None, "p", _ref(sid), 0.0))
    resume = dump_payload({"world_size": 1})
    state.apply((state.head_seq + 1, Kind.RESUME, None, None, 1, None, "c0", resume, 0.0))
    return state.head_seq


def test_a_violation_inside_a_batch_names_the_row_and_the_sample() -> None:
    state = RunState(RUN)
    seq = commit(state, "a", "b")
    (lease,) = batch_payloads(Kind.LEASE, ["a"])
    (ack,) = batch_payloads(Kind.ACK, ["a", "b"])
    state.apply_rows(
        [
            (seq + 1, Kind.LEASE, None, None, 1, None, "c0", lease, 0.0),
            (seq + 2, Kind.ACK, None, None, 1, 1, "c0", ack, 0.0),
        ]
    )
    assert state.trained == {"a": 1}
    assert state.violations == [f"seq {seq + 2}: ack of 'b' by 'c0', which did not lease it"]


@pytest.mark.parametrize(
    ("kind", "sample_id", "payload", "why"),
    [
        (Kind.LEASE, None, None, "must name its `samples`"),
        (Kind.ACK, "a", '{"samples":["a"]}', "must not name `samples`"),
        (Kind.LEASE, None, '{"samples":[]}', "samples"),
        (Kind.LEASE, None, '{"samples":[""]}', "samples"),
        (Kind.RELEASE, None, '{"revisions":[0,1],"samples":["a"]}', "1 samples but 2 revisions"),
        (Kind.RELEASE, None, '{"samples":["a"]}', "both its `samples` and their `revisions`"),
        (Kind.ACK, None, '{"samples":["a"],"steps":[1,1]}', "1 samples but 2 steps"),
        (Kind.ACK, None, '{"samples":["a"],"steps":[0]}', "steps"),
        (Kind.ACK, None, '{"samples":["a"],"steps":[true]}', "steps"),
        (Kind.ACK, None, '{"steps":[1]}', "`steps` go with its `samples`"),
        (Kind.ACK, None, '{"samples":["a"],"steps":[2]}', "must hold the highest, 2"),
    ],
)
def test_a_malformed_batch_row_is_a_violation_of_its_seq(
    kind: str, sample_id: str | None, payload: str | None, why: str
) -> None:
    state = RunState(RUN)
    seq = commit(state, "a")
    state.apply((seq + 1, Kind.LEASE, "a", None, 1, None, "c0", None, 0.0))
    state.apply((seq + 2, kind, sample_id, None, 1, 1, "c0", payload, 0.0))
    (violation,) = state.violations
    assert violation.startswith(f"seq {seq + 2}: unreadable {kind} event")
    assert why in violation
    assert state.leased == {"a": "c0"}  # nothing of the row was applied


def test_a_batch_is_bounded_and_split_by_its_writers() -> None:
    ids = [f"s{i}" for i in range(MAX_BATCH_SAMPLES + 3)]
    payloads = batch_payloads(Kind.RELEASE, ids, revisions=[0] * len(ids))
    assert [len(read_payload(Kind.RELEASE, p).samples) for p in payloads] == [MAX_BATCH_SAMPLES, 3]
    too_many = json.dumps({"samples": ids})
    with pytest.raises(InvalidArgumentError, match=r"a lease event's payload: .*samples"):
        check_payload(Kind.LEASE, too_many)


def test_the_samples_of_a_row_in_either_shape() -> None:
    (ack,) = batch_payloads(Kind.ACK, ["a", "b"])
    assert row_samples(Kind.ACK, None, ack) == ["a", "b"]
    assert row_samples(Kind.ACK, "a", None) == ["a"]
    assert row_samples(Kind.CHECKPOINT, None, '{"path":"/c"}') == []
    assert row_samples(Kind.ACK, None, "not json") == []
    event = Event(1, RUN, Kind.ACK, None, 1, 2, "c0", json.loads(ack))
    assert event.sample_ids == ["a", "b"]
    assert Event(1, RUN, Kind.ACK, "a", 1, 2, "c0").sample_ids == ["a"]


def test_an_ack_row_of_several_steps_gives_each_sample_its_step() -> None:
    state = RunState(RUN)
    seq = commit(state, "a", "b", "c")
    (lease,) = batch_payloads(Kind.LEASE, ["a", "b", "c"])
    ((ack, top),) = ack_payloads(["a", "b", "c"], [1, 1, 2])
    assert (json.loads(ack), top) == ({"samples": ["a", "b", "c"], "steps": [1, 1, 2]}, 2)
    assert ack_payloads(["a", "b"], [3, 3]) == [('{"samples":["a","b"]}', 3)]  # one step
    state.apply_rows(
        [
            (seq + 1, Kind.LEASE, None, None, 1, None, "c0", lease, 0.0),
            (seq + 2, Kind.ACK, None, None, 1, top, "c0", ack, 0.0),
        ]
    )
    assert state.trained == {"a": 1, "b": 1, "c": 2}
    assert state.verify() == []
    event = Event(seq + 2, RUN, Kind.ACK, None, 1, top, "c0", json.loads(ack))
    assert event.sample_steps == [1, 1, 2]
    assert row_steps(Kind.ACK, None, top, ack) == [1, 1, 2]
    assert row_steps(Kind.ACK, "a", 4, None) == [4]


def test_an_ack_row_whose_step_column_is_not_its_highest_step_is_a_violation() -> None:
    state = RunState(RUN)
    seq = commit(state, "a", "b")
    (lease,) = batch_payloads(Kind.LEASE, ["a", "b"])
    ack = '{"samples":["a","b"],"steps":[1,3]}'
    state.apply_rows(
        [
            (seq + 1, Kind.LEASE, None, None, 1, None, "c0", lease, 0.0),
            (seq + 2, Kind.ACK, None, None, 1, 2, "c0", ack, 0.0),
        ]
    )
    (violation,) = state.violations
    assert violation.startswith(f"seq {seq + 2}: unreadable ack event")
    assert "step column" in violation and "must hold the highest, 3" in violation
    assert state.trained == {}  # none of the row was applied
    with pytest.raises(InvalidArgumentError, match="1 samples but 2 steps"):
        check_payload(Kind.ACK, '{"samples":["a"],"steps":[1,2]}')
