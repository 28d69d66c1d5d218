"""Exclusions: samples taken out of a run with a reason, outside its lineage.

An EXCLUDE event takes samples out of the run: they leave the pending queues and the
samples to regenerate, and no later event puts them back (a nack, a lost report, a
resume from any checkpoint, a new data epoch), until an INCLUDE names them. The fold
keeps them in ``RunState.excluded`` (id -> reason), beside the lineage and not in it:
an exclusion is a decision about the data, not training progress, so a resume to a
checkpoint older than the exclusion keeps it.

What an exclusion does not undo: a sample it names that the lineage trained stays
trained (its step is in the checkpoints taken since; a resume to an older checkpoint
drops it, and it is then not leased again); a sample leased when it is excluded keeps
its lease, and the lease ends as any does (an ack trains it; a nack or lost report
does not requeue it). The exclusion takes effect at the next lease.
"""

from __future__ import annotations

from dataflow.model._events import Kind, read_payload


class ExclusionHandlers:
    """The fold's ``_on_exclude`` and ``_on_include`` (a base of RunState, working on the
    attributes ``RunState.__init__`` declares)."""

    __slots__ = ()

    def _exclusion_epoch_ok(self, seq: int, kind: str, epoch: int, actor: str) -> bool:
        """Written with the run's current consumer epoch (0 before the first resume)."""
        if epoch == self.epoch:
            return True
        self.violations.append(
            f"seq {seq}: {kind} by {actor!r} with stale epoch {epoch} (run at {self.epoch})"
        )
        return False

    def _on_exclude(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        p = read_payload(Kind.EXCLUDE, payload)
        if not self._exclusion_epoch_ok(seq, Kind.EXCLUDE, epoch, actor):
            return
        for sid in p.samples:
            if sid not in self._commits:
                self.violations.append(f"seq {seq}: exclusion of {sid!r}, never committed")
                continue
            if sid in self.excluded:
                continue  # the first exclusion's reason stands
            sid = self._commits[sid]
            self.excluded[sid] = p.reason
            self.excluded_total += 1
            self._dequeue(sid)
            self.regenerate.pop(sid, None)
            self._lost_rank.pop(sid, None)

    def _on_include(
        self,
        seq: int,
        _sid: str | None,
        _r: int | None,
        epoch: int,
        _s: int | None,
        actor: str,
        payload: str | None,
    ) -> None:
        p = read_payload(Kind.INCLUDE, payload)
        if not self._exclusion_epoch_ok(seq, Kind.INCLUDE, epoch, actor):
            return
        for sid in p.samples:
            if sid not in self.excluded:
                self.violations.append(f"seq {seq}: inclusion of {sid!r}, which is not excluded")
                continue
            del self.excluded[sid]
            sid = self._commits[sid]
            if sid in self.dead or sid in self.trained or sid in self.leased:
                continue  # as it was: an inclusion trains nothing twice
            if sid in self.released or sid in self.lost:
                self.regenerate[sid] = None
                continue
            self._enqueue(sid, self._round_robin_owner(), requeued=True)
        if self.order_seed is not None and self.producers_done:
            self._resort()  # back at its place in the seeded order


def trained_after(state: object, step: int, through: int | None = None) -> list[str]:
    """The ids the current lineage of ``state`` (a RunState) trained at a step after
    ``step`` (and at most ``through``), by step, then in the order they were acked.

    What a resume from the checkpoint at ``step`` abandons: the samples to exclude when
    the steps after it went wrong (``dataflow exclude --trained-after``).
    """
    trained: dict[str, int] = state.trained  # type: ignore[attr-defined]
    picked = [
        (s, sid)
        for sid, s in trained.items()
        if isinstance(s, int) and s > step and (through is None or s <= through)
    ]
    picked.sort(key=lambda pair: pair[0])  # stable: ack order within a step
    return [sid for _, sid in picked]
