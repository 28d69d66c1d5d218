"""Events: what the ledger records, one row each, and the declared type of each kind's payload.

A payload is checked against its kind's type when written (:func:`check_payload`, from
``NewEvent``) and decoded as that type when folded (:func:`read_payload`); ``Event.payload``
(what ``Ledger.events`` gives) stays the plain JSON object.

A LEASE, ACK, NACK or RELEASE row names either one sample (its ``sample_id``; every such
row before schema 4) or a batch of samples (``sample_id`` NULL, the payload's ``samples``;
what writers write from schema 4 on, see :data:`BATCH_KINDS`). A batch row means exactly
what its samples' single rows would, in the order named; :func:`row_samples` lists the
samples a row names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from dataflow.model._errors import InvalidArgumentError


class Kind:
    """The kinds of event a run's log holds."""

    COMMIT = "commit"  # a producer committed a ref (payload: the ref)
    CLOSE = "close"  # a producer finished
    RESUME = "resume"  # a new consumer epoch starts, from a checkpoint or from scratch
    LEASE = "lease"  # a consumer took a sample
    ACK = "ack"  # the sample was trained into optimizer step `step`
    NACK = "nack"  # the sample was given back (payload: retryable, reason, rank if > 1 rank)
    CHECKPOINT = "checkpoint"  # a durable checkpoint at `step` (payload: path, digest)
    RELEASE = "release"  # the sample's features were freed from the store
    DATA_EPOCH = "data_epoch"  # every live sample is pending again (payload: seed)
    #: A checkpoint's files were deleted (payload: checkpoint_seq, reason); it cannot be resumed.
    CHECKPOINT_REMOVED = "ckpt_removed"
    #: A leased sample's features were found missing or corrupt (payload: revision, reason):
    #: not a training failure; the sample must be regenerated.
    LOST = "lost"
    #: A producer process took its producer id (epoch: the producer's epoch; payload:
    #: host, pid, store): its predecessor with that id is fenced, and a closed producer
    #: is open again. Commits and closes carry the producer's epoch in their epoch.
    CLAIM = "claim"
    #: Samples taken out of the run, with a reason (payload: samples, reason): never leased
    #: again, whatever checkpoint a later resume starts from. Not a lineage event: an
    #: exclusion is a decision about the data, which a rewind does not undo. Written with
    #: the run's current consumer epoch (the fold checks it, as for FENCED kinds, but an
    #: exclusion before the first resume, at epoch 0, holds too).
    EXCLUDE = "exclude"
    #: Excluded samples put back into the run (payload: samples, reason): only an INCLUDE
    #: undoes an EXCLUDE.
    INCLUDE = "include"

    ALL = frozenset(
        {COMMIT, CLOSE, RESUME, LEASE, ACK, NACK, CHECKPOINT, RELEASE, DATA_EPOCH}
        | {CHECKPOINT_REMOVED, LOST, CLAIM}
        | {EXCLUDE, INCLUDE}
    )
    #: Kinds written by consumers, and so fenced by their (the run's consumer) epoch.
    #: COMMIT and CLOSE are fenced by their producer's epoch instead (see CLAIM).
    FENCED = frozenset(
        {LEASE, ACK, NACK, CHECKPOINT, RELEASE, DATA_EPOCH, CHECKPOINT_REMOVED, LOST}
    )
    #: Kinds whose row may name a batch of samples (see :data:`BATCH_KINDS`).
    BATCHED = frozenset({LEASE, ACK, NACK, RELEASE})


#: Kinds whose row names either one sample (``sample_id``) or a batch (payload ``samples``).
BATCH_KINDS = Kind.BATCHED
#: The most samples one batch row names; writers split a larger batch into rows of this many.
MAX_BATCH_SAMPLES = 4096


@dataclass(frozen=True)
class Event:
    """One entry of a run's log, as read back from the ledger."""

    seq: int
    run_id: str
    kind: str
    sample_id: str | None
    epoch: int
    step: int | None
    actor: str
    payload: dict[str, Any] = field(default_factory=dict)
    ts: float = 0.0
    revision: int | None = None

    @property
    def sample_ids(self) -> list[str]:
        """The samples this event names: its ``sample_id``, or a batch row's ``samples``
        ([] for an event of no sample)."""
        if self.sample_id is not None:
            return [self.sample_id]
        batch = self.kind in Kind.BATCHED or self.kind in (Kind.EXCLUDE, Kind.INCLUDE)
        samples = self.payload.get("samples") if batch else None
        return list(samples) if isinstance(samples, list) else []

    @property
    def sample_steps(self) -> list[int | None]:
        """The step of each of :attr:`sample_ids`: a multi-step ACK row's ``steps``, else
        the event's ``step`` for each."""
        ids = self.sample_ids
        steps = self.payload.get("steps") if self.kind == Kind.ACK else None
        if isinstance(steps, list) and len(steps) == len(ids):
            return list(steps)
        return [self.step] * len(ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "run_id": self.run_id,
            "kind": self.kind,
            "sample_id": self.sample_id,
            "revision": self.revision,
            "epoch": self.epoch,
            "step": self.step,
            "actor": self.actor,
            "payload": self.payload,
            "ts": self.ts,
        }


def dump_payload(payload: dict[str, Any] | None) -> str | None:
    if not payload:
        return None
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


#: A payload longer than this (in characters) is not read: no event the library writes
#: comes near it (a ref's metadata, a checkpoint path, a 1000-character reason).
MAX_PAYLOAD_CHARS = 1 << 24
#: Nesting a payload may have: a ref's metadata is capped at 32 levels when committed.
MAX_PAYLOAD_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def load_payload(text: str | None) -> dict[str, Any]:
    """The JSON of an event's payload; ValueError (never RecursionError) for one too long
    or nested too deep to be the library's, as a hand-written row may be."""
    if not text:
        return {}
    _check_bounds(text)
    return json.loads(text)


def _check_bounds(text: str) -> None:
    """ValueError for a payload too long or nested too deep to be the library's."""
    if len(text) > MAX_PAYLOAD_CHARS:
        raise ValueError(
            f"payload of {len(text)} characters, over the {MAX_PAYLOAD_CHARS} a payload may have"
        )
    # The depth scan only where it could matter: the payloads of a run are short and flat,
    # and this is the fold's hot path.
    if len(text) > 2 * MAX_PAYLOAD_DEPTH and text.count("[") + text.count("{") > MAX_PAYLOAD_DEPTH:
        _check_depth(text)


def _check_depth(text: str) -> None:
    depth = 0
    for char in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        if char in "[{":
            depth += 1
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValueError(f"payload nested deeper than {MAX_PAYLOAD_DEPTH} levels")
        elif char in "]}":
            depth -= 1


# -- payloads: one declared type per kind ---------------------------------------------------
# Strict (no int for a bool, no str for an int); `forbid_unknown_fields` where no writer
# adds other fields. A RESUME allows unknown fields: a resume's payload is its settings,
# and a newer writer may add one that an older reader must be able to skip.
_Count = Annotated[int, Meta(ge=1)]
_NonNegative = Annotated[int, Meta(ge=0)]
#: The samples of a batch row: 1 to MAX_BATCH_SAMPLES ids of 1 to 256 characters. Their
#: characters are not matched here (a pattern costs the fold a regex per sample): the ids
#: are the committed ones (``validate_sample_id``), and one the run never committed is a
#: violation of the fold like any unknown id.
_Samples = Annotated[
    list[Annotated[str, Meta(min_length=1, max_length=256)]],
    Meta(min_length=1, max_length=MAX_BATCH_SAMPLES),
]
#: The steps of a multi-step ACK row: one optimizer step (>= 1) per sample it names.
_Steps = Annotated[list[_Count], Meta(min_length=1, max_length=MAX_BATCH_SAMPLES)]


class _Payload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The base of every payload type: strict, and closed to fields no writer adds."""


class FeatureSpecPayload(_Payload):
    """A feature's spec inside a commit's ref: its shape and its torch dtype's name."""

    shape: list[_NonNegative]
    dtype: str


class CommitPayload(_Payload):
    """COMMIT: the committed ref, as ``SampleRef.to_json`` writes it."""

    sample_id: str
    store: Annotated[str, Meta(min_length=1)]
    generation: _NonNegative
    specs: dict[str, FeatureSpecPayload]
    metadata: dict[str, Any]


class ClosePayload(_Payload):
    """CLOSE: ``streamed`` is False when the producer streamed no refs (no payload: it did)."""

    streamed: bool = True


class ResumePayload(msgspec.Struct, frozen=True):
    """RESUME: the checkpoint resumed from (None: from scratch) and the new epoch's settings."""

    checkpoint_seq: int | None = None
    checkpoint_step: int | None = None
    world_size: _Count = 1
    release_policy: Literal["on_checkpoint", "on_ack", "never"] = "on_checkpoint"
    max_attempts: _Count = 3
    order_seed: int | None = None


class LeasePayload(_Payload):
    """LEASE: a batch row's ``samples``, leased in that order by the row's actor; a row of one
    sample (its sample id set) has no payload."""

    samples: _Samples | UnsetType = UNSET


class AckPayload(_Payload):
    """ACK: a batch row's ``samples``, trained into the row's step (the optimizer step); a row
    of one sample has no payload. A batch row of several steps names, in the same order,
    each sample's ``steps`` (the row's step column is then the highest of them)."""

    samples: _Samples | UnsetType = UNSET
    steps: _Steps | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.steps is UNSET:
            return
        if self.samples is UNSET:
            raise ValueError("an ack's `steps` go with its `samples`")
        if len(self.samples) != len(self.steps):
            raise ValueError(
                f"a batch ack names {len(self.samples)} samples but {len(self.steps)} steps"
            )


class NackPayload(_Payload):
    """NACK: whether to retry, why, and the nacking rank when the world has more than one;
    a batch row's ``samples`` all take these."""

    retryable: bool = True
    reason: str | None = None
    rank: int | None = None
    samples: _Samples | UnsetType = UNSET


class CheckpointPayload(_Payload):
    """CHECKPOINT: where the checkpoint is, and the sha256 of its manifest if recorded."""

    path: str = ""
    digest: str | None = None


class ReleasePayload(_Payload):
    """RELEASE: the revision whose features were freed; a batch row names its ``samples`` and,
    in the same order, their ``revisions`` (``revision`` unused)."""

    revision: int = 0
    samples: _Samples | UnsetType = UNSET
    revisions: list[int] | UnsetType = UNSET

    def __post_init__(self) -> None:
        if (self.samples is UNSET) != (self.revisions is UNSET):
            raise ValueError("a batch release names both its `samples` and their `revisions`")
        if self.samples is not UNSET and len(self.samples) != len(self.revisions):
            raise ValueError(
                f"a batch release names {len(self.samples)} samples but "
                f"{len(self.revisions)} revisions"
            )


class DataEpochPayload(_Payload):
    """DATA_EPOCH: the new data epoch's number (absent: the next) and its order's seed
    (absent: the number; null: commit order)."""

    #: Any JSON value here; the fold refuses one that is no int from 0 to 2**63-1, with the
    #: message it has always given. Not refused on write: hand-written rows holding such a
    #: number (tests/test_ledger_tampered.py) go through NewEvent, and the fold reports them.
    data_epoch: Any = UNSET
    seed: int | UnsetType | None = UNSET


class CheckpointRemovedPayload(_Payload):
    """CHECKPOINT_REMOVED: the removed checkpoint's seq and step, and why."""

    checkpoint_seq: int | None = None
    step: int | None = None
    reason: str | None = None


class LostPayload(_Payload):
    """LOST: the revision whose features were found missing or corrupt, and why."""

    revision: int = 0
    reason: str | None = None


class ClaimPayload(_Payload):
    """CLAIM: who claimed the producer id (host, pid) and the store it writes to."""

    host: str | None = None
    pid: int | None = None
    store: str | None = None


#: Most characters of an exclusion's reason (a line or two for the operator, not a file).
MAX_REASON_CHARS = 1000
#: Most sample ids one EXCLUDE or INCLUDE row names; a larger batch takes several rows.
MAX_EXCLUDE_BATCH = 10_000
_SampleIdText = Annotated[str, Meta(min_length=1, max_length=256)]


class ExcludePayload(_Payload):
    """EXCLUDE and INCLUDE: the samples (one row names a batch of them) and why."""

    samples: Annotated[list[_SampleIdText], Meta(min_length=1, max_length=MAX_EXCLUDE_BATCH)]
    reason: Annotated[str, Meta(min_length=1, max_length=MAX_REASON_CHARS)]


#: The payload type of each kind.
PAYLOAD_TYPES: dict[str, type[msgspec.Struct]] = {
    Kind.COMMIT: CommitPayload,
    Kind.CLOSE: ClosePayload,
    Kind.RESUME: ResumePayload,
    Kind.LEASE: LeasePayload,
    Kind.ACK: AckPayload,
    Kind.NACK: NackPayload,
    Kind.CHECKPOINT: CheckpointPayload,
    Kind.RELEASE: ReleasePayload,
    Kind.DATA_EPOCH: DataEpochPayload,
    Kind.CHECKPOINT_REMOVED: CheckpointRemovedPayload,
    Kind.LOST: LostPayload,
    Kind.CLAIM: ClaimPayload,
    Kind.EXCLUDE: ExcludePayload,
    Kind.INCLUDE: ExcludePayload,
}
#: Kinds (besides COMMIT) whose rows must carry a payload: it names their samples (the
#: fold reports one without as a violation; every writer gives one).
_REQUIRED = frozenset({Kind.EXCLUDE, Kind.INCLUDE})
_DECODERS = {kind: msgspec.json.Decoder(t) for kind, t in PAYLOAD_TYPES.items()}
#: What a kind's payload is when its row has none.
_EMPTY = {kind: t() for kind, t in PAYLOAD_TYPES.items() if kind not in (Kind.COMMIT, *_REQUIRED)}


def read_payload(kind: str, text: str | None) -> Any:
    """The payload of a ``kind`` event read back from the ledger, as its declared type.

    ValueError, naming the field, for one that is not its kind's (a forged or damaged
    row), and (as :func:`load_payload`) for one too long or nested too deep.
    """
    if not text:
        if kind in _REQUIRED:
            raise ValueError(f"a {kind} event needs a payload naming its samples")
        return _EMPTY[kind]
    _check_bounds(text)
    try:
        return _DECODERS[kind].decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(_why(exc)) from None


def check_payload(kind: str, text: str | None) -> None:
    """Refuse a payload that is not ``kind``'s type, as it is about to be written.

    InvalidArgumentError naming the kind and the field. A kind the model does not
    know passes (the fold reports it as a violation).
    """
    if text is None and kind != Kind.COMMIT:
        return  # most events (leases, acks): the fold's defaults stand for no payload
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return
    if not isinstance(text, str) or not text:
        got = type(text).__name__
        raise InvalidArgumentError(f"a {kind} event's payload must be a JSON str, got {got}")
    try:
        _check_bounds(text)
        decoder.decode(text)
    except ValueError as exc:
        why = _why(exc) if isinstance(exc, msgspec.DecodeError) else str(exc)
        raise InvalidArgumentError(f"a {kind} event's payload: {why}") from None


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>.*)`)?$", re.DOTALL)
_EXPECTED = re.compile(r"^Expected `(?P<type>[^`]+)`(?:, got `(?P<got>[^`]+)`)?(?P<rest>.*)$")


def _why(exc: msgspec.DecodeError) -> str:
    """msgspec's message, in the words of our errors: which field, and what it must be."""
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches every string
    what, path = match["what"], (match["path"] or "").lstrip(".")
    if not isinstance(exc, msgspec.ValidationError):
        return f"not JSON ({what})"
    what = what.replace("Object contains unknown", "unknown").replace(
        "Object missing required", "missing"
    )
    expected = _EXPECTED.match(what)
    if expected is not None:
        article = "an" if expected["type"][0] in "aeiou" else "a"
        what = f"must be {article} {expected['type']}{expected['rest']}"
        if expected["got"]:
            what += f", got {expected['got']}"
    return f"field `{path}` {what}" if path else what


# -- batch rows ------------------------------------------------------------------------------
def batch_payloads(kind: str, sample_ids: list[str], **fields: Any) -> list[str]:
    """The payloads of the batch rows of ``kind`` naming ``sample_ids`` in order: one per
    MAX_BATCH_SAMPLES of them, each with ``fields`` (a NACK's ``retryable`` ...).

    A RELEASE takes ``revisions`` (one per sample, in the same order) among ``fields``.
    """
    revisions = fields.pop("revisions", None)
    payloads = []
    for start in range(0, len(sample_ids), MAX_BATCH_SAMPLES):
        end = start + MAX_BATCH_SAMPLES
        body = {**fields, "samples": sample_ids[start:end]}
        if revisions is not None:
            body["revisions"] = revisions[start:end]
        payloads.append(json.dumps(body, separators=(",", ":"), sort_keys=True))
    return payloads


def ack_payloads(sample_ids: list[str], steps: list[int]) -> list[tuple[str, int]]:
    """The ACK batch rows of ``sample_ids`` trained into ``steps`` (one per sample, in the
    same order): ``(payload, step column)`` per MAX_BATCH_SAMPLES of them. A row whose
    samples share one step names no ``steps``; one of several names them, and its step
    column is the highest."""
    rows = []
    for start in range(0, len(sample_ids), MAX_BATCH_SAMPLES):
        end = start + MAX_BATCH_SAMPLES
        body: dict[str, Any] = {"samples": sample_ids[start:end]}
        chunk = steps[start:end]
        if len(set(chunk)) > 1:
            body["steps"] = chunk
        rows.append((json.dumps(body, separators=(",", ":"), sort_keys=True), max(chunk)))
    return rows


def row_steps(kind: str, sample_id: str | None, step: Any, payload: str | None) -> list[Any]:
    """The step of each sample a row names (:func:`row_samples`, same order): an ACK row's
    ``steps`` when it has them, else its step column for each."""
    samples = row_samples(kind, sample_id, payload)
    if kind != Kind.ACK or sample_id is not None or not isinstance(payload, str):
        return [step] * len(samples)
    try:
        steps = read_payload(kind, payload).steps
    except ValueError:
        return [step] * len(samples)
    return [step] * len(samples) if steps is UNSET else list(steps)


def row_samples(kind: str, sample_id: str | None, payload: str | None) -> list[str]:
    """The samples a row names, in order: its ``sample_id``, or a batch row's ``samples``.

    [] for a row of another kind without a sample id, and for a batch row whose payload
    cannot be read (the fold reports that one as a violation).
    """
    if sample_id is not None:
        return [sample_id]
    if kind not in BATCH_KINDS or not isinstance(payload, str):
        return []
    try:
        samples = read_payload(kind, payload).samples
    except ValueError:
        return []
    return [] if samples is UNSET else samples


def row_revisions(kind: str, sample_id: str | None, payload: str | None) -> dict[str, int]:
    """The revision each sample of a RELEASE (or LOST) row names: ``{sample_id: revision}``."""
    try:
        p = read_payload(kind, payload if isinstance(payload, str) else None)
    except ValueError:
        return {}
    if sample_id is not None:
        return {sample_id: getattr(p, "revision", 0)}
    samples, revisions = getattr(p, "samples", UNSET), getattr(p, "revisions", UNSET)
    if samples is UNSET or revisions is UNSET:
        return {}
    return dict(zip(samples, revisions, strict=True))


def expand_row(row: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """A raw row ``(seq, kind, sample_id, revision, epoch, step, actor, payload, ts)`` as the
    rows of one sample it stands for, in order (the shape written before schema 4: the
    sample id set, a nack's fields or a release's ``revision`` as payload, the same seq).

    A row of one sample, of another kind, or whose payload cannot be read, is returned as is.
    """
    seq, kind, sample_id, revision, epoch, step, actor, payload, ts = row
    if sample_id is not None or kind not in BATCH_KINDS or not isinstance(payload, str):
        return [row]
    try:
        read_payload(kind, payload)
        fields = json.loads(payload)
    except ValueError:
        return [row]
    samples = fields.pop("samples", None)
    if not isinstance(samples, list):
        return [row]
    steps = fields.pop("steps", None) if kind == Kind.ACK else None
    if kind == Kind.RELEASE:
        payloads = [dump_payload({"revision": r}) for r in fields["revisions"]]
    else:
        payloads = [dump_payload(fields)] * len(samples)
    return [
        (seq, kind, sid, revision, epoch, own, actor, one, ts)
        for sid, one, own in zip(samples, payloads, steps or [step] * len(samples), strict=True)
    ]
