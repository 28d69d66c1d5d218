"""The Consumer's acks, nacks and lost reports: how a leased sample is finished.

An ack records the optimizer step a sample was trained into (and, with
``release_policy="on_ack"``, releases its features); a nack gives it back, to
retry or dead; a lost report says its features are gone, so it waits for its
regeneration. Each is one fenced write, checked against the fold first: only
samples this consumer holds, steps that go forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from dataflow.live._consumer_args import _check_step, _sample_ids
from dataflow.live._consumer_writes import _BATCH_ROWS_SCHEMA, _FencedWrites, _locked
from dataflow.model._errors import (
    ArgumentTypeError,
    CommitOutcomeUnknownError,
    InvalidArgumentError,
    LedgerStateError,
)
from dataflow.model._events import Kind, ack_payloads, dump_payload
from dataflow.model._refs import SampleRef
from dataflow.recorder._ledger import NewEvent, WriteTransaction


class _Acks(_FencedWrites):
    """Finishing leased samples: ack, ack_many, nack, lost, and the checks they share."""

    # -- acks ------------------------------------------------------------------
    def ack(self, refs: Iterable[SampleRef | str], *, step: int) -> None:
        """Record that ``refs`` were trained into optimizer step ``step`` (one transaction).

        Steps count optimizer steps from 1. A step must come after the
        lineage's newest checkpoint, and must not be lower than a step this
        consumer already acked in its epoch (a resume from an older
        checkpoint starts a new epoch, which goes on after that checkpoint's
        step). LedgerStateError otherwise, before anything is written.
        """
        self.ack_many([(refs, step)])

    @_locked
    def ack_many(self, acks: Iterable[tuple[Iterable[SampleRef | str], int]]) -> None:
        """The acks of several optimizer steps, ``[(refs, step), ...]``, in one transaction.

        The same as :meth:`ack` of each in turn (steps in order, none lower than the
        one before), but all or nothing and one ledger write: a loader that acks a
        few steps at once pays one transaction for them, and one ACK row (it names each
        sample's step; see docs/ledger.md "Batch rows"). A sample may appear once.
        """
        steps, ids = self._checked_acks(acks)
        if not steps:
            return
        if self._repeats_landed(ids, self._trained_by_an_ack):  # a retry after a lost reply
            return self._acked(ids, ids if self.release_policy == "on_ack" else [])
        release: list[str] = []
        try:
            with self._write("ack") as tx:
                tx.append(self._ack_events(tx, steps, ids, release))
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._trained_by_an_ack):
                raise
        self._acked(ids, release)

    def _checked_acks(
        self, acks: Iterable[tuple[Iterable[SampleRef | str], int]]
    ) -> tuple[list[tuple[list[str], int]], list[str]]:
        """``acks`` as (ids, step) pairs in step order, and all their ids; raise on bad input."""
        if isinstance(acks, (str, bytes)) or not isinstance(acks, Iterable):
            raise ArgumentTypeError(
                f"ack_many takes a list of (refs, step) pairs, got {acks!r:.100}"
            )
        steps: list[tuple[list[str], int]] = []
        for pair in acks:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ArgumentTypeError(f"ack_many takes (refs, step) pairs, got {pair!r:.100}")
            refs, step = pair
            steps.append((_sample_ids(refs, "ack"), _check_step("ack", step, minimum=1)))
        ids = _sample_ids([s for batch, _ in steps for s in batch], "ack_many")
        for (_, earlier), (_, later) in itertools.pairwise(steps):
            if later < earlier:
                raise LedgerStateError(
                    f"ack_many got step {later} after step {earlier}: give the steps in order"
                )
        return steps, ids

    def _check_acks_allowed(self, steps: list[tuple[list[str], int]], ids: list[str]) -> None:
        """Raise unless the fold allows the acks of ``steps`` (``ids``: all their ids)."""
        self._check_leased(ids, "ack")
        first = steps[0][1]
        floor = self.state.last_checkpoint_step
        if first <= floor:
            raise LedgerStateError(
                f"ack at step {first} in run {self.run_id!r}, but a checkpoint at step "
                f"{floor} already exists in this lineage: acks must name a later step"
            )
        newest = self.state.last_ack_step(self.consumer_id)
        if first < newest:
            raise LedgerStateError(
                f"ack at step {first} in run {self.run_id!r}, but {self.consumer_id!r} "
                f"already acked step {newest} in epoch {self.epoch}: steps must not go "
                "backwards; ack with the number of the optimizer step just taken"
            )

    def _ack_events(
        self,
        tx: WriteTransaction,
        steps: list[tuple[list[str], int]],
        ids: list[str],
        release: list[str],
    ) -> list[NewEvent]:
        """The events of the acks of ``steps`` in ``tx`` (their releases after them), once
        the ledger allows them; ``release`` gets the ids they release."""
        self._check_acks_allowed(steps, ids)
        if self.release_policy == "on_ack":
            release += ids
        return [*self._ack_rows(tx.epoch, steps), *self._release_events(release)]

    def _ack_rows(self, epoch: int, steps: list[tuple[list[str], int]]) -> list[NewEvent]:
        """The ACK rows of ``steps``: one batch row for all of them (a row of several steps
        names each sample's step), or on a ledger before schema 4 a row per sample."""
        if self.ledger.schema_version < _BATCH_ROWS_SCHEMA:
            return [
                event
                for step, same in itertools.groupby(steps, key=lambda pair: pair[1])
                for event in self._events(
                    Kind.ACK, [s for batch, _ in same for s in batch], epoch, step=step
                )
            ]
        ids = [s for batch, _ in steps for s in batch]
        own = [step for batch, step in steps for _ in batch]
        return [
            NewEvent(Kind.ACK, self.consumer_id, epoch=epoch, step=top, payload=payload)
            for payload, top in ack_payloads(ids, own)
        ]

    def _acked(self, ids: list[str], release: list[str]) -> None:
        """After acks landed: delete what they released, give the stream its credits."""
        self._delete_features(release)
        self._credit(ids)

    def _trained_by_an_ack(self, sample_id: str) -> bool:
        return self.state.is_trained(sample_id) and self._lease_ended(sample_id)

    def _lease_ended(self, sample_id: str) -> bool:
        """Whether this consumer no longer holds ``sample_id`` (after settling its lease)."""
        return self.state.leased.get(sample_id) != self.consumer_id

    def _check_leased(self, ids: list[str], what: str) -> None:
        """Every id is leased by this consumer; ``what`` is the verb ("ack", "report lost")."""
        for sid in ids:
            holder = self.state.leased.get(sid)
            if holder != self.consumer_id:
                held = f"leased by {holder!r}" if holder else "not leased"
                raise LedgerStateError(
                    f"cannot {what} {sid!r}: it is {held} in epoch {self.epoch} of run "
                    f"{self.run_id!r}; only samples this consumer leased can take a {what}"
                )

    # -- giving samples back ---------------------------------------------------
    @_locked
    def nack(
        self, refs: Iterable[SampleRef | str], *, retryable: bool = True, reason: str = ""
    ) -> None:
        """Give samples back: pending again if retryable, dead after ``max_attempts`` or if not.

        A retry goes back to this rank's queue (this rank is alive, so it is never stranded
        on a rank that already drained); with several ranks the nack records the rank.
        """
        ids = _sample_ids(refs, "nack")
        if not isinstance(retryable, bool):
            raise ArgumentTypeError(f"retryable must be a bool, got {retryable!r}")
        if not isinstance(reason, str) or len(reason) > 1000:
            raise InvalidArgumentError(
                f"reason must be a str of at most 1000 characters, got {reason!r}"
            )
        if self._repeats_landed(ids, self._lease_ended):  # a retry after a lost reply
            self._credit(ids)
            return
        try:
            with self._write("nack") as tx:
                self._check_leased(ids, "nack")
                fields: dict[str, Any] = {"retryable": retryable, "reason": reason}
                if self.world_size > 1:
                    fields["rank"] = self.rank
                tx.append(self._events(Kind.NACK, ids, tx.epoch, **fields))
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._lease_ended):
                raise
        self._credit(ids)

    @_locked
    def lost(self, refs: Iterable[SampleRef | str], *, reason: str) -> None:
        """Report leased samples whose features are gone or corrupt on a load.

        For a StaleRefError or CorruptFeatureError from ``load`` (a store server
        restarted, a file deleted or damaged): not a training failure, so no
        attempt is counted and the sample never dies of it. It leaves this
        consumer's leases, is listed in ``state.lost`` and ``state.regenerate``,
        and comes back, to this rank, once it is regenerated
        (``Producer.regenerate``). What is left of its features is deleted.
        """
        ids = _sample_ids(refs, "lost")
        if not isinstance(reason, str) or not 0 < len(reason) <= 1000:
            raise InvalidArgumentError(
                f"reason must be a str of 1 to 1000 characters, got {reason!r:.80}"
            )
        if self._repeats_landed(ids, self._lease_ended):  # a retry after a lost reply
            self._credit(ids)
            self._delete_features(s for s in ids if s in self.state.lost)
            return
        try:
            with self._write("lost") as tx:
                self._check_leased(ids, "report lost")
                tx.append(
                    NewEvent(
                        Kind.LOST,
                        self.consumer_id,
                        sid,
                        epoch=tx.epoch,
                        payload=dump_payload(
                            {"revision": self.state.revision(sid), "reason": reason}
                        ),
                    )
                    for sid in ids
                )
                self._sync(tx)
        except CommitOutcomeUnknownError:
            if not self._landed(ids, self._lease_ended):
                raise
        self._credit(ids)
        self._delete_features(s for s in ids if s in self.state.lost)
