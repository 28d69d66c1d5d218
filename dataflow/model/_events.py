"""Events: what the ledger records, one row each."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


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

    ALL = frozenset(
        {COMMIT, CLOSE, RESUME, LEASE, ACK, NACK, CHECKPOINT, RELEASE, DATA_EPOCH}
        | {CHECKPOINT_REMOVED, LOST, CLAIM}
    )
    #: Kinds written by consumers, and so fenced by their (the run's consumer) epoch.
    #: COMMIT and CLOSE are fenced by their producer's epoch instead (see CLAIM).
    FENCED = frozenset(
        {LEASE, ACK, NACK, CHECKPOINT, RELEASE, DATA_EPOCH, CHECKPOINT_REMOVED, LOST}
    )


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
    if len(text) > MAX_PAYLOAD_CHARS:
        raise ValueError(
            f"payload of {len(text)} characters, over the {MAX_PAYLOAD_CHARS} a payload may have"
        )
    # The depth scan only where it could matter: the payloads of a run are short and flat,
    # and this is the fold's hot path.
    if len(text) > 2 * MAX_PAYLOAD_DEPTH and text.count("[") + text.count("{") > MAX_PAYLOAD_DEPTH:
        _check_depth(text)
    return json.loads(text)


def _check_depth(text: str) -> None:
    depth = 0
    for char in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        if char in "[{":
            depth += 1
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValueError(f"payload nested deeper than {MAX_PAYLOAD_DEPTH} levels")
        elif char in "]}":
            depth -= 1
