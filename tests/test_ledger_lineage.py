"""Lineage and reconcile: resumes from checkpoints, fencing, ranks and data epochs."""

import itertools

import pytest
import torch
from _paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import (
    Consumer,
    Kind,
    Ledger,
    LedgerStateError,
    Producer,
    StaleEpochError,
    UnknownCheckpointError,
    replay,
)
from stores import LocalFeatureStore

IDS = ("a", "b", "c", "d", "e", "f")


def features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


def train(cons: Consumer, count: int, step: int) -> list[str]:
    """Lease ``count`` samples and ack them at ``step``; their ids."""
    refs = cons.lease(count)
    cons.ack(refs, step=step)
    return [r.sample_id for r in refs]


def ids(refs) -> list[str]:
    return [r.sample_id for r in refs]


@pytest.fixture
def history(emit, make_consumer, store):
    """Epoch 1 (release on checkpoint): a, b trained at step 1 and checkpointed; c, d at
    step 2 and checkpointed; e acked at step 3 without a checkpoint; f still leased."""
    emit(*IDS)
    first = make_consumer("first")
    first.resume()
    assert train(first, 2, 1) == ["a", "b"]
    first.checkpoint(1, ckpt("1"))
    assert train(first, 2, 2) == ["c", "d"]
    first.checkpoint(2, ckpt("2"))
    assert train(first, 1, 3) == ["e"]
    assert ids(first.lease(1)) == ["f"]
    assert store.stats().objects == 2  # a-d were released by their checkpoints
    return first


# -- resume ------------------------------------------------------------------------------


def test_resume_from_latest_keeps_what_the_checkpoint_trained(history, make_consumer, store):
    cons = make_consumer("second")
    plan = cons.resume()
    assert (plan.epoch, plan.checkpoint_step, plan.checkpoint.path) == (2, 2, ckpt("2"))
    assert plan.trained == {"a", "b", "c", "d"}
    assert cons.state.trained == {"a": 1, "b": 1, "c": 2, "d": 2}
    assert plan.requeued == ("e", "f")  # e's ack after the checkpoint is void
    assert plan.regenerate == ()
    assert plan.released == ()
    leased = cons.lease(10)
    assert ids(leased) == ["e", "f"]
    assert store.stats().objects == 2
    with pytest.raises(LedgerStateError, match="step 2"):
        cons.ack(leased, step=2)  # the lineage's checkpoint at step 2 is the floor
    with pytest.raises(LedgerStateError, match="step 2"):
        cons.checkpoint(2, ckpt("2-again"))


def test_resume_from_an_older_checkpoint_voids_later_acks_and_regenerates(
    history, make_consumer, producer, store, ledger, run_id
):
    cons = make_consumer("second")
    plan = cons.resume(checkpoint=1)
    assert (plan.checkpoint_step, plan.checkpoint.path) == (1, ckpt("1"))
    assert cons.state.trained == {"a": 1, "b": 1}
    assert plan.requeued == ("e", "f")
    assert plan.regenerate == ("c", "d")  # to train again, but released by checkpoint 2
    assert cons.state.regenerate == {"c": None, "d": None}

    regenerated = [producer.regenerate(sid, features(sid)) for sid in plan.regenerate]
    assert [ref.generation > 0 and store.exists(ref) for ref in regenerated] == [True, True]
    assert replay(ledger, run_id).regenerate == {}
    leased = cons.lease(10)
    assert ids(leased) == ["e", "f", "c", "d"]
    assert leased[2:] == regenerated
    assert [cons.load(ref)["x"].numpy().tobytes().decode() for ref in leased] == list("efcd")
    cons.ack(leased, step=2)  # step 2 again: this lineage's last checkpoint is step 1
    cons.checkpoint(2, ckpt("2-again"))
    assert cons.state.trained == dict.fromkeys("ab", 1) | dict.fromkeys("efcd", 2)
    assert replay(ledger, run_id).verify() == []


def test_resume_from_scratch_trains_everything_again(history, make_consumer):
    plan = make_consumer("second").resume(checkpoint=None)
    assert (plan.checkpoint, plan.checkpoint_step, plan.trained) == (None, None, frozenset())
    assert plan.requeued == ("e", "f")
    assert plan.regenerate == ("a", "b", "c", "d")


def test_resume_is_deterministic_and_idempotent(history, make_consumer, ledger, run_id):
    plans = [make_consumer(f"again-{i}").resume(checkpoint=1) for i in range(2)]
    first, second = plans
    assert (first.requeued, first.trained, first.regenerate, first.released) == (
        second.requeued,
        second.trained,
        second.regenerate,
        second.released,
    )
    assert second.epoch == first.epoch + 1
    replays = [replay(ledger, run_id) for _ in range(2)]
    assert replays[0].plans == replays[1].plans
    assert replays[0].plans[first.epoch].for_rank(0) == first
    assert replays[0].plans[second.epoch].for_rank(0) == second
    assert replays[0].snapshot() == replays[1].snapshot()


def test_latest_means_the_newest_checkpoint_of_the_current_lineage(history, make_consumer):
    older = make_consumer("second")
    older.resume(checkpoint=1)  # epoch 2 branches off at step 1: step 2 is abandoned
    plan = make_consumer("third").resume()
    assert plan.checkpoint_step == 1
    assert plan.trained == {"a", "b"}


def test_resume_from_a_checkpoint_in_an_abandoned_branch(
    history, make_consumer, producer, ledger, run_id
):
    branch = make_consumer("second")
    plan = branch.resume(checkpoint=1)
    for sid in plan.regenerate:
        producer.regenerate(sid, features(sid))
    assert train(branch, 2, 2) == ["e", "f"]
    branch.checkpoint(2, ckpt("2-branch"))  # step 2 exists in both branches now
    assert train(branch, 1, 3) == ["c"]
    branch.checkpoint(3, ckpt("3-branch"))

    # A step names the checkpoint of the current lineage first.
    plan = make_consumer("third").resume(checkpoint=2)
    assert (plan.checkpoint.path, plan.trained) == (ckpt("2-branch"), {"a", "b", "e", "f"})

    # The abandoned step 2 of epoch 1 is reachable through its Checkpoint.
    abandoned = next(c for c in replay(ledger, run_id).checkpoints if c.path == ckpt("2"))
    cons = make_consumer("fourth")
    plan = cons.resume(checkpoint=abandoned)
    assert (plan.checkpoint, plan.trained) == (abandoned, {"a", "b", "c", "d"})
    assert cons.state.trained == {"a": 1, "b": 1, "c": 2, "d": 2}
    assert plan.requeued == ()
    assert plan.regenerate == ("e", "f")  # released by the branch's checkpoint at step 2
    assert replay(ledger, run_id).verify() == []


def test_an_unknown_checkpoint_is_refused(history, make_consumer, ledger, run_id):
    head = ledger.head_seq(run_id)
    with pytest.raises(UnknownCheckpointError, match=r"step 7.*\[1, 2\]"):
        make_consumer("second").resume(checkpoint=7)
    elsewhere = Consumer(ledger, history.store, run_id="other-run", consumer_id="x")
    with (
        pytest.warns(UserWarning, match=r"'other-run' has no events .* known runs: 'run'"),
        pytest.raises(UnknownCheckpointError, match="ckpt/1"),
    ):
        elsewhere.resume(checkpoint=history.state.checkpoints[0])
    assert ledger.head_seq(run_id) == head
    assert ledger.head_seq("other-run") == 0


# -- fencing ------------------------------------------------------------------------------


def test_a_zombie_consumer_is_fenced_and_changes_nothing(history, make_consumer, ledger, run_id):
    replacement = make_consumer("second")
    replacement.resume()
    head = ledger.head_seq(run_id)
    before = replay(ledger, run_id).snapshot()

    attempts = {
        "refresh": history.refresh,
        "lease": lambda: history.lease(1),
        "ack": lambda: history.ack(["f"], step=9),
        "nack": lambda: history.nack(["f"]),
        "checkpoint": lambda: history.checkpoint(9, ckpt("9")),
        "data epoch": lambda: history.start_data_epoch(seed=1),
    }
    for name, attempt in attempts.items():
        with pytest.raises(StaleEpochError, match="epoch 1"):
            attempt()
        assert ledger.head_seq(run_id) == head, name
    assert replay(ledger, run_id).snapshot() == before

    assert ids(replacement.lease(10)) == ["e", "f"]
    with pytest.raises(StaleEpochError):  # also when nothing is left to lease
        history.lease(1)
    # the replacement's lease: one batch row (seqs are not contiguous on PostgreSQL)
    assert len(list(ledger.events(run_id, after_seq=head))) == 1


def test_a_restarted_zombie_fences_its_replacement(history, make_consumer):
    replacement = make_consumer("second")
    replacement.resume()
    assert history.resume().epoch == 3
    with pytest.raises(StaleEpochError, match="epoch 2"):
        replacement.lease(1)


# -- ranks -------------------------------------------------------------------------------------


def test_ranks_split_requeued_work_and_new_commits(emit, make_consumer, ledger, run_id):
    first = [f"s{i}" for i in range(7)]
    emit(*first)
    ranks = [make_consumer(f"rank{r}", rank=r, world_size=2) for r in range(2)]
    plans = [cons.resume() for cons in ranks]
    assert [p.rank for p in plans] == [0, 1]
    assert plans[0].requeued == tuple(first[0::2])
    assert plans[1].requeued == tuple(first[1::2])
    assert [ids(cons.lease(100)) for cons in ranks] == [first[0::2], first[1::2]]

    later = [f"t{i}" for i in range(4)]
    emit(*later)
    got = [ids(cons.lease(100)) for cons in ranks]
    assert sorted(got[0] + got[1]) == later
    owner = {sid: r for r in range(2) for sid in got[r]}
    assert [owner[sid] for sid in later] == [1, 0, 1, 0]  # round-robin, after s6 went to 0

    for cons in ranks:
        cons.ack(
            [s for s, holder in cons.state.leased.items() if holder == cons.consumer_id], step=1
        )
    head = ledger.head_seq(run_id)
    assert ranks[1].checkpoint(2, ckpt("2")) is None  # rank 0 records checkpoints
    assert ledger.head_seq(run_id) == head
    assert ranks[0].checkpoint(2, ckpt("2")).step == 2
    assert replay(ledger, run_id).verify() == []


def test_rank_plans_are_deterministic_across_resumes(emit, make_consumer):
    emit(*(f"s{i}" for i in range(9)))
    shares = []
    for attempt in range(2):
        ranks = [make_consumer(f"rank{r}-{attempt}", rank=r, world_size=3) for r in range(3)]
        shares.append([cons.resume(checkpoint=None).requeued for cons in ranks])
    assert shares[0] == shares[1]
    assert sorted(itertools.chain(*shares[0])) == sorted(f"s{i}" for i in range(9))


def test_a_rank_joins_the_epoch_of_rank_zero(emit, make_consumer, ledger, run_id):
    emit("a", "b")
    rank1 = make_consumer("rank1", rank=1, world_size=2)
    with pytest.raises(LedgerStateError, match="rank 0 has not resumed"):
        rank1.resume()
    make_consumer("rank0", rank=0, world_size=2).resume()
    head = ledger.head_seq(run_id)
    assert rank1.resume().epoch == 1
    assert rank1.resume().epoch == 1
    assert ledger.head_seq(run_id) == head  # joining appends nothing
    with pytest.raises(LedgerStateError, match="world_size 2"):
        make_consumer("odd", rank=1, world_size=3).resume()


# -- data epochs --------------------------------------------------------------------------------


def data_epoch_order(ledger, store, run: str, seed: int, count: int = 12) -> list[str]:
    Producer(ledger, store, run_id=run).emit_many(
        (f"s{i:02d}", features(f"s{i:02d}")) for i in range(count)
    )
    cons = Consumer(ledger, store, run_id=run, consumer_id="trainer", release_policy="never")
    cons.resume()
    train(cons, count, 1)
    assert cons.start_data_epoch(seed=seed) == 1
    order = cons.state.pending
    assert ids(cons.lease(count)) == order
    return order


def test_a_data_epoch_order_is_seeded_and_reproducible(ledger, store):
    commit_order = [f"s{i:02d}" for i in range(12)]
    first = data_epoch_order(ledger, store, "run-a", seed=7)
    assert sorted(first) == commit_order
    assert first != commit_order
    assert data_epoch_order(ledger, store, "run-b", seed=7) == first
    assert data_epoch_order(ledger, store, "run-c", seed=8) != first


def acks_per_data_epoch(ledger, run_id) -> list[dict[str, int]]:
    counts: list[dict[str, int]] = [{}]
    for event in ledger.events(run_id):
        if event.kind == Kind.DATA_EPOCH:
            counts.append({})
        elif event.kind == Kind.ACK:
            for sid in event.sample_ids:
                counts[-1][sid] = counts[-1].get(sid, 0) + 1
    return counts


def test_every_live_sample_is_trained_once_per_data_epoch(emit, make_consumer, ledger, run_id):
    emit(*IDS)
    cons = make_consumer(release_policy="never")
    cons.resume()
    cons.lease(1)
    cons.nack(["a"], retryable=False, reason="broken")
    live = set(IDS) - {"a"}
    assert set(train(cons, 10, 1)) == live
    assert cons.lease(10) == []
    cons.checkpoint(1, ckpt("1"))
    assert cons.start_data_epoch(seed=3) == 1
    assert cons.state.trained == {}
    assert set(cons.state.pending) == live
    assert set(train(cons, 10, 2)) == live
    assert cons.lease(10) == []

    assert acks_per_data_epoch(ledger, run_id) == [dict.fromkeys(live, 1)] * 2
    assert replay(ledger, run_id).verify() == []


def test_resume_inside_a_data_epoch_keeps_its_order_and_trained_set(emit, make_consumer):
    emit(*(f"s{i}" for i in range(8)))
    cons = make_consumer(release_policy="never")
    cons.resume()
    train(cons, 8, 1)
    cons.checkpoint(1, ckpt("1"))
    cons.start_data_epoch(seed=11)
    order = cons.state.pending
    done = train(cons, 3, 2)
    cons.checkpoint(2, ckpt("2"))
    train(cons, 2, 3)  # void after resuming from step 2

    plan = make_consumer("second", release_policy="never").resume(checkpoint=2)
    assert plan.data_epoch == 1
    assert plan.trained == set(done)
    assert list(plan.requeued) == [s for s in order if s not in done]

    plan = make_consumer("third", release_policy="never").resume(checkpoint=1)
    assert (plan.data_epoch, plan.trained) == (0, {f"s{i}" for i in range(8)})
    assert plan.requeued == ()


def test_a_data_epoch_lists_released_samples_for_regeneration(emit, make_consumer):
    emit("a", "b", "c")
    cons = make_consumer()  # on_checkpoint
    cons.resume()
    train(cons, 2, 1)
    cons.checkpoint(1, ckpt("1"))
    cons.lease(1)
    with pytest.raises(LedgerStateError, match="still leased"):
        cons.start_data_epoch()
    cons.ack(["c"], step=2)
    cons.start_data_epoch()
    assert cons.state.pending == ["c"]
    assert list(cons.state.regenerate) == ["a", "b"]


# -- properties ------------------------------------------------------------------------------------

_runs = itertools.count()
# Weighted towards progress, so that resumes restore non-trivial trained sets.
OPERATIONS = (
    ["train"] * 4 + ["checkpoint", "resume"] * 2 + ["lease", "nack", "regenerate", "data_epoch"]
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_resume_restores_exactly_what_the_checkpoint_lineage_trained(sqlite_url, data):
    """Random leases, acks, nacks, checkpoints, data epochs and resumes against a model.

    Model: the trained set of the current lineage (id -> step); a checkpoint
    records it, and a resume from that checkpoint restores it exactly.
    """
    run = f"prop-{next(_runs)}"
    sample_ids = [f"s{i}" for i in range(data.draw(st.integers(1, 7), label="samples"))]
    policy = data.draw(st.sampled_from(["on_checkpoint", "on_ack", "never"]), label="policy")
    with Ledger.open(sqlite_url, durability="normal") as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id=run)
        producer.emit_many((sid, features(sid)) for sid in sample_ids)
        consumers = (f"c{i}" for i in itertools.count())

        def new_consumer() -> Consumer:
            return Consumer(
                ledger, store, run_id=run, consumer_id=next(consumers), release_policy=policy
            )

        cons = new_consumer()
        cons.resume(checkpoint=None)
        trained: dict[str, int] = {}  # the model
        at_checkpoint: dict[int, tuple[dict[str, int], list[int]]] = {}  # seq -> trained, lineage
        lineage: list[int] = []  # checkpoint seqs of the current lineage
        step = 0
        for _ in range(data.draw(st.integers(1, 30), label="operations")):
            op = data.draw(st.sampled_from(OPERATIONS))
            if op in ("lease", "train"):
                cons.lease(data.draw(st.integers(1, 3)))
            mine = sorted(s for s, who in cons.state.leased.items() if who == cons.consumer_id)
            if op in ("train", "nack") and mine:
                chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
                if op == "train":
                    step += 1
                    cons.ack(chosen, step=step)
                    trained.update(dict.fromkeys(chosen, step))
                else:
                    cons.nack(chosen, retryable=data.draw(st.booleans()))
            elif op == "checkpoint":
                step += 1
                checkpoint = cons.checkpoint(step, ckpt(step))
                lineage.append(checkpoint.seq)
                at_checkpoint[checkpoint.seq] = (dict(trained), list(lineage))
            elif op == "data_epoch" and not cons.state.leased:
                cons.start_data_epoch(seed=data.draw(st.integers(0, 2**31)))
                trained = {}
            elif op == "regenerate" and (gone := sorted(replay(ledger, run).regenerate)):
                sid = data.draw(st.sampled_from(gone))
                producer.regenerate(sid, features(sid))
            elif op == "resume":
                checkpoints = cons.state.checkpoints
                which = data.draw(
                    st.sampled_from([None, "latest", *checkpoints, *(c.step for c in checkpoints)])
                )
                seq = {None: None, "latest": lineage[-1] if lineage else None}.get(
                    which, next((c.seq for c in checkpoints if which in (c, c.step)), None)
                )
                trained, lineage = at_checkpoint[seq] if seq else ({}, [])
                trained, lineage = dict(trained), list(lineage)
                cons = new_consumer()
                plan = cons.resume(checkpoint=which)

                assert cons.state.trained == trained
                assert plan.trained == set(trained)
                todo = set(sample_ids) - set(trained) - set(cons.state.dead)
                assert set(plan.requeued) | set(plan.regenerate) == todo
                assert not set(plan.requeued) & set(plan.regenerate)
                assert set(plan.regenerate) <= cons.state.released
                if plan.data_epoch == 0:
                    assert list(plan.requeued) == [s for s in sample_ids if s in plan.requeued]

        assert replay(ledger, run, upto_seq=cons.state.head_seq).snapshot() == (
            cons.state.snapshot()
        )
        first, second = replay(ledger, run), replay(ledger, run)
        assert first.verify() == []
        assert first.plans == second.plans
        assert first.snapshot() == second.snapshot()
