"""A rule-based state machine that attacks a ledger + store set-up with crashes.

Producers and consumers are driven through the public API; at random points
every in-memory object is dropped (a crash) and the run resumes from a random
checkpoint. An independent model of the lineage, kept by this machine and
not by dataflow, is checked against the ledger after every step:

* replay of the log equals every live consumer's state;
* nothing committed and not dead is lost (and its features are in the store
  unless the ledger lists it for regeneration);
* a leased sample's features read back from the store equal, value for value
  and in dtype and shape, what was emitted (or regenerated) for that ref;
* no sample is trained twice in a data epoch of the lineage, and the trained
  set after a resume is exactly the checkpoint's;
* features are released only when the release policy allows;
* writes from a fenced-off (stale) epoch are rejected and change nothing;
* an excluded sample is never leased again, whatever checkpoint a resume starts from;
* reconcile is deterministic and idempotent.
"""

from __future__ import annotations

import tempfile
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dataflow.interfaces._store import FeatureStore
from dataflow.live._consumer import Consumer
from dataflow.live._exclusions import write_exclusions
from dataflow.live._producer import Producer
from dataflow.live._replay import replay
from dataflow.model import _snapshot
from dataflow.model._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    LedgerStateError,
    ProducerFencedError,
    StaleEpochError,
    UnknownCheckpointError,
)
from dataflow.model._fold import Checkpoint, RunState
from dataflow.model._refs import FeatureSpec, SampleRef
from dataflow.recorder._ledger import Ledger

#: Examples per run of the machine: "normal" is the test suite's, "thorough" the long profile.
PROFILES = {"normal": 200, "thorough": 2000}
_ID_POOL = 10


def _features(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"hidden": torch.randn(3, generator=generator), "ids": torch.arange(seed % 5)}


class LedgerMachine(RuleBasedStateMachine):
    """Subclass with ``ledger`` and ``make_store`` set, or use :func:`run_ledger_machine`.

    Every example uses a fresh run id, so one ledger serves all examples.
    """

    ledger: Ledger
    make_store: Callable[[], FeatureStore]
    #: Compare the fold from snapshots with the full fold after every step.
    check_snapshots: bool = True

    def __init__(self) -> None:
        super().__init__()
        self.run_id = f"prop-{uuid.uuid4().hex[:16]}"
        self.checkpoint_dir = tempfile.TemporaryDirectory(prefix="dataflow-machine-")
        self.store = type(self).make_store()
        if not isinstance(self.store, FeatureStore):
            raise ArgumentTypeError(
                f"make_store() returned {self.store!r} ({type(self.store).__name__}), not a "
                "dataflow FeatureStore: make it return a new store (a FeatureStore subclass)"
            )
        self.producer = self._start_producer()
        #: Producers of "p0" a later start fenced (presumed dead, but alive).
        self.fenced_producers: list[Producer] = []
        self.producer_closed = False  # the model: whether p0's current holder closed
        self.consumers: list[Consumer] = []
        self.zombies: list[Consumer] = []
        self.generation = 0
        self.emitted: dict[str, SampleRef] = {}
        # (sample_id, generation) of every committed emit or regeneration -> the seed of
        # its features: what a read of that ref must return (rebuilt by _features).
        self.payload_seeds: dict[tuple[str, int], int] = {}
        self.leased: dict[int, list[SampleRef]] = {}
        self.trained: dict[str, int] = {}  # the model's lineage: id -> step
        self.data_epoch = 0
        self.dead: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.snapshots: dict[int, tuple[int, dict[str, int]]] = {}  # checkpoint seq -> state
        self.removed: set[int] = set()  # seqs of checkpoints whose files were removed
        self.ever_checkpointed: set[str] = set()
        self.ever_acked: set[str] = set()
        self.step = 0
        self.writes_since_resume = 0
        self.last_resume: tuple[Checkpoint | None, Any] | None = None
        self.excluded: set[str] = set()  # never leased again, whatever the lineage

    # -- set-up ----------------------------------------------------------------
    @initialize(
        policy=st.sampled_from(["on_checkpoint", "on_ack", "never"]),
        world_size=st.sampled_from([1, 1, 2]),
        max_attempts=st.integers(1, 3),
    )
    def configure(self, policy: str, world_size: int, max_attempts: int) -> None:
        self.policy = policy
        self.world_size = world_size
        self.max_attempts = max_attempts
        self.consumers = self._new_consumers()
        self._resume("latest")

    def _new_consumers(self) -> list[Consumer]:
        self.generation += 1
        consumers = [
            Consumer(
                self.ledger,
                self.store,
                run_id=self.run_id,
                consumer_id=f"g{self.generation}-rank{rank}",
                rank=rank,
                world_size=self.world_size,
                release_policy=self.policy,
                max_attempts=self.max_attempts,
            )
            for rank in range(self.world_size)
        ]
        for consumer in consumers:
            consumer.snapshot_every = 1  # a snapshot at every checkpoint: restarts start from one
        return consumers

    # -- producers ---------------------------------------------------------------
    def _start_producer(self) -> Producer:
        """A new process of producer "p0": it claims the id, fencing the one before."""
        self.producer_closed = False
        return Producer(self.ledger, self.store, run_id=self.run_id, producer_id="p0")

    def _open_producer(self) -> Producer:
        """The holder of "p0", started again if it closed (a closed producer commits nothing)."""
        if self.producer_closed:
            self.fenced_producers.append(self.producer)
            self.producer = self._start_producer()
        return self.producer

    @rule(
        indices=st.lists(st.integers(0, _ID_POOL - 1), min_size=1, max_size=4),
        seed=st.integers(0, 1000),
    )
    def emit(self, indices: list[int], seed: int) -> None:
        sample_ids = [f"s{index:02d}/x" for index in indices]
        producer = self._open_producer()
        if len(sample_ids) == 1:
            refs = [producer.emit(sample_ids[0], _features(seed))]
        else:
            refs = producer.emit_many((sid, _features(seed)) for sid in sample_ids)
        # An id given twice in one call is committed as its last item, as commit does.
        last = {sample_id: i for i, sample_id in enumerate(sample_ids)}
        for i, (sample_id, ref) in enumerate(zip(sample_ids, refs, strict=True)):
            if sample_id in self.emitted:
                assert ref is None, f"duplicate emit of {sample_id!r} was committed again"
            elif last[sample_id] != i:
                assert ref is None, f"an earlier item of {sample_id!r} in one call got its ref"
            else:
                assert ref is not None, f"first emit of {sample_id!r} was not committed"
                self.emitted[sample_id] = ref
                self.payload_seeds[(sample_id, ref.generation)] = seed
                self.writes_since_resume += 1

    @rule(index=st.integers(0, _ID_POOL - 1), seed=st.integers(0, 1000))
    def crash_producer_mid_emit(self, index: int, seed: int) -> None:
        """Features put, the producer dies before committing: nothing is lost, nothing leaks."""
        sample_id = f"s{index:02d}/x"
        if sample_id not in self.emitted:
            self.store.put(sample_id, _features(seed))
        self.fenced_producers.append(self.producer)
        self.producer = self._start_producer()

    @rule()
    def close_producer(self) -> None:
        if not self.producer_closed:
            self.producer.close()
            self.producer_closed = True
            self.writes_since_resume += 1

    @rule(index=st.integers(0, _ID_POOL - 1), seed=st.integers(0, 1000), close=st.booleans())
    def fenced_producer_writes(self, index: int, seed: int, close: bool) -> None:
        """A producer presumed dead writes after its restart claimed the id: refused."""
        if not self.fenced_producers:
            return
        zombie = self.fenced_producers[-1]
        head, objects = self.ledger.head_seq(self.run_id), self.store.stats().objects
        try:
            if close:
                zombie.close()
            else:
                # None, writing nothing: an id the ledger holds is answered from it.
                assert zombie.emit(f"s{index:02d}/x", _features(seed)) is None
        except ProducerFencedError:
            pass
        except LedgerStateError:  # it had closed before it was fenced: commits nothing
            assert zombie._closed and not close
        else:
            assert not close or zombie._closed, "a fenced producer's close was accepted"
        assert self.ledger.head_seq(self.run_id) == head, "a fenced producer changed the ledger"
        if not close:
            assert self.store.stats().objects <= objects, "a fenced emit left its features"

    @rule(seed=st.integers(0, 1000))
    def regenerate(self, seed: int) -> None:
        missing = list(replay(self.ledger, self.run_id).regenerate)
        if missing:
            ref = self._open_producer().regenerate(missing[0], _features(seed))
            self.emitted[missing[0]] = ref
            self.payload_seeds[(missing[0], ref.generation)] = seed
            self.writes_since_resume += 1

    # -- consumers -----------------------------------------------------------------
    @rule(target_kind=st.sampled_from(["latest", "scratch", "any"]), pick=st.integers(0, 10**6))
    def crash_consumers_and_resume(self, target_kind: str, pick: int) -> None:
        """Drop every consumer object (leases in flight included) and resume."""
        self.zombies = self.consumers or self.zombies
        self.consumers = self._new_consumers()
        checkpoints = replay(self.ledger, self.run_id).checkpoints
        target: Any = {"latest": "latest", "scratch": None}.get(target_kind)
        if target_kind == "any":
            target = checkpoints[pick % len(checkpoints)] if checkpoints else None
        if isinstance(target, Checkpoint) and target.seq in self.removed:
            head = self.ledger.head_seq(self.run_id)
            try:
                self.consumers[0].resume(target)
            except UnknownCheckpointError:
                pass
            else:
                raise AssertionError("resumed from a checkpoint recorded as removed")
            assert self.ledger.head_seq(self.run_id) == head, "a refused resume wrote"
            target = "latest"
        self._resume(target)

    def _resume(self, target: Any) -> None:
        with warnings.catch_warnings():
            # Each example is a new run in a shared ledger: no mistyped run id.
            warnings.filterwarnings("ignore", message=r"run .* has no events")
            plans = [self.consumers[0].resume(target)]
        plans += [c.resume() for c in self.consumers[1:]]
        plan = plans[0]
        resolved = plan.checkpoint
        assert resolved is None or resolved.seq not in self.removed, "resumed a removed one"
        data_epoch, trained = self.snapshots[resolved.seq] if resolved else (0, {})
        if data_epoch != self.data_epoch:
            self.attempts = {}
        self.data_epoch, self.trained = data_epoch, dict(trained)
        self.leased = {rank: [] for rank in range(self.world_size)}
        assert plan.trained == frozenset(self.trained), (
            f"resume trained set {sorted(plan.trained)} != the checkpoint's {sorted(self.trained)}"
        )
        requeued = [sid for p in plans for sid in p.requeued]
        assert len(requeued) == len(set(requeued)), "a sample was requeued to two ranks"
        expected = set(self.emitted) - self.dead - set(self.trained) - self.excluded
        assert set(requeued) | set(plan.regenerate) == expected, "reconcile lost or invented work"
        self.last_resume = (resolved, target)
        self.writes_since_resume = 0

    @precondition(
        lambda self: (
            bool(self.consumers) and self.writes_since_resume == 0 and self.last_resume is not None
        )
    )
    @rule()
    def resume_again_is_idempotent(self) -> None:
        before = self.consumers[0].state.plans[self.consumers[0].epoch]
        resolved, _target = self.last_resume  # type: ignore[misc]
        self.zombies = self.consumers
        self.consumers = self._new_consumers()
        self._resume(resolved)
        after = self.consumers[0].state.plans[self.consumers[0].epoch]
        assert (after.requeued, after.trained, after.regenerate) == (
            before.requeued,
            before.trained,
            before.regenerate,
        ), "resuming twice from one checkpoint gave different plans"

    @precondition(lambda self: bool(self.consumers))
    @rule(rank=st.integers(0, 1), count=st.integers(1, 4))
    def lease(self, rank: int, count: int) -> None:
        rank %= self.world_size
        refs = self.consumers[rank].lease(count)
        for ref in refs:
            assert ref.sample_id not in {r.sample_id for rs in self.leased.values() for r in rs}
            assert ref.sample_id not in self.excluded, f"excluded {ref.sample_id!r} was leased"
            features = self.store.get(ref)  # a leased sample's features must be there
            self._check_features(ref, features)
        self.leased[rank].extend(refs)
        self.writes_since_resume += len(refs)

    def _check_features(self, ref: SampleRef, features: Mapping[str, torch.Tensor]) -> None:
        """What the store returned for ``ref`` is exactly what was emitted for it."""
        key = (ref.sample_id, ref.generation)
        assert key in self.payload_seeds, (
            f"leased {ref.sample_id!r} at generation {ref.generation}, which was never "
            f"committed (committed generations: "
            f"{sorted(g for sid, g in self.payload_seeds if sid == ref.sample_id)})"
        )
        expected = _features(self.payload_seeds[key])
        want_specs = {name: FeatureSpec.of(tensor) for name, tensor in expected.items()}
        assert dict(ref.specs) == want_specs, (
            f"ref of {ref.sample_id!r} has specs {dict(ref.specs)}, but {want_specs} were emitted"
        )
        assert set(features) == set(expected), (
            f"store returned features {sorted(features)} for {ref.sample_id!r}, "
            f"but {sorted(expected)} were emitted"
        )
        for name, want in expected.items():
            got = features[name]
            assert isinstance(got, torch.Tensor), (
                f"store returned a {type(got).__name__} for feature {name!r} of "
                f"{ref.sample_id!r}, not a tensor"
            )
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
                f"store returned {name!r} of {ref.sample_id!r} (generation {ref.generation}) "
                f"as {got.dtype} {tuple(got.shape)}, but {want.dtype} {tuple(want.shape)} "
                "was emitted"
            )
            assert torch.equal(got.cpu(), want), (
                f"store returned {name!r} of {ref.sample_id!r} (generation {ref.generation}) "
                f"with values {got.tolist()}, but {want.tolist()} was emitted"
            )

    @precondition(lambda self: bool(self.consumers))
    @rule(rank=st.integers(0, 1), count=st.integers(1, 4))
    def train(self, rank: int, count: int) -> None:
        """Lease and ack in one optimizer step, as a trainer loop does."""
        self.lease(rank, count)
        self.ack(rank, count)

    @precondition(lambda self: any(self.leased.values()))
    @rule(rank=st.integers(0, 1), count=st.integers(1, 4))
    def ack(self, rank: int, count: int) -> None:
        rank %= self.world_size
        refs, self.leased[rank] = self.leased[rank][:count], self.leased[rank][count:]
        if not refs:
            return
        self.step += 1
        self.consumers[rank].ack(refs, step=self.step)
        for ref in refs:
            assert ref.sample_id not in self.trained, f"{ref.sample_id!r} trained twice"
            self.trained[ref.sample_id] = self.step
            self.ever_acked.add(ref.sample_id)
        self.writes_since_resume += 1

    @precondition(lambda self: any(self.leased.values()))
    @rule(rank=st.integers(0, 1), retryable=st.booleans())
    def nack(self, rank: int, retryable: bool) -> None:
        rank %= self.world_size
        if not self.leased[rank]:
            return
        ref = self.leased[rank].pop(0)
        self.consumers[rank].nack([ref], retryable=retryable, reason="test")
        attempts = self.attempts.get(ref.sample_id, 0) + 1
        self.attempts[ref.sample_id] = attempts
        if not retryable or attempts >= self.max_attempts:
            self.dead.add(ref.sample_id)
        self.writes_since_resume += 1

    @precondition(lambda self: any(self.leased.values()))
    @rule(rank=st.integers(0, 1))
    def lose_features(self, rank: int) -> None:
        """The payload of a leased sample vanished: lost, never failed, to regenerate."""
        rank %= self.world_size
        if not self.leased[rank]:
            return
        ref = self.leased[rank].pop(0)
        self.store.delete(ref)
        self.consumers[rank].lost([ref], reason="features gone")
        self.writes_since_resume += 1

    @precondition(lambda self: bool(self.emitted))
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=3), how=st.integers(0, 2))
    def exclude(self, picks: list[int], how: int) -> None:  # by rank 0, the CLI's way, include
        include = how == 2 and bool(self.excluded)
        pool = sorted(self.excluded if include else self.emitted)
        chosen = sorted({pool[p % len(pool)] for p in picks})
        if how == 0 and self.consumers:
            self.consumers[0].exclude(chosen, reason="machine")
        else:
            write_exclusions(self.ledger, self.run_id, chosen, reason="machine", include=include)
        self.excluded = self.excluded - set(chosen) if include else self.excluded | set(chosen)
        self.writes_since_resume += 1

    @precondition(lambda self: bool(self.consumers))
    @rule()
    def checkpoint(self) -> None:
        self.step += 1
        path = Path(self.checkpoint_dir.name, f"step{self.step}")
        path.mkdir()  # a checkpoint's files exist before the ledger records it
        ckpt = self.consumers[0].record_checkpoint(self.step, str(path))
        assert ckpt is not None and ckpt.step == self.step
        self.snapshots[ckpt.seq] = (self.data_epoch, dict(self.trained))
        self.ever_checkpointed.update(self.trained)
        self.writes_since_resume += 1

    @precondition(lambda self: bool(self.consumers))
    @rule(pick=st.integers(0, 10**6))
    def remove_a_checkpoint(self, pick: int) -> None:
        """Retention deleted a checkpoint's files: record it; it is never resumed again."""
        recorded = replay(self.ledger, self.run_id).checkpoints
        live = [c for c in recorded if c.seq not in self.removed]
        if not live:
            return
        target = live[pick % len(live)]
        self.consumers[0].remove_checkpoints([target], reason="retention")
        self.removed.add(target.seq)
        self.writes_since_resume += 1

    @precondition(lambda self: bool(self.consumers) and not any(self.leased.values()))
    @rule(seed=st.integers(0, 100))
    def start_data_epoch(self, seed: int) -> None:
        self.data_epoch = self.consumers[0].start_data_epoch(seed=seed)
        self.trained = {}
        self.attempts = {}
        self.writes_since_resume += 1

    @precondition(lambda self: bool(self.zombies))
    @rule(kind=st.sampled_from(["lease", "ack", "nack", "checkpoint"]))
    def zombie_write_is_fenced(self, kind: str) -> None:
        zombie = self.zombies[0]
        head = self.ledger.head_seq(self.run_id)
        some_id = next(iter(self.emitted), "s00/x")
        try:
            if kind == "lease":
                zombie.lease(1)
            elif kind == "ack":
                zombie.ack([some_id], step=self.step + 1)
            elif kind == "nack":
                zombie.nack([some_id])
            else:
                zombie.record_checkpoint(self.step + 1, "zombie")
        except StaleEpochError:
            pass
        else:
            raise AssertionError(f"a {kind} from a fenced-off epoch was accepted")
        assert self.ledger.head_seq(self.run_id) == head, "a fenced write changed the ledger"

    # -- the invariants -------------------------------------------------------------
    @invariant()
    def ledger_agrees_with_the_model(self) -> None:
        state = replay(self.ledger, self.run_id)
        assert state.verify() == [], state.verify()
        if self.check_snapshots:
            full = replay(self.ledger, self.run_id, snapshots=False)
            assert _snapshot._dump(state) == _snapshot._dump(full), "snapshot + tail != full"
            assert full.plans == state.plans, "reconcile not deterministic"
            folded = _fold_every_lineage(self.ledger, self.run_id)
            assert _snapshot._dump(folded) == _snapshot._dump(full), "a resume's shortcut differs"
            assert folded.plans == full.plans, "a resume's shortcut plans differently"
        for rank in range(state.world_size):
            assert state.pending_count(rank) == len(list(state.pending_for(rank)))
        for consumer in self.consumers:
            consumer._catch_up()
            assert consumer.state.observable() == state.observable(), "live state != replay"
        assert set(state.committed) == set(self.emitted), "a committed sample was lost"
        assert state.producers_done == self.producer_closed, "producers_done differs from model"
        assert set(state.dead) == self.dead
        # A lost sample trained in this data epoch of the lineage (a resume to a checkpoint
        # from before the loss) needs its features again only in the next data epoch.
        lost_untrained = set(state.lost) - set(state.trained) - self.excluded
        assert set(state.excluded) == self.excluded, "exclusions differ from the model"
        assert lost_untrained <= set(state.regenerate), "a lost sample is not to regenerate"
        if self.consumers:
            assert state.trained == self.trained, "trained set differs from the lineage model"
            leased = {r.sample_id for refs in self.leased.values() for r in refs}
            assert set(state.leased) == leased
        for sample_id in set(self.emitted) - self.dead - set(state.regenerate):
            if sample_id in state.released or sample_id in set(state.lost) - lost_untrained:
                continue
            assert self.store.exists(state.ref(sample_id)), (
                f"features of {sample_id!r} are gone but the ledger does not list it "
                "for regeneration"
            )
        if self.policy == "never":
            assert not state.released, "features released under policy 'never'"
        elif self.policy == "on_ack":
            assert state.released <= self.ever_acked | self.dead
        else:
            assert state.released <= self.ever_checkpointed | self.dead, (
                "features released before their sample was trained into a checkpoint"
            )
        assert set(state.removed_checkpoints) == self.removed, "removals differ from the model"
        latest = state.checkpoint_for("latest") if state.epoch else None
        assert latest is None or latest.seq not in self.removed, "latest names a removed one"

    def teardown(self) -> None:
        self.store.close()
        self.checkpoint_dir.cleanup()


def _fold_every_lineage(ledger: Ledger, run_id: str) -> RunState:
    """The full fold with every resume folding its lineage's acks (no shortcut from the
    current trained set): what the shortcut must equal."""
    state = RunState(run_id, ref_source=ledger)
    state._rewound = lambda *_: None  # type: ignore[method-assign]
    return state.apply_rows(ledger.rows(run_id))


def machine_settings(profile: str = "normal", **overrides: Any) -> settings:
    """Hypothesis settings of a profile: "normal" (200 examples) or "thorough" (2000).

    ``overrides`` are hypothesis settings (``max_examples=5``...) that replace the profile's.
    """
    if not isinstance(profile, str):
        raise ArgumentTypeError(
            f"profile must be a str, one of {sorted(PROFILES)}, got {profile!r} "
            f"({type(profile).__name__})"
        )
    if profile not in PROFILES:
        raise InvalidArgumentError(
            f"profile must be one of {sorted(PROFILES)}, got {profile!r}: pass one of them "
            "(and max_examples=N to run another number of examples)"
        )
    options: dict[str, Any] = {
        "max_examples": PROFILES[profile],
        "stateful_step_count": 40,
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    }
    options.update(overrides)
    try:
        return settings(**options)
    except (InvalidArgument, TypeError) as exc:
        raise ArgumentTypeError(
            f"hypothesis refused the settings overrides {overrides!r}: {exc}; pass only "
            "hypothesis.settings arguments with values it accepts"
        ) from exc


def run_ledger_machine(
    ledger: Ledger,
    make_store: Callable[[], FeatureStore],
    *,
    profile: str = "normal",
    check_snapshots: bool = True,
    **overrides: Any,
) -> None:
    """Run the state machine against ``ledger`` and stores from ``make_store``.

    ``make_store`` is called with no arguments once per example and returns a fresh
    store: pass the class (``LocalFeatureStore``) or a factory, not a store.
    Raises (with hypothesis's minimal failing example) when an invariant breaks.
    ``check_snapshots``: after every step, also fold the whole log and compare it
    with the fold from the newest snapshot (a full replay per step: turn it off when
    what is under test is the store, not the ledger).
    """
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(
            f"ledger must be a dataflow.Ledger, got {ledger!r} ({type(ledger).__name__}): "
            "open one with Ledger.open(url)"
        )
    if not callable(make_store):
        kind = type(make_store).__name__
        hint = f" ({kind}, not {kind}())" if isinstance(make_store, FeatureStore) else ""
        raise ArgumentTypeError(
            f"make_store must be a callable that returns a fresh FeatureStore, got "
            f"{make_store!r} ({kind}): pass the store class or a factory{hint}; it is "
            "called once per example"
        )
    if not isinstance(check_snapshots, bool):
        raise ArgumentTypeError(
            f"check_snapshots must be True or False, got {check_snapshots!r} "
            f"({type(check_snapshots).__name__})"
        )
    machine_options = machine_settings(profile, **overrides)
    machine = type(
        "LedgerMachineRun",
        (LedgerMachine,),
        {
            "ledger": ledger,
            "make_store": staticmethod(make_store),
            "check_snapshots": check_snapshots,
        },
    )
    run_state_machine_as_test(machine, settings=machine_options)
