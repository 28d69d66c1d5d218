"""One sample of a run: its state, its row (what ``export`` writes), its whole history."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataflow.live._replay import replay
from dataflow.model._errors import DataflowError
from dataflow.model._events import (
    Kind,
    load_payload,
    read_payload,
    row_revisions,
    row_samples,
    row_steps,
)
from dataflow.model._fold import RunState
from dataflow.tools._progress import PROGRESS_EVERY, Progress
from dataflow.tools._times import iso_time

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger

#: The state of one committed sample (exactly one each; ``released`` is a separate flag:
#: a trained sample's features may be freed or not).
SAMPLE_STATES = ("pending", "leased", "trained", "lost", "regenerate", "dead", "excluded")


class NotInRunError(DataflowError, LookupError):
    """A sample the run never mentions (the CLI exits 1)."""


# -- one sample ---------------------------------------------------------------------


def sample_state(state: RunState, sample_id: str) -> str:
    """The one state of a committed sample: one of SAMPLE_STATES ("unaccounted" if none).

    "lost": its features were found missing or corrupt on a load; "regenerate": they were
    released but it must train again; both wait for ``Producer.regenerate``. Only a log
    that fails verification leaves a sample "unaccounted".
    """
    if sample_id in state.dead:
        return "dead"
    if sample_id in state.trained:
        return "trained"
    if sample_id in state.leased:
        return "leased"
    if sample_id in state.excluded:
        return "excluded"  # trained or leased before its exclusion: shown as such
    if sample_id in state.lost:
        return "lost"
    if sample_id in state.regenerate:
        return "regenerate"
    if state.is_pending(sample_id):
        return "pending"
    return "unaccounted"


def sample_row(state: RunState, sample_id: str) -> dict[str, Any]:
    """A committed sample as one flat row (what ``export`` writes per sample)."""
    return {
        "sample_id": sample_id,
        "state": sample_state(state, sample_id),
        "revision": state.revision(sample_id),
        "attempts": state.attempts.get(sample_id, 0),
        "trained_step": state.trained.get(sample_id),
        "leased_by": state.leased.get(sample_id),
        "released": sample_id in state.released,
        "reason": state.dead.get(sample_id) or state.lost.get(sample_id),
        "excluded": state.excluded.get(sample_id),
    }


def sample_rows(state: RunState) -> Iterator[dict[str, Any]]:
    """Every committed sample of ``state`` as :func:`sample_row`, in commit order."""
    for sample_id in state.committed:
        yield sample_row(state, sample_id)


def sample_history(
    ledger: Ledger,
    run_id: str,
    sample_id: str,
    *,
    upto_seq: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every event of ``sample_id`` (across producers, ranks and epochs) and its state.

    A batch row (a lease, ack, nack or release of many samples) that names it is one of
    its events.

    The resumes after its first commit are listed too, each with what it did to the
    sample (requeued, stays trained, to regenerate ...). NotInRunError when no event
    of the run names it.
    """
    own: list[tuple[Any, ...]] = []
    resumes: list[tuple[Any, ...]] = []
    for n, row in enumerate(ledger.rows(run_id, upto_seq=upto_seq), 1):
        if row[2] == sample_id or (
            row[2] is None and (_batch_may_name(row, sample_id) or _names_in_batch(row, sample_id))
        ):
            own.append(row)
        elif row[1] == Kind.RESUME:
            resumes.append(row)
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(row[0])
    state = replay(ledger, run_id, upto_seq=upto_seq)
    if not own:
        examples = ", ".join(repr(s) for s, _ in zip(state.committed, range(3), strict=False))
        raise NotInRunError(
            f"no event of run {run_id!r} names sample {sample_id!r}"
            + (f" up to seq {upto_seq}" if upto_seq is not None else "")
            + f"; {len(state.committed)} samples are committed"
            + (f", e.g. {examples}" if examples else "")
            + " (check --sample)"
        )
    first = own[0][0]
    rows = sorted(own + [r for r in resumes if r[0] > first], key=lambda r: r[0])
    events = [_history_event(state, sample_id, row) for row in rows]
    current = sample_row(state, sample_id) if sample_id in state.committed else None
    return {"run_id": run_id, "sample_id": sample_id, "events": events, "current": current}


def _names_in_batch(row: tuple[Any, ...], sample_id: str) -> bool:
    """Whether ``row`` is an EXCLUDE or INCLUDE whose batch names ``sample_id``."""
    if row[1] not in (Kind.EXCLUDE, Kind.INCLUDE) or not isinstance(row[7], str):
        return False
    if f'"{sample_id}"' not in row[7]:  # most rows: no JSON to read
        return False
    try:
        samples = load_payload(row[7]).get("samples")
    except (ValueError, AttributeError):
        return False
    return isinstance(samples, list) and sample_id in samples


def _batch_may_name(row: tuple[Any, ...], sample_id: str) -> bool:
    """Whether a row without a sample id is a batch row naming ``sample_id``, or one whose
    payload cannot be read (shown in every sample's history, as ``--verify`` lists it)."""
    kind, payload = row[1], row[7]
    if kind not in Kind.BATCHED:
        return False
    if isinstance(payload, str) and f'"{sample_id}"' in payload:  # as a batch names an id
        return sample_id in row_samples(kind, None, payload)
    try:
        read_payload(kind, payload)
    except (ValueError, TypeError):
        return True
    return False


def _history_event(state: RunState, sample_id: str, row: tuple[Any, ...]) -> dict[str, Any]:
    seq, kind, sid, revision, epoch, step, actor, payload, ts = row
    try:  # a damaged or hand-written row is shown, as --verify lists it
        p = load_payload(payload)
        why = None if isinstance(p, dict) else "not a JSON object"
    except ValueError as exc:
        p, why = {}, str(exc)[:200]
    if why is not None:
        detail = f"unreadable payload ({why}; see --verify)"
    elif kind == Kind.COMMIT:
        detail = f"revision {revision or 0} in {p.get('store')} (generation {p.get('generation')})"
    elif kind == Kind.NACK:
        detail = f"retryable={p.get('retryable', True)}: {p.get('reason') or 'nacked'}"
    elif kind == Kind.LOST:
        detail = f"revision {p.get('revision', 0)}: {p.get('reason') or 'lost'}"
    elif kind == Kind.RELEASE:
        freed = row_revisions(kind, sid, payload).get(sample_id, p.get("revision", 0))
        detail = f"revision {freed}"
    elif kind == Kind.ACK:
        # A row of several steps names this sample's own among its ``steps``.
        own = dict(
            zip(row_samples(kind, sid, payload), row_steps(kind, sid, step, payload), strict=False)
        )
        step = own.get(sample_id, step)
        detail = f"trained into step {step}"
    elif kind == Kind.RESUME:
        detail = _resume_effect(state, sample_id, epoch)
    elif kind in (Kind.EXCLUDE, Kind.INCLUDE):
        detail = f"{kind}d: {p.get('reason')}"
    else:
        detail = ""
    return {
        "seq": seq,
        "time": iso_time(ts),
        "ts": ts,
        "kind": kind,
        "epoch": epoch,
        "step": step,
        "actor": actor,
        "revision": revision,
        "detail": detail,
    }


def _resume_effect(state: RunState, sample_id: str, epoch: int) -> str:
    plan = state.plans.get(epoch)
    if plan is None:
        return "refused by the fold (see --verify)"
    where = (
        f"from the checkpoint at step {plan.checkpoint_step}"
        if plan.checkpoint is not None
        else "from scratch"
    )
    if sample_id in plan.regenerate:
        return f"resume {where}: to regenerate (its features are gone)"
    if sample_id in plan.requeued:
        return f"resume {where}: requeued"
    if sample_id in plan.trained:
        freed = ", features released" if sample_id in plan.released else ""
        return f"resume {where}: stays trained{freed}"
    return f"resume {where}: left as it was (dead)"


# -- time travel --------------------------------------------------------------------
