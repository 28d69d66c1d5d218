"""The Consumer's resume and rejoin: starting or joining a fencing epoch, and reconciling.

A fencing epoch is the generation of a run's consumers. Rank 0's
:meth:`Consumer.resume` starts a new one (fencing off every older consumer of
the run) from a recorded checkpoint, and the fold's reconcile says what each
rank does again; the other ranks join it. :meth:`Consumer.rejoin` joins the
current one alone, after one rank's process restarted, and appends nothing.
"""

from __future__ import annotations

import time
import warnings

from dataflow.live._collectives import agree, broadcast_int, group_active
from dataflow.live._consumer_args import _check_int
from dataflow.live._consumer_leases import _Leasing
from dataflow.live._consumer_writes import _POLL_S, _locked, _trim_heap
from dataflow.model._errors import LedgerStateError, PeerFailedError, UnknownCheckpointError
from dataflow.model._events import Kind, dump_payload
from dataflow.model._fold import Checkpoint, ReconcilePlan
from dataflow.recorder._ledger import NewEvent


class _Resuming(_Leasing):
    """Starting (rank 0) or joining a fencing epoch, reconciling from a checkpoint, and
    rejoining the current epoch after a restart."""

    @_locked
    def resume(self, checkpoint: object = "latest") -> ReconcilePlan:
        """Start a new (fencing) epoch from ``checkpoint`` and reconcile; return the plan.

        ``checkpoint``: ``"latest"`` (the newest checkpoint of the current
        lineage, or from scratch when there is none), a step (int) naming a
        recorded checkpoint (UnknownCheckpointError otherwise), a Checkpoint
        from ``state.checkpoints``, or None (from scratch). Ranks other than 0
        join the epoch rank 0 started, and reclaim what their ``consumer_id``
        still holds in it (see :meth:`rejoin`). Resuming a run that has no events
        yet, in a ledger that holds other runs, warns and names them (a
        mistyped run id would otherwise start a new, empty run in silence);
        the first run of a new ledger starts quietly. With torch.distributed
        initialized it fails on every rank or on none: where it failed, its
        error; elsewhere :class:`PeerFailedError` (resume again on every rank).
        """
        if not (checkpoint is None or checkpoint == "latest" or isinstance(checkpoint, Checkpoint)):
            _check_int("checkpoint step", checkpoint)
        if self.rank == 0:
            epoch = self._start_fencing_epoch(checkpoint)
        else:
            epoch = self._join_fencing_epoch()
        # Every rank of a group got here: from now on a failure on one raises on each.
        error: Exception | None = None
        try:
            plan = self._reconcile(epoch)
        except Exception as exc:
            error = exc
        if group_active(self.world_size):
            agree(error, what=f"resume of run {self.run_id!r}")
        elif error is not None:
            raise error
        return plan

    def _reconcile(self, epoch: int) -> ReconcilePlan:
        """A resume once ``epoch`` is known: catch up, reclaim, and (rank 0) release."""
        if self.rank != 0:
            while self.state.epoch < epoch:  # rank 0 broadcast it once it was written
                self._catch_up()
                if self.state.epoch < epoch:
                    time.sleep(_POLL_S)
            self._check_world_size(epoch)
        joined, self.epoch = self.epoch != epoch, epoch
        # Stream refs of the old epoch are finished by this resume: they go
        # back through reconcile, so their slots go back to the window.
        self._credit(list(self._from_stream))
        self._catch_up()
        self._mark_closed_producers()
        if joined:  # not again for leases this object has already handed out
            self._reclaim()
        if self.rank == 0 and self.state.violations:
            problems = self.state.violations
            warnings.warn(
                f"run {self.run_id!r} in {self.ledger.safe_url} fails verification "
                f"({len(problems)} problems, the first: {problems[0]}): the ledger may be damaged "
                "or hand-edited, and what this resume trusts may be wrong; "
                f"`dataflow replay --ledger URL --run {self.run_id}` lists them",
                stacklevel=4,  # the caller of resume(), through resume and its lock
            )
        plan = self.state.plans[epoch]
        if self.rank == 0 and plan.released:
            with self._write("release") as tx:
                pending_release = [s for s in plan.released if s not in self.state.released]
                tx.append(self._release_events(pending_release))
                self._sync(tx)
            self._delete_features(pending_release)
        _trim_heap(self.state.head_seq)
        return plan.for_rank(self.rank)

    def _start_fencing_epoch(self, checkpoint: object) -> int:
        """Rank 0's part of a resume: the new epoch, written and then broadcast; if it fails,
        the other ranks are told so (they raise PeerFailedError) rather than left waiting."""
        distributed = group_active(self.world_size)
        try:
            epoch = self._append_resume(checkpoint)
        except Exception:
            if distributed:
                broadcast_int(-1)
            raise
        if distributed:
            broadcast_int(epoch)
        return epoch

    def _append_resume(self, checkpoint: object) -> int:
        if self.ledger.head_seq(self.run_id) == 0 and any(
            run != self.run_id for run in self.ledger.runs()
        ):
            warnings.warn(
                f"run {self.run_id!r} has no events in {self.ledger.safe_url}: resume() starts "
                f"it as a new run. {self._known_runs_hint()}",
                stacklevel=5,  # the caller of resume(), through resume and its lock
            )
        if not self._view.started:
            # The first fold (a snapshot, then the log) before the write lock: writers wait
            # only for the tail that the transaction reads.
            self._catch_up()
        with self._transaction("resume") as tx:
            self._sync(tx)
            ckpt = self._resolve_checkpoint(checkpoint)
            epoch = max(tx.epoch, self.state.epoch) + 1
            tx.set_epoch(epoch)
            payload = {
                "checkpoint_seq": ckpt.seq if ckpt else None,
                "checkpoint_step": ckpt.step if ckpt else None,
                "world_size": self.world_size,
                "release_policy": self.release_policy,
                "max_attempts": self.max_attempts,
            }
            if self.order_seed is not None:
                payload["order_seed"] = self.order_seed
            tx.append(
                [
                    NewEvent(
                        Kind.RESUME,
                        self.consumer_id,
                        epoch=epoch,
                        step=ckpt.step if ckpt else None,
                        payload=dump_payload(payload),
                    )
                ]
            )
            self._sync(tx)
        return epoch

    def _resolve_checkpoint(self, checkpoint: object) -> Checkpoint | None:
        if checkpoint is None:
            return None
        if isinstance(checkpoint, Checkpoint):
            if checkpoint not in self.state.checkpoints:
                raise UnknownCheckpointError(f"{checkpoint} is not recorded in run {self.run_id!r}")
            removed = self.state.removed_checkpoints.get(checkpoint.seq)
            if removed is not None:
                raise UnknownCheckpointError(
                    f"the checkpoint at step {checkpoint.step} (seq {checkpoint.seq}) of run "
                    f"{self.run_id!r} was removed ({removed}); resume from another one"
                )
            return checkpoint
        found = self.state.checkpoint_for(checkpoint)
        if found is None and checkpoint != "latest":
            steps = sorted({c.step for c in self.state.checkpoints})
            raise UnknownCheckpointError(
                f"run {self.run_id!r} has no checkpoint at step {checkpoint}; "
                f"recorded steps: {steps[-20:]} (pass None to start from scratch)"
            )
        return found

    def _join_fencing_epoch(self) -> int:
        """The epoch rank 0 started: broadcast by rank 0 in a group, else the ledger's."""
        if group_active(self.world_size):
            epoch = broadcast_int(0)
            if epoch < 0:
                raise PeerFailedError(
                    f"resume of run {self.run_id!r} failed on rank 0 (this is rank "
                    f"{self.rank}); see the error raised there"
                )
            return epoch
        return self._current_fencing_epoch(
            f"rank {self.rank} cannot join run {self.run_id!r}: rank 0 has not resumed "
            "yet (resume rank 0 first, or initialize torch.distributed)"
        )

    def _current_fencing_epoch(self, refusal: str) -> int:
        """The run's epoch, caught up; LedgerStateError(``refusal``) when none started yet."""
        self._catch_up()
        if self.state.epoch == 0:
            raise LedgerStateError(refusal)
        return self.state.epoch

    def _check_world_size(self, epoch: int) -> None:
        if self.state.world_size != self.world_size:
            raise LedgerStateError(
                f"epoch {epoch} of run {self.run_id!r} was started with world_size "
                f"{self.state.world_size}, but this consumer has world_size {self.world_size}: "
                "join it with the epoch's world size, or resume the whole run on the new one"
            )

    @_locked
    def rejoin(self) -> tuple[str, ...]:
        """Join the run's current epoch alone, after this rank's process restarted.

        For one rank that restarts while the others go on (independent consumers,
        asynchronous ranks; in synchronous data parallel training every rank restarts
        together and resumes). Nothing is appended, so no other rank is fenced off, and
        no collective runs, so any rank may rejoin, rank 0 included. The samples this
        ``consumer_id`` leased in the epoch and never acked, nacked or reported lost are
        handed out again, first, by the next :meth:`lease` calls, without a new lease
        event (they are still leased to it); returns their ids. Its acks stay.

        The restarted process must use the same ``consumer_id``, ``rank`` and
        ``world_size``: leases belong to the consumer id (another id reclaims nothing,
        and the old id's leases wait for the next resume). Its acks go on from step
        ``state.last_ack_step(consumer_id)``; its model state is the trainer's business.
        Rejoin only once the old process is dead: the two would share the leases.

        LedgerStateError when no consumer resumed the run yet, when the epoch has
        another world size, or when this Consumer already resumed or rejoined.
        """
        if self.epoch is not None:
            raise LedgerStateError(
                f"consumer {self.consumer_id!r} already joined epoch {self.epoch} of run "
                f"{self.run_id!r}: rejoin() is for a new Consumer in a restarted process"
            )
        epoch = self._current_fencing_epoch(
            f"consumer {self.consumer_id!r} cannot rejoin run {self.run_id!r}: no consumer "
            "has resumed it, so there is no epoch to rejoin; call resume() (rank 0 first)"
        )
        self._check_world_size(epoch)
        self.epoch = epoch
        self._mark_closed_producers()
        _trim_heap(self.state.head_seq)
        return self._reclaim()

    def _known_runs_hint(self) -> str:
        known = [r for r in self.ledger.runs() if r != self.run_id]
        shown = ", ".join(repr(r) for r in known[:20]) or "none"
        more = f" (and {len(known) - 20} more)" if len(known) > 20 else ""
        return f"If you meant an existing run, check the run id; known runs: {shown}{more}"
