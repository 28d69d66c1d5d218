"""Excluding samples from a run and including them again: the checks, and the write.

Used by :meth:`Consumer.exclude` / :meth:`Consumer.include` (inside the consumer's own
fenced transaction) and by ``dataflow exclude`` / ``dataflow include``, which append
from outside any training process (:func:`write_exclusions`): with the run's current
consumer epoch, so the live ranks are not fenced off, and checked against the run's
exact state inside the transaction that appends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dataflow.live._view import RunView
from dataflow.model._errors import ArgumentTypeError, InvalidArgumentError, UnknownSampleError
from dataflow.model._events import MAX_EXCLUDE_BATCH, MAX_REASON_CHARS, Kind, dump_payload
from dataflow.model._fold import RunState
from dataflow.model._refs import validate_sample_id
from dataflow.recorder._ledger import Ledger, NewEvent, check_id

#: The actor of the events ``dataflow exclude`` and ``dataflow include`` append.
CLI_ACTOR = "dataflow-cli"
#: How many ids an error names before it says "and N more".
_NAMED = 5


@dataclass(frozen=True)
class ExclusionReport:
    """What an exclude or include did: ``changed`` (excluded, or included, now),
    ``unchanged`` (already excluded: an exclude leaves their first reason), the reason,
    and the consumer epoch the events were written with."""

    kind: str
    changed: tuple[str, ...]
    unchanged: tuple[str, ...]
    reason: str
    epoch: int


def check_reason(reason: object) -> str:
    """``reason`` if it is a str of 1 to MAX_REASON_CHARS characters, not all blank."""
    if not isinstance(reason, str):
        raise ArgumentTypeError(f"reason must be a str, got {type(reason).__name__}")
    if not reason.strip():
        raise InvalidArgumentError(
            "reason must say why (e.g. 'loss spike at step 1200'), got an empty one"
        )
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgumentError(
            f"reason must have at most {MAX_REASON_CHARS} characters, got {len(reason)}: "
            f"{reason[:60]!r}..."
        )
    return reason


def check_sample_ids(sample_ids: object) -> list[str]:
    """The valid, distinct ids of ``sample_ids`` in their order; an error for none, for a
    lone str (an iterable of its characters) and for an invalid id."""
    if isinstance(sample_ids, (str, bytes)) or not isinstance(sample_ids, Iterable):
        raise ArgumentTypeError(
            f"sample_ids must be an iterable of sample ids (a list), got "
            f"{type(sample_ids).__name__} {sample_ids!r:.80}"
        )
    ids = list(dict.fromkeys(validate_sample_id(s) for s in sample_ids))
    if not ids:
        raise InvalidArgumentError("sample_ids names no sample: give at least one")
    return ids


def _named(ids: list[str]) -> str:
    shown = ", ".join(repr(s) for s in ids[:_NAMED])
    return shown + (f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")


def exclusion_events(
    state: RunState, *, include: bool, sample_ids: list[str], reason: str, actor: str, epoch: int
) -> tuple[list[NewEvent], ExclusionReport]:
    """The EXCLUDE (or INCLUDE) events that ``sample_ids`` need in ``state``, and the report.

    UnknownSampleError, naming them, for ids the run never committed, and (include) for
    ids that are not excluded: include undoes only an exclusion. Nothing is written.
    """
    kind = Kind.INCLUDE if include else Kind.EXCLUDE
    unknown = [s for s in sample_ids if s not in state.committed]
    if unknown:
        raise UnknownSampleError(
            f"cannot {kind} {_named(unknown)}: run {state.run_id!r} never committed "
            f"{'it' if len(unknown) == 1 else 'them'} (check the ids; "
            "`dataflow export --samples` lists the committed ones); nothing was written"
        )
    if include:
        absent = [s for s in sample_ids if s not in state.excluded]
        if absent:
            raise UnknownSampleError(
                f"cannot include {_named(absent)} in run {state.run_id!r}: not excluded "
                "(include undoes only an exclusion); nothing was written"
            )
        changed, unchanged = sample_ids, []
    else:
        changed = [s for s in sample_ids if s not in state.excluded]
        unchanged = [s for s in sample_ids if s in state.excluded]
    events = [
        NewEvent(
            kind,
            actor,
            epoch=epoch,
            payload=dump_payload(
                {"samples": changed[start : start + MAX_EXCLUDE_BATCH], "reason": reason}
            ),
        )
        for start in range(0, len(changed), MAX_EXCLUDE_BATCH)
    ]
    report = ExclusionReport(kind, tuple(changed), tuple(unchanged), reason, epoch)
    return events, report


def write_exclusions(
    ledger: Ledger,
    run_id: str,
    sample_ids: Iterable[str],
    *,
    reason: str,
    include: bool = False,
    actor: str = CLI_ACTOR,
) -> ExclusionReport:
    """Exclude (``include=True``: include again) ``sample_ids`` in ``run_id`` from outside
    a training process, in one transaction with the run's current consumer epoch.

    Checked against the run's state inside that transaction (see
    :func:`exclusion_events`); an exclusion before the first resume (epoch 0) holds too.
    """
    if not isinstance(ledger, Ledger):
        raise ArgumentTypeError(f"ledger must be a dataflow.Ledger, got {type(ledger).__name__}")
    check_id("run_id", run_id)
    check_id("actor", actor)
    ids, reason = check_sample_ids(sample_ids), check_reason(reason)
    view = RunView(ledger, run_id)
    with ledger.write(run_id, Kind.INCLUDE if include else Kind.EXCLUDE) as tx:
        state = view.catch_up_in(tx)
        events, report = exclusion_events(
            state, include=include, sample_ids=ids, reason=reason, actor=actor, epoch=tx.epoch
        )
        tx.append(events)
    return report
