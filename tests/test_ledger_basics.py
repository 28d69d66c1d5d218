"""The ledger contract on SQLite and PostgreSQL: commits, leases, acks, releases, reads."""

import logging
import os
import threading
import time
import warnings

import pytest
import sqlalchemy
import torch
from _paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture

from dataflow import (
    BadFrameError,
    Consumer,
    Event,
    Kind,
    Ledger,
    LedgerStateError,
    Producer,
    RefSender,
    SampleRef,
    SchemaVersionError,
    StaleRefError,
    StoreStats,
    replay,
)
from dataflow.live import _consumer
from dataflow.recorder import _ledger
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from stores import LocalFeatureStore


def commit_events(ledger, run_id, sample_id=None):
    return [
        e
        for e in ledger.events(run_id)
        if e.kind == Kind.COMMIT and sample_id in (None, e.sample_id)
    ]


def id_of(tensors) -> str:
    """The sample id that conftest's ``emit`` wrote into the features."""
    return tensors["x"].numpy().tobytes().decode()


# -- commits and dedup ----------------------------------------------------------------


def test_emit_commits_a_readable_ref(ledger, store, producer, run_id):
    ref = producer.emit("s-1", {"x": torch.arange(6.0).reshape(2, 3)}, metadata={"len": 6})
    assert ref.sample_id == "s-1"
    assert ref.store == store.uri
    assert ref.metadata == {"len": 6}
    assert torch.equal(store.get(ref)["x"], torch.arange(6.0).reshape(2, 3))
    ((revision, payload),) = ledger.commits(run_id, ["s-1", "never"]).values()
    assert revision == 0
    assert SampleRef.from_json(payload) == ref
    assert ledger.head_seq(run_id) == commit_events(ledger, run_id)[0].seq


def test_duplicate_emit_returns_none_and_keeps_one_live_copy(ledger, store, producer, run_id):
    ref = producer.emit("a", {"x": torch.ones(3)})
    head = ledger.head_seq(run_id)

    assert producer.emit("a", {"x": torch.zeros(3)}) is None
    assert ledger.head_seq(run_id) == head
    assert store.stats() == StoreStats(objects=1, bytes=12)
    committed = replay(ledger, run_id).committed["a"]
    assert committed == ref
    assert torch.equal(store.get(committed)["x"], torch.ones(3))
    assert len(commit_events(ledger, run_id, "a")) == 1


def test_emit_many_skips_known_ids_and_keeps_item_order(ledger, store, producer, run_id, emit):
    emit("a")
    refs = producer.emit_many(
        [
            ("b", {"x": torch.ones(1)}),
            ("a", {"x": torch.ones(1)}),
            ("c", {"x": torch.ones(1)}, {"k": "v"}),
        ]
    )
    assert [r and r.sample_id for r in refs] == ["b", None, "c"]
    assert refs[2].metadata == {"k": "v"}
    assert [e.sample_id for e in commit_events(ledger, run_id)] == ["a", "b", "c"]
    assert store.stats().objects == 3


def test_a_second_put_to_a_shared_store_is_committed_as_the_live_revision(ledger, store, run_id):
    # Both producers passed the "already committed?" check; the second put
    # superseded the first one's features, so the second becomes revision 1.
    first, second = (Producer(ledger, store, run_id=run_id, producer_id=p) for p in ("p1", "p2"))
    stale = store.put("a", {"x": torch.zeros(2)})
    live = store.put("a", {"x": torch.ones(2)})
    assert first.commit([stale]) == [stale]
    assert second.commit([live]) == [None]

    state = replay(ledger, run_id)
    assert state.committed["a"] == live
    assert state.revision("a") == 1
    assert torch.equal(store.get(state.committed["a"])["x"], torch.ones(2))
    assert state.pending == ["a"]


@pytest.mark.parametrize("offset", [0, 1000], ids=["same-generation", "other-generation"])
def test_losing_a_commit_race_to_another_store_deletes_only_its_own_features(
    ledger, store, run_id, offset
):
    # Both producers passed the "already committed?" check, then the one whose
    # store lives in another process committed first. Our put cannot have
    # superseded features in another store, whatever their generation number.
    ours = store.put("a", {"x": torch.ones(2)})
    theirs = SampleRef("a", "mem://other-process", ours.generation + offset, ours.specs)
    with LocalFeatureStore() as elsewhere:
        assert Producer(ledger, elsewhere, run_id=run_id, producer_id="p1").commit([theirs])
    loser = Producer(ledger, store, run_id=run_id, producer_id="p2")

    assert loser.commit([ours]) == [None]
    assert not store.exists(ours)
    assert replay(ledger, run_id).committed["a"] == theirs
    assert len(commit_events(ledger, run_id, "a")) == 1


# -- leases, acks, nacks --------------------------------------------------------------


def test_lease_follows_commit_order(emit, make_consumer, store):
    emit("c", "a", "b")
    cons = make_consumer()
    cons.resume()
    emit("d")
    first = cons.lease(2)
    rest = cons.lease(10)
    assert [r.sample_id for r in first + rest] == ["c", "a", "b", "d"]
    assert [id_of(cons.load(r)) for r in first + rest] == ["c", "a", "b", "d"]
    assert cons.lease(10) == []
    assert set(cons.state.leased) == {"a", "b", "c", "d"}


def test_ack_records_the_step(ledger, emit, make_consumer, run_id):
    emit("a", "b", "c")
    cons = make_consumer()
    cons.resume()
    refs = cons.lease(2)
    cons.ack(refs, step=7)
    cons.lease(1)
    cons.ack(["c"], step=8)
    assert cons.state.trained == {"a": 7, "b": 7, "c": 8}
    assert cons.state.leased == {}
    acks = [(e.sample_ids, e.step, e.actor) for e in ledger.events(run_id) if e.kind == Kind.ACK]
    # One batch row per ack call (schema 4): its samples, the step, the consumer.
    assert acks == [(["a", "b"], 7, "trainer"), (["c"], 8, "trainer")]


def test_retryable_nack_makes_the_sample_pending_again_until_max_attempts(emit, make_consumer):
    emit("a", "b")
    cons = make_consumer()
    cons.resume()
    assert [r.sample_id for r in cons.lease(1)] == ["a"]
    cons.nack(["a"], reason="loader hiccup")
    assert cons.state.pending == ["b", "a"]
    assert [r.sample_id for r in cons.lease(2)] == ["b", "a"]
    cons.nack(["a"])
    assert [r.sample_id for r in cons.lease(1)] == ["a"]
    cons.nack(["a"], reason="loader hiccup")

    assert "a" in cons.state.dead
    assert "loader hiccup" in cons.state.dead["a"]
    assert "attempt 3" in cons.state.dead["a"]
    assert cons.state.pending == []
    assert cons.lease(5) == []


def test_non_retryable_nack_is_dead_at_once_with_its_reason(emit, make_consumer):
    emit("a", "b")
    cons = make_consumer(max_attempts=5)
    cons.resume()
    cons.lease(2)
    cons.nack(["a"], retryable=False, reason="corrupt sample")
    cons.nack(["b"])
    assert list(cons.state.dead) == ["a"]
    assert "corrupt sample" in cons.state.dead["a"]
    assert cons.state.pending == ["b"]


def test_max_attempts_is_configurable(emit, make_consumer):
    emit("a")
    cons = make_consumer(max_attempts=1)
    cons.resume()
    cons.lease(1)
    cons.nack(["a"])
    assert "a" in cons.state.dead


def test_a_consumer_is_drained_once_every_producer_closed_and_its_queue_is_empty(
    ledger, store, emit, make_consumer, run_id
):
    emit("a", "b")
    other = Producer(ledger, store, run_id=run_id, producer_id="other")
    other.emit("c", {"x": torch.ones(1)})
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(2), step=1)
    held = cons.lease(1)
    other.close()
    cons.refresh()
    assert (cons.drained, cons.finished) == (False, False)  # "producer" has not closed
    Producer(ledger, store, run_id=run_id).close()
    cons.refresh()
    assert (cons.drained, cons.finished) == (True, False)  # it still holds c
    assert cons.lease(1, timeout=None) == []
    assert list(cons.batches(2)) == []
    cons.ack(held, step=2)
    assert (cons.drained, cons.finished) == (True, True)


# -- checkpoints and releases ----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "objects_after_ack", "objects_after_checkpoint"),
    [("on_checkpoint", 4, 2), ("on_ack", 2, 2), ("never", 4, 4)],
)
def test_release_policy_decides_when_features_are_freed(
    emit, make_consumer, store, policy, objects_after_ack, objects_after_checkpoint
):
    refs = emit("a", "b", "c", "d")
    cons = make_consumer(release_policy=policy)
    cons.resume()
    cons.ack(cons.lease(2), step=1)
    assert store.stats() == StoreStats(objects_after_ack, objects_after_ack)  # 1 byte per sample

    checkpoint = cons.checkpoint(1, ckpt("1"))
    assert (checkpoint.step, checkpoint.path, checkpoint.epoch) == (1, ckpt("1"), 1)
    assert store.stats() == StoreStats(objects_after_checkpoint, objects_after_checkpoint)
    released = {"a", "b"} if policy != "never" else set()
    assert cons.state.released == released
    for ref in refs:
        assert store.exists(ref) is (ref.sample_id not in released)
    if released:
        with pytest.raises(StaleRefError):
            store.get(refs[0])


def test_checkpoint_releases_only_samples_trained_up_to_its_step(emit, make_consumer, store):
    emit("a", "b", "c")
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(1), step=1)
    cons.ack(cons.lease(1), step=5)
    cons.checkpoint(3, ckpt("3"))
    assert cons.state.released == {"a"}
    cons.ack(cons.lease(1), step=6)  # not 4: a consumer's acks never go back to a lower step
    cons.checkpoint(6, ckpt("6"))
    assert cons.state.released == {"a", "b", "c"}
    assert store.stats().objects == 0


def test_resume_releases_the_trained_features_a_never_policy_kept(emit, make_consumer, store):
    emit("a", "b", "c")
    first = make_consumer("first", release_policy="never")
    first.resume()
    first.ack(first.lease(2), step=1)
    first.checkpoint(1, ckpt("1"))
    assert store.stats().objects == 3

    plan = make_consumer("second").resume()
    assert plan.released == ("a", "b")
    assert plan.requeued == ("c",)
    assert store.stats().objects == 1


def test_acks_must_come_after_the_last_checkpoint_and_checkpoints_must_increase(
    emit, make_consumer
):
    emit("a", "b")
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(1), step=2)
    cons.checkpoint(2, ckpt("2"))
    refs = cons.lease(1)
    with pytest.raises(LedgerStateError, match="step 2"):
        cons.ack(refs, step=2)
    with pytest.raises(LedgerStateError, match="step 1"):
        cons.checkpoint(1, ckpt("1"))
    cons.ack(refs, step=3)
    cons.checkpoint(3, ckpt("3"))
    assert [c.step for c in cons.state.checkpoints] == [2, 3]


# -- reading: replay, follow, runs -------------------------------------------------------


def test_replay_equals_the_live_state_of_the_consumer(ledger, emit, make_consumer, run_id):
    emit("a", "b", "c", "d", "e")
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(2), step=1)
    cons.nack(cons.lease(1), reason="flaky")
    cons.checkpoint(1, ckpt("1"))
    emit("f")
    cons.lease(2)
    emit("g")  # after the consumer's last read: a replay up to its head must not see it

    live = cons.state.snapshot()
    assert replay(ledger, run_id, upto_seq=cons.state.head_seq).snapshot() == live
    assert replay(ledger, run_id).snapshot() != live
    assert replay(ledger, run_id).verify() == []
    assert cons.lease(10)  # catches up
    assert replay(ledger, run_id).snapshot() == cons.state.snapshot()


def test_replay_up_to_a_seq_stops_there(ledger, emit, run_id):
    emit("a")
    head = ledger.head_seq(run_id)
    emit("b")
    assert list(replay(ledger, run_id, upto_seq=head).committed) == ["a"]
    empty = replay(ledger, run_id, upto_seq=0)
    assert (empty.head_seq, dict(empty.committed)) == (0, {})


def test_follow_tails_live_events_in_order(ledger, emit, make_consumer, run_id):
    tail = ledger.follow(run_id, timeout=30)  # the timeout only guards against a hang
    emit("a")
    seen = [next(tail), next(tail)]  # the producer's claim, and its commit
    emit("b", "c")
    cons = make_consumer()
    cons.resume()
    cons.ack(cons.lease(1), step=1)
    seen += [next(tail) for _ in range(5)]
    tail.close()

    everything = list(ledger.events(run_id))
    assert [e.kind for e in everything] == [
        Kind.CLAIM,
        Kind.COMMIT,
        Kind.COMMIT,
        Kind.COMMIT,
        Kind.RESUME,
        Kind.LEASE,
        Kind.ACK,
    ]
    assert seen == everything
    assert [e.seq for e in everything] == sorted({e.seq for e in everything})


def test_follow_starts_after_a_seq_and_stops_when_idle(ledger, emit, run_id):
    emit("a", "b", "c")
    first = next(e.seq for e in ledger.events(run_id) if e.kind == Kind.COMMIT)
    assert [e.sample_id for e in ledger.follow(run_id, first, timeout=0)] == ["b", "c"]
    assert list(ledger.follow(run_id, ledger.head_seq(run_id), timeout=0)) == []


def test_events_between_seqs(ledger, emit, run_id):
    emit("a", "b", "c", "d")
    seqs = [e.seq for e in ledger.events(run_id) if e.kind == Kind.COMMIT]
    picked = ledger.events(run_id, after_seq=seqs[0], upto_seq=seqs[2])
    assert [e.sample_id for e in picked] == ["b", "c"]


def test_reads_page_through_a_long_log(ledger, emit, run_id, monkeypatch):
    emit(*(f"s{i}" for i in range(7)))
    everything = list(ledger.events(run_id))
    monkeypatch.setattr(_ledger, "_PAGE", 2)
    assert list(ledger.events(run_id)) == everything
    assert list(ledger.events(run_id, after_seq=everything[1].seq)) == everything[2:]
    assert list(ledger.events(run_id, upto_seq=everything[4].seq)) == everything[:5]
    assert list(replay(ledger, run_id).committed) == [f"s{i}" for i in range(7)]


def test_runs_head_seq_and_commits_are_per_run(ledger, store):
    for run in ("run-b", "run-a"):
        Producer(ledger, store, run_id=run).emit(f"{run}-s", {"x": torch.ones(1)})
    assert ledger.runs() == ["run-a", "run-b"]
    assert ledger.head_seq("run-a") != ledger.head_seq("run-b")
    assert ledger.head_seq("no-such-run") == 0
    assert set(ledger.commits("run-a", ["run-a-s", "run-b-s"])) == {"run-a-s"}
    assert list(ledger.events("no-such-run")) == []


def test_event_payloads_round_trip(ledger, producer, make_consumer, run_id):
    metadata = {"text": "héllo ✓", "n": 3, "f": 0.25, "nested": {"list": [1, "two", None, True]}}
    ref = producer.emit(
        "a/b:c.d-e_f", {"x": torch.ones(2, dtype=torch.bfloat16)}, metadata=metadata
    )
    cons = make_consumer(release_policy="never", max_attempts=2)
    cons.resume()
    (leased,) = cons.lease(1)
    cons.nack([leased], reason="retry ✓")
    cons.ack(cons.lease(1), step=11)
    cons.checkpoint(12, "s3://bucket/ckpt 12")
    producer.close()

    claim, commit, resume, lease, nack, _lease, ack, checkpoint, close = ledger.events(run_id)
    assert (claim.kind, claim.actor, claim.epoch, claim.payload["store"]) == (
        Kind.CLAIM,
        "producer",
        1,
        producer.store.uri,
    )
    assert commit.epoch == close.epoch == producer.epoch == 1
    assert leased == ref
    assert ref.metadata == metadata
    assert (commit.kind, commit.sample_id, commit.revision, commit.actor) == (
        Kind.COMMIT,
        "a/b:c.d-e_f",
        0,
        "producer",
    )
    assert commit.payload == ref.to_dict()
    assert SampleRef.from_dict(commit.payload) == ref
    assert resume.epoch == 1
    assert resume.payload == {
        "checkpoint_seq": None,
        "checkpoint_step": None,
        "world_size": 1,
        "release_policy": "never",
        "max_attempts": 2,
    }
    # Leases, acks and nacks are batch rows (schema 4): the payload names the samples.
    assert (lease.kind, lease.sample_id, lease.sample_ids, lease.actor, lease.epoch) == (
        Kind.LEASE,
        None,
        [ref.sample_id],
        "trainer",
        1,
    )
    assert nack.payload == {"retryable": True, "reason": "retry ✓", "samples": [ref.sample_id]}
    assert (ack.kind, ack.step, ack.payload) == (Kind.ACK, 11, {"samples": ack.sample_ids})
    assert (checkpoint.step, checkpoint.payload) == (12, {"path": "s3://bucket/ckpt 12"})
    assert (close.kind, close.actor, close.sample_id) == (Kind.CLOSE, "producer", None)
    assert all(isinstance(e, Event) and e.run_id == run_id and e.ts > 0 for e in [commit, close])
    assert Event(**commit.to_dict()) == commit


# -- a stream that would refuse a ref: returned means committed, raised means not ----------

FAST = {"heartbeat_interval": 0.05, "heartbeat_timeout": 1.0}


def test_an_emit_the_stream_cannot_carry_raises_and_commits_nothing(ledger, store, run_id):
    """2 MiB of metadata is over a ZeroMQ frame: refused before the commit, so a retry is
    refused again instead of returning None (as if it had been committed)."""
    receiver = ZmqRefReceiver(ReceiverConfig(**FAST))
    sender = ZmqRefSender(
        SenderConfig(endpoints=(receiver.endpoint,), close_timeout=2.0, send_timeout=10.0, **FAST)
    )
    try:
        producer = Producer(ledger, store, run_id=run_id, stream=sender)
        claimed = ledger.head_seq(run_id)
        huge = {"text": "x" * (2 << 20)}
        for _attempt in range(2):
            with pytest.raises(BadFrameError, match="max_frame_bytes"):
                producer.emit("big", {"x": torch.ones(1)}, metadata=huge)
            assert ledger.head_seq(run_id) == claimed
            assert store.stats().objects == 0
        with pytest.raises(BadFrameError, match="max_frame_bytes"):
            producer.emit_many([("ok", {"x": torch.ones(1)}), ("big", {"x": torch.ones(1)}, huge)])
        assert ledger.head_seq(run_id) == claimed and store.stats().objects == 0
        ref = producer.emit("big", {"x": torch.ones(1)}, metadata={"text": "fits"})
        assert ref is not None and list(ledger.commits(run_id, ["big"])) == ["big"]
        assert receiver.receive(1, timeout=10) == [ref]
    finally:
        sender.close()
        receiver.close()


class PickySender(RefSender):
    """Refuses refs whose id starts with "bad" in ``send`` and, if ``checks``, in ``check``."""

    def __init__(self, *, checks: bool = True) -> None:
        self.checks = checks
        self.sent: list[str] = []

    def check(self, ref: SampleRef) -> None:
        if self.checks and ref.sample_id.startswith("bad"):
            raise BadFrameError(f"{ref.sample_id!r} is refused")

    def send(self, ref: SampleRef, *, timeout: float | None = None) -> None:
        if ref.sample_id.startswith("bad"):
            raise BadFrameError(f"{ref.sample_id!r} is refused")
        self.sent.append(ref.sample_id)

    def close(self) -> None:
        pass


def _released(ledger, store, run_id, sample_id: str) -> None:
    """Commit ``sample_id`` (no stream) and train it under "on_ack": its features are gone."""
    Producer(ledger, store, run_id=run_id).emit(sample_id, {"x": torch.ones(1)})
    cons = Consumer(ledger, store, run_id=run_id, consumer_id="c", release_policy="on_ack")
    cons.resume()
    cons.ack(cons.lease(1), step=1)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda p, s: p.emit("bad-1", {"x": torch.ones(1)}), id="emit"),
        pytest.param(
            lambda p, s: p.emit_many(
                [("ok", {"x": torch.ones(1)}), ("bad-1", {"x": torch.ones(1)})]
            ),
            id="emit_many",
        ),
        pytest.param(
            lambda p, s: p.commit([s.put("ok", {"x": torch.ones(1)}), s.put("bad-1", {})]),
            id="commit",
        ),
        pytest.param(
            lambda p, s: p.regenerate("bad-released", {"x": torch.ones(1)}), id="regenerate"
        ),
    ],
)
def test_every_write_checks_its_refs_with_the_stream_before_committing(ledger, store, run_id, call):
    _released(ledger, store, run_id, "bad-released")
    sender = PickySender()
    producer = Producer(ledger, store, run_id=run_id, stream=sender)
    head, objects = ledger.head_seq(run_id), store.stats().objects
    with pytest.raises(BadFrameError, match=r"'bad-(1|released)' is refused"):
        call(producer, store)
    assert ledger.head_seq(run_id) == head
    assert store.stats().objects == objects  # the features put for the write are gone again
    assert sender.sent == []


def test_a_committed_ref_the_stream_then_refuses_is_returned_and_stays_pending(
    ledger, store, run_id, caplog
):
    """A sender whose ``check`` misses a refusal: the emit still returns (it committed)."""
    producer = Producer(ledger, store, run_id=run_id, stream=PickySender(checks=False))
    with caplog.at_level(logging.WARNING, logger="dataflow"):
        ref = producer.emit("bad-1", {"x": torch.ones(1)})
    assert ref is not None and list(ledger.commits(run_id, ["bad-1"])) == ["bad-1"]
    assert "stream refused committed ref 'bad-1'" in caplog.text
    assert replay(ledger, run_id).pending == ["bad-1"]  # leased from the ledger instead


# -- a mistyped run id is not served in silence -------------------------------------------


def test_resuming_a_run_without_events_warns_and_names_the_known_runs(
    ledger, store, make_consumer, run_id
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The first run of a new ledger (a trainer started before its producers) is no typo.
        Consumer(ledger, store, run_id="first", consumer_id="c").resume()
    Producer(ledger, store, run_id=run_id).emit("a", {"x": torch.ones(1)})
    with pytest.warns(UserWarning, match=r"run 'rnu' has no events .* known runs: ") as got:
        Consumer(ledger, store, run_id="rnu", consumer_id="c").resume()
    assert got[0].filename == __file__  # it points at the resume() call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_consumer().resume()  # a run with events: no warning


def test_a_lease_waiting_on_a_run_no_producer_opened_warns(ledger, store, emit, monkeypatch):
    monkeypatch.setattr(_consumer, "NO_PRODUCER_WARNING_S", 0.2)
    emit("a")
    cons = Consumer(ledger, store, run_id="rnu", consumer_id="c")
    with pytest.warns(UserWarning, match="no events"):
        cons.resume()

    def produce_later() -> None:
        time.sleep(1.0)
        Producer(ledger, store, run_id="rnu").emit("late", {"x": torch.ones(1)})

    producer = threading.Thread(target=produce_later)
    producer.start()
    with pytest.warns(
        UserWarning, match=r"'rnu' .* no producer ever committed .* known runs: 'run'"
    ):
        refs = cons.lease(1, timeout=None)
    producer.join()
    assert [r.sample_id for r in refs] == ["late"]


# -- opening ---------------------------------------------------------------------------


def test_reopening_keeps_the_log(ledger_url, store, run_id):
    with Ledger.open(ledger_url) as first:
        Producer(first, store, run_id=run_id).emit("a", {"x": torch.ones(1)})
        before = list(first.events(run_id))
    with Ledger.open(ledger_url) as again:
        assert list(again.events(run_id)) == before
        assert again.backend in ("sqlite", "postgresql")


def test_opening_a_sqlite_ledger_creates_its_directory(tmp_path, store):
    with Ledger.open(f"sqlite:///{tmp_path}/a/b/ledger.db") as led:
        Producer(led, store, run_id="r").emit("s", {"x": torch.ones(1)})
    assert os.listdir(tmp_path / "a" / "b") == ["ledger.db"]  # no temporary file left


def test_without_hard_links_a_new_ledger_still_appears_whole(tmp_path, store, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as led:
        Producer(led, store, run_id="r").emit("s", {"x": torch.ones(1)})
    assert os.listdir(tmp_path) == ["ledger.db"]
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db", create=False) as led:
        assert list(led.commits("r", ["s"])) == ["s"]


def test_without_create_an_existing_ledger_opens_as_usual(ledger_url, store):
    with Ledger.open(ledger_url) as led:
        Producer(led, store, run_id="r").emit("s", {"x": torch.ones(1)})
    with Ledger.open(ledger_url, create=False) as led:
        assert led.runs() == ["r"]
        Producer(led, store, run_id="r").emit("t", {"x": torch.ones(1)})  # and it writes
        assert list(led.commits("r", ["s", "t"])) == ["s", "t"]


def test_a_newer_schema_version_is_refused(ledger_url):
    Ledger.open(ledger_url).close()
    engine = sqlalchemy.create_engine(ledger_url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("UPDATE dataflow_schema SET version = 99"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        Ledger.open(ledger_url)


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_durability_levels_are_accepted(ledger_url, store, run_id, durability):
    with Ledger.open(ledger_url, durability=durability) as led:
        assert led.durability == durability
        Producer(led, store, run_id=run_id).emit("a", {"x": torch.ones(1)})
        assert list(led.commits(run_id, ["a"])) == ["a"]


@pytest.mark.parametrize("durability", ["fast", "FULL", "", None, 1])
def test_unknown_durability_is_refused(ledger_url, durability):
    with pytest.raises(ValueError, match=f"got {durability!r}"):
        Ledger.open(ledger_url, durability=durability)


def test_an_id_repeated_in_one_commit_frees_the_older_put(ledger, run_id):
    class RecordingStore(LocalFeatureStore):
        def __init__(self) -> None:
            super().__init__()
            self.deleted: list[int] = []

        def _delete(self, ref: SampleRef) -> None:
            self.deleted.append(ref.generation)
            super()._delete(ref)

    with RecordingStore() as store:
        producer = Producer(ledger, store, run_id=run_id)
        older = store.put("a", {"x": torch.zeros(2)})
        newer = store.put("a", {"x": torch.ones(2)})
        assert producer.commit([older, newer]) == [None, newer]
        assert store.deleted == [older.generation]  # a store keeping generations frees it
        assert store.exists(newer)
        assert torch.equal(store.get(replay(ledger, run_id).committed["a"])["x"], torch.ones(2))
