"""The fold's event handlers: what each kind of event does to a run's state.

Each reads its payload as the kind's declared type (``read_payload``): a payload that is
not that type raises ValueError, which the fold records as a violation with its seq.
A LEASE, ACK, NACK or RELEASE row names one sample (its sample id) or a batch (the payload's
``samples``, sample id NULL): a batch applies to each of its samples in order, exactly as
their rows of one sample would, and a violation names the row's seq and the sample. An ACK
batch row of several steps names each sample's step (``steps``); its step column is the
highest of them.
"""

from __future__ import annotations

from typing import Any

from dataflow.model._events import UNSET, Kind, NackPayload, read_payload
from dataflow.model._exclusions import ExclusionHandlers
from dataflow.model._lineage import Checkpoint, LineageBranch, ReconcilePlan, WholeFoldNeeded


def _batch(kind: str, payload: str | None) -> Any:
    """The payload of a batch row of ``kind`` (no sample id): ValueError unless it names
    its samples."""
    p = read_payload(kind, payload)
    if p.samples is UNSET:
        raise ValueError(f"a {kind} row without a sample id must name its `samples`")
    return p


def _single(kind: str, payload: str | None) -> Any:
    """The payload of a row of one sample (its sample id set): ValueError if it names a batch."""
    p = read_payload(kind, payload)
    if p.samples is not UNSET:
        raise ValueError(f"a {kind} row with a sample id must not name `samples`")
    return p


class EventHandlers:
    """One ``_on_<kind>`` method per event kind (a base of RunState; see ``HANDLERS``).

    Each takes one row's fields; a payload that is not its kind's type raises ValueError,
    which ``RunState.apply_rows`` records as a violation with the row's seq.
    """

    __slots__ = ()

    def _on_commit(
        self,
        seq: int,
        sid: str,
        revision: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str,
    ) -> None:
        if not isinstance(payload, str) or f'"sample_id":"{sid}"' not in payload:
            # Refs are stored as compact, key-sorted JSON: the row's own id must be in it.
            self.violations.append(f"seq {seq}: the commit of {sid!r} carries no ref of {sid!r}")
            return
        if self._stale_producer(seq, f"commit of {sid!r}", actor, epoch):
            pass  # committed all the same: the sample is the run's, and must be trained
        elif actor in self.closed and not revision:  # a regeneration is waited for
            self.violations.append(
                f"seq {seq}: commit of {sid!r} by producer {actor!r} after its close, with no "
                "claim between: a consumer may have taken the run as finished without it"
            )
        self.producers.add(actor)
        self.closed.discard(actor)
        revision = revision or 0
        if sid in self._commits and revision <= self._revisions.get(sid, 0):
            self.violations.append(f"seq {seq}: duplicate commit of {sid!r} revision {revision}")
            return
        first = sid not in self._commits
        if first and self._forgetting and sid in self._forgotten:
            raise WholeFoldNeeded  # a regeneration of a forgotten sample, or a hash collision
        if first:
            self._commits[sid] = sid
            if revision:
                self._revisions[sid] = revision
        else:
            sid = self._commits[sid]
            self._revisions[sid] = revision
        if first:
            self._first_seqs.append(seq)
            self.producer_commits.setdefault(actor, []).append(sid)
            owner = self._round_robin_owner()
            if self._json_rank is None or owner == self._json_rank:
                self._json[sid] = payload  # another rank's is read from the ledger if asked
            self._enqueue(sid, owner, requeued=False)
            return
        self._json[sid] = payload
        # A regeneration: the features are back. A lost sample goes back to the rank that
        # found it lost (it regenerates it, and may be the only rank still leasing).
        self.released.discard(sid)
        self.lost.pop(sid, None)
        owner = self._lost_rank.pop(sid, None)
        if sid in self.regenerate:
            del self.regenerate[sid]
            if owner is None or owner >= self.world_size:
                owner = self._round_robin_owner()
            self._enqueue(sid, owner, requeued=True)

    def _on_close(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if self._stale_producer(seq, "close", actor, epoch):
            return  # only the id's holder can end it
        self.closed.add(actor)
        if not read_payload(Kind.CLOSE, payload if isinstance(payload, str) else None).streamed:
            self.unstreamed.add(actor)
        else:
            self.unstreamed.discard(actor)
        if self.order_seed is not None and self.producers_done:
            self._resort()

    def _stale_producer(self, seq: int, what: str, actor: str, epoch: int) -> bool:
        """Whether a producer's write comes from an epoch that does not hold its id (a
        violation: the ledger refuses those)."""
        held = self.producer_epochs.get(actor, 0)
        if epoch == held:
            return False
        self.violations.append(
            f"seq {seq}: {what} by producer {actor!r} with producer epoch {epoch}, but "
            f"epoch {held} holds the id (a fenced producer wrote)"
        )
        return True

    def _on_claim(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        held = self.producer_epochs.get(actor, 0)
        if not isinstance(epoch, int) or epoch <= held:
            self.violations.append(
                f"seq {seq}: claim of producer {actor!r} with epoch {epoch!r}, not above "
                f"the epoch {held} holding it"
            )
            return
        self.producer_epochs[actor] = epoch
        self.producers.add(actor)
        self.closed.discard(actor)
        store = read_payload(Kind.CLAIM, payload if isinstance(payload, str) else None).store
        if store is not None:
            self.store_uris[store] = None

    def _on_resume(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str,
    ) -> None:
        if self._forgetting:
            raise WholeFoldNeeded  # the trained set at a checkpoint needs the whole lineage
        p = read_payload(Kind.RESUME, payload)
        if epoch <= self.epoch:
            self.violations.append(f"seq {seq}: resume to epoch {epoch} after epoch {self.epoch}")
            return
        ckpt = next((c for c in self.checkpoints if c.seq == p.checkpoint_seq), None)
        if p.checkpoint_seq is not None and ckpt is None:
            self.violations.append(
                f"seq {seq}: resume from unknown checkpoint seq {p.checkpoint_seq}"
            )
        elif ckpt is not None and ckpt.seq in self.removed_checkpoints:
            self.violations.append(
                f"seq {seq}: resume from checkpoint seq {ckpt.seq} (step {ckpt.step}), whose "
                f"files were removed ({self.removed_checkpoints[ckpt.seq]})"
            )
            return
        untrained: set[str] | None = None
        if ckpt is None:
            trained, data_epoch, seed, start_seq = {}, 0, None, 0
        else:
            chain = self._chain(ckpt.epoch, ckpt.step, ckpt.seq)
            data_epoch, seed, start_seq = self._data_epoch_at(chain)
            rewound = self._rewound(ckpt, data_epoch)
            if rewound is None:
                trained = self._trained_in(chain, data_epoch)
            else:
                trained, untrained = rewound
        node = LineageBranch(
            number=epoch,
            parent=ckpt.epoch if ckpt else None,
            cut_step=ckpt.step if ckpt else -1,
            cut_seq=ckpt.seq if ckpt else 0,
            base_data_epoch=data_epoch,
            policy=p.release_policy,
            world_size=p.world_size,
            max_attempts=p.max_attempts,
            order_seed=p.order_seed,
        )
        self._epochs[epoch] = node
        self._world_size = node.world_size
        self._resumes.append(epoch)
        self.epoch = epoch
        if data_epoch != self.data_epoch:
            self.attempts = {}
        self.data_epoch = data_epoch
        self.trained = trained
        self.leased = {}
        self._lessee_rank = {}
        self._order_args = (data_epoch, seed, start_seq)
        order = self._data_epoch_order(data_epoch, seed, start_seq)
        requeued = self._refill(order, requeued=True, untrained=untrained)
        released = [s for s in self._unreleased_after(trained)] if node.policy != "never" else []
        self.plans[epoch] = ReconcilePlan(
            epoch=epoch,
            checkpoint_step=ckpt.step if ckpt else None,
            requeued=tuple(requeued),
            released=tuple(released),
            regenerate=tuple(self.regenerate),
            trained=self._trained_at(ckpt),
            data_epoch=data_epoch,
            world_size=node.world_size,
            checkpoint=ckpt,
        )

    def _on_lease(
        self,
        seq: int,
        sid: str | None,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if sid is None:
            # Each sample as the state's own id object (``_commits``): the dicts the fold
            # keeps then hold no copy of it, and find it by identity.
            lease, shared = self._lease_one, self._commits.get
            for one in _batch(Kind.LEASE, payload).samples:
                lease(seq, shared(one, one), actor)
            return
        if payload is not None:  # a row of one sample has none; a forged one is refused
            _single(Kind.LEASE, payload)
        self._lease_one(seq, sid, actor)

    def _lease_one(self, seq: int, sid: str, actor: str) -> None:
        owner = self._dequeue(sid)
        if owner is None:
            self.violations.append(
                f"seq {seq}: lease of {sid!r} by {actor!r}, which was not pending"
            )
            return
        self.leased[sid] = actor
        self._lessee_rank[sid] = owner

    def _on_ack(
        self,
        seq: int,
        sid: str | None,
        _r: int | None,
        _e: int,
        step: int,
        actor: str,
        payload: str | None,
    ) -> None:
        if sid is None:
            ack, shared, p = self._ack_one, self._commits.get, _batch(Kind.ACK, payload)
            if p.steps is UNSET:
                for one in p.samples:
                    ack(seq, shared(one, one), step, actor)
                return
            if step != max(p.steps):
                raise ValueError(
                    f"an ack row of steps {min(p.steps)} to {max(p.steps)} has step "
                    f"{step!r} in its step column: it must hold the highest, {max(p.steps)}"
                )
            for one, own in zip(p.samples, p.steps, strict=True):
                ack(seq, shared(one, one), own, actor)
            return
        if payload is not None:  # a row of one sample has none; a forged one is refused
            _single(Kind.ACK, payload)
        self._ack_one(seq, sid, step, actor)

    def _ack_one(self, seq: int, sid: str, step: int, actor: str) -> None:
        if not self._end_lease(seq, "ack", sid, actor):
            return
        node = self._epochs[self.epoch]
        floor, newest = max(node.last_checkpoint_step, node.cut_step), node.ack_steps.get(actor, 0)
        if not isinstance(step, int) or step < 1 or step <= floor or step < newest:
            self.violations.append(
                f"seq {seq}: ack of {sid!r} at step {step!r} by {actor!r}: steps start at 1, "
                f"come after the lineage's checkpoint (step {floor}) and never go back "
                f"(this consumer acked step {newest})"
            )
        if sid in self.trained:
            self.violations.append(
                f"seq {seq}: {sid!r} trained twice in data epoch {self.data_epoch} of the lineage"
            )
        sid = self._commits.get(sid, sid)
        if isinstance(step, int):
            step = self._steps.setdefault(step, step)
        self.trained[sid] = step
        if node.policy != "never":
            self._unreleased_acks[sid] = step
        elif self._forgetting:
            self._may_have_finished(sid)
        if self._ref_source is not None:
            self._forget_json(sid)
        node.acks.append(sid, step, self.data_epoch)
        if isinstance(step, int) and step > newest:
            node.ack_steps[actor] = step

    def _on_nack(
        self,
        seq: int,
        sid: str | None,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if sid is None:
            p, shared = _batch(Kind.NACK, payload), self._commits.get
            for one in map(shared, p.samples, p.samples):
                queue_rank = self._lessee_rank.get(one)
                if self._end_lease(seq, "nack", one, actor):
                    self._nack_one(one, p, queue_rank)
            return
        queue_rank = self._lessee_rank.get(sid)
        if not self._end_lease(seq, "nack", sid, actor):
            return
        self._nack_one(sid, _single(Kind.NACK, payload), queue_rank)

    def _nack_one(self, sid: str, p: NackPayload, queue_rank: int | None) -> None:
        attempts = self.attempts.get(sid, 0) + 1
        self.attempts[sid] = attempts
        node = self._epochs[self.epoch]
        if not p.retryable or attempts >= node.max_attempts:
            why = p.reason or "nacked"
            self.dead[sid] = f"{why} (attempt {attempts}, retryable={p.retryable})"
        else:
            self._enqueue(sid, self._retry_rank(p.rank, queue_rank), requeued=True)

    def _on_lost(
        self,
        seq: int,
        sid: str,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        rank = self._lessee_rank.get(sid)
        if not self._end_lease(seq, "lost", sid, actor):
            return
        p = read_payload(Kind.LOST, payload)
        if sid not in self._commits or p.revision != self._revisions.get(sid, 0):
            # An older revision's features went missing; the newest ones are stored: back to
            # the rank that found it (alive; a round-robin owner may have drained).
            self._enqueue(sid, self._retry_rank(None, rank), requeued=True)
            return
        self.lost[sid] = p.reason or "lost"
        if sid in self.excluded:
            return  # not regenerated: it is not to be trained
        if rank is not None:
            self._lost_rank[sid] = rank
        self.regenerate[sid] = None

    def _on_checkpoint(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        step: int,
        _a: str,
        payload: str | None,
    ) -> None:
        node = self._epochs.get(epoch)
        if node is None:
            self.violations.append(f"seq {seq}: checkpoint before any resume")
            return
        floor = max(node.last_checkpoint_step, node.cut_step)
        if not isinstance(step, int) or step < 0 or step <= floor:
            self.violations.append(
                f"seq {seq}: checkpoint at step {step!r} after the lineage's checkpoint at "
                f"step {floor}: checkpoint steps must increase"
            )
            return
        node.last_checkpoint_step = step
        p = read_payload(Kind.CHECKPOINT, payload)
        self.checkpoints.append(Checkpoint(seq, epoch, step, p.path, self.data_epoch, p.digest))

    def _on_checkpoint_removed(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        _e: int,
        _s: int | None,
        _a: str,
        payload: str | None,
    ) -> None:
        p = read_payload(Kind.CHECKPOINT_REMOVED, payload)
        target = p.checkpoint_seq
        if not any(c.seq == target for c in self.checkpoints):
            self.violations.append(f"seq {seq}: removal of unknown checkpoint seq {target}")
            return
        self.removed_checkpoints[target] = p.reason or "removed"

    def _on_release(
        self,
        seq: int,
        sid: str | None,
        _r: int | None,
        _e: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if sid is None:
            p = _batch(Kind.RELEASE, payload)
            for one, revision in zip(p.samples, p.revisions, strict=True):
                self._release_one(seq, one, revision, actor)
            return
        self._release_one(seq, sid, _single(Kind.RELEASE, payload).revision, actor)

    def _release_one(self, seq: int, sid: str, revision: int, actor: str) -> None:
        if sid not in self._commits and self._forgetting and sid in self._forgotten:
            raise WholeFoldNeeded  # released again: a violation, perhaps, that needs its state
        if sid not in self._commits or revision != self._revisions.get(sid, 0):
            return  # an older revision's features: the current ones stay
        reason = self._release_forbidden(sid)
        if reason:
            self.violations.append(f"seq {seq}: release of {sid!r} by {actor!r}: {reason}")
        self.released.add(self._commits[sid])
        self._unreleased_acks.pop(sid, None)
        if self._forgetting:
            self._may_have_finished(sid)

    def _release_forbidden(self, sid: str) -> str | None:
        policy = self.release_policy
        if policy == "never":
            return "the release policy is 'never'"
        if sid in self.dead:
            return None  # a dead sample's features may always go
        if sid not in self.trained:
            return "the sample is not trained in this lineage"
        if policy == "on_checkpoint" and self.trained[sid] > self.last_checkpoint_step:
            return "the sample is not yet trained into a durable checkpoint"
        return None

    def _on_exclusion(
        self,
        seq: int,
        sid: str | None,
        revision: int | None,
        epoch: int,
        step: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        if self._forgetting:
            raise WholeFoldNeeded  # an excluded sample may be one the state forgot
        self._on_exclude(seq, sid, revision, epoch, step, actor, payload)

    def _on_data_epoch(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        _a: str,
        payload: str | None,
    ) -> None:
        if self._forgetting:
            raise WholeFoldNeeded  # every committed sample is pending again
        p = read_payload(Kind.DATA_EPOCH, payload)
        number = self.data_epoch + 1 if p.data_epoch is UNSET else p.data_epoch
        if type(number) is not int or not 0 <= number < 2**63:
            raise ValueError(f"data_epoch {number!r:.40} is no int from 0 to 2**63-1")
        seed = number if p.seed is UNSET else p.seed
        self._epochs[epoch].data_epochs.append((seq, number, seed))
        self.data_epoch = number
        self.trained = {}
        self.attempts = {}
        self._order_args = (number, seed, seq)
        order = self._data_epoch_order(number, seed, seq)
        if self.leased:  # start_data_epoch refuses this: a damaged or hand-made log
            self.violations.append(
                f"seq {seq}: data epoch {number} starts while {len(self.leased)} samples are "
                f"leased (e.g. {next(iter(self.leased))!r}); they stay leased"
            )
            order = [sid for sid in order if sid not in self.leased]
        self._refill(order, requeued=True)


#: The handler of each kind.
HANDLERS = {
    Kind.COMMIT: EventHandlers._on_commit,
    Kind.CLOSE: EventHandlers._on_close,
    Kind.RESUME: EventHandlers._on_resume,
    Kind.LEASE: EventHandlers._on_lease,
    Kind.ACK: EventHandlers._on_ack,
    Kind.NACK: EventHandlers._on_nack,
    Kind.CHECKPOINT: EventHandlers._on_checkpoint,
    Kind.RELEASE: EventHandlers._on_release,
    Kind.DATA_EPOCH: EventHandlers._on_data_epoch,
    Kind.CHECKPOINT_REMOVED: EventHandlers._on_checkpoint_removed,
    Kind.LOST: EventHandlers._on_lost,
    Kind.CLAIM: EventHandlers._on_claim,
    Kind.EXCLUDE: EventHandlers._on_exclusion,
    Kind.INCLUDE: ExclusionHandlers._on_include,
}
