"""Property: exclusions hold across resumes from any checkpoint, and include undoes them.

Random runs on a real SQLite ledger: leases, acks, checkpoints, exclusions and
inclusions (from the consumer and from outside), resumes from random checkpoints.
After every step: no sample is leased after its exclusion (until an include), the
log verifies clean, and an included, untrained, unleased sample is pending again.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.live._exclusions import write_exclusions
from stores import LocalFeatureStore

IDS = [f"s{i}" for i in range(8)]

_op = st.one_of(
    st.tuples(st.just("train"), st.integers(1, 3)),
    st.tuples(st.just("checkpoint")),
    st.tuples(st.just("exclude"), st.sets(st.sampled_from(IDS), min_size=1, max_size=3)),
    st.tuples(st.just("exclude_outside"), st.sets(st.sampled_from(IDS), min_size=1, max_size=2)),
    st.tuples(st.just("include"), st.integers(0, 7)),
    st.tuples(st.just("resume"), st.integers(0, 5)),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_op, min_size=1, max_size=14))
def test_exclusions_hold_across_random_resumes(ops) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalFeatureStore() as store:
        ledger = Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        try:
            _run(ledger, store, ops)
        finally:
            ledger.close()


def _run(ledger: Ledger, store: LocalFeatureStore, ops: list[tuple]) -> None:
    producer = Producer(ledger, store, run_id="r")
    producer.emit_many((s, {"x": torch.zeros(1)}) for s in IDS)
    producer.close()
    consumer = Consumer(ledger, store, run_id="r", consumer_id="t", release_policy="never")
    consumer.resume(None)
    step, excluded = 0, set()
    for op in ops:
        state = consumer.state
        if op[0] == "train":
            step += 1
            got = [r.sample_id for r in consumer.lease(op[1])]
            assert not set(got) & excluded, (got, excluded)
            consumer.ack(got, step=step)
        elif op[0] == "checkpoint" and step > state.last_checkpoint_step:
            consumer.record_checkpoint(step, f"s3://b/{step}")
        elif op[0] in ("exclude", "exclude_outside"):
            if op[0] == "exclude":
                consumer.exclude(sorted(op[1]), reason="bad")
            else:
                write_exclusions(ledger, "r", sorted(op[1]), reason="bad outside")
                consumer.refresh()
            excluded |= op[1]
        elif op[0] == "include" and excluded:
            sid = sorted(excluded)[op[1] % len(excluded)]
            consumer.include([sid], reason="fine")
            excluded.discard(sid)
            state = consumer.state
            if sid not in state.trained and sid not in state.leased:
                assert state.is_pending(sid)
        elif op[0] == "resume":
            usable = [c.step for c in state.lineage_checkpoints()]
            which = usable[op[1] % len(usable)] if usable and op[1] else None
            consumer.resume(which)
            step = 0 if which is None else which
        state = consumer.state
        assert set(state.excluded) == excluded
        assert not any(state.is_pending(s) for s in excluded)
        assert state.verify() == []
    while refs := consumer.lease(100):
        got = [r.sample_id for r in refs]
        assert not set(got) & excluded
        step += 1
        consumer.ack(got, step=step)
    final = replay(ledger, "r")
    assert final.verify() == []
    assert set(final.excluded) == excluded
    # committed = trained in the final lineage, excluded, or still to train (none left)
    assert set(final.trained) | excluded == set(IDS)
