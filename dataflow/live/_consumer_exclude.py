"""The Consumer's exclusions: take samples out of the run with a reason, or put them back.

See :mod:`dataflow.model._exclusions` for what an exclusion does to the fold.
"""

from __future__ import annotations

from collections.abc import Iterable

from dataflow.live._consumer_writes import _FencedWrites, _locked
from dataflow.live._exclusions import check_reason, check_sample_ids, exclusion_events


class _Exclusions(_FencedWrites):
    """:meth:`exclude` and :meth:`include`."""

    @_locked
    def exclude(self, sample_ids: Iterable[str], *, reason: str) -> list[str]:
        """Take ``sample_ids`` out of the run, with ``reason``; the ids excluded now.

        An excluded sample is never leased again in this run, whatever checkpoint a
        later resume starts from (an exclusion is a decision about the data, not
        training progress), until :meth:`include` names it. One it names that this
        lineage trained stays trained; one leased now keeps its lease, which ends as
        any does (its ack lands and trains it; a nack or lost report does not requeue
        it). Ids already excluded keep their first reason and are not returned.

        One fenced transaction, from any rank. UnknownSampleError (naming them) for
        ids the run never committed, InvalidArgumentError for an empty or overlong
        ``reason``; nothing is written then. ``dataflow exclude`` does the same from
        outside the training processes.
        """
        return self._exclusion(sample_ids, reason, include=False)

    @_locked
    def include(self, sample_ids: Iterable[str], *, reason: str) -> list[str]:
        """Undo the exclusion of ``sample_ids`` (each must be excluded), with ``reason``;
        the ids included.

        Each goes back to pending (to regeneration if its features were freed or lost),
        unless it is trained in this lineage, leased or dead. UnknownSampleError
        (naming them) for ids that are not excluded: nothing is written then.
        """
        return self._exclusion(sample_ids, reason, include=True)

    def _exclusion(self, sample_ids: Iterable[str], reason: str, *, include: bool) -> list[str]:
        self._fencing_epoch()
        ids, reason = check_sample_ids(sample_ids), check_reason(reason)
        with self._write("include" if include else "exclude") as tx:
            events, report = exclusion_events(
                self._view.whole_in(tx),  # it may name a sample a forgetting fold forgot
                include=include,
                sample_ids=ids,
                reason=reason,
                actor=self.consumer_id,
                epoch=tx.epoch,
            )
            tx.append(events)
            self._sync(tx)
        return list(report.changed)
