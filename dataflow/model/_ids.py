"""Run, producer and consumer ids: what a valid one is."""

from __future__ import annotations

from dataflow.model._errors import InvalidIdError

MAX_ID_LENGTH = 256


def check_id(name: str, value: object) -> str:
    """Return ``value`` if it is a valid run, producer or consumer id, else raise InvalidIdError.

    A valid id is a str of 1 to 256 printable characters (``str.isprintable``:
    letters, digits, punctuation and spaces of any script) that does not
    start or end with whitespace. Control characters (NUL, tab, newline,
    DEL ...) and other invisible ones are refused.
    """
    if not isinstance(value, str):
        raise InvalidIdError(
            f"{name} must be a str of 1 to {MAX_ID_LENGTH} printable characters, "
            f"got {value!r} ({type(value).__name__})"
        )
    if not 0 < len(value) <= MAX_ID_LENGTH:
        shown = repr(value) if len(value) <= 40 else f"{len(value)} characters: {value[:40]!r}..."
        raise InvalidIdError(
            f"{name} must be a str of 1 to {MAX_ID_LENGTH} printable characters (at most "
            f"{MAX_ID_LENGTH}), got {shown}"
        )
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise InvalidIdError(
            f"{name} {value!r} holds the control or invisible character {bad!r} at position "
            f"{value.index(bad)}; ids are 1 to {MAX_ID_LENGTH} printable characters: "
            "remove or replace it"
        )
    if value != value.strip():
        raise InvalidIdError(
            f"{name} {value!r} starts or ends with whitespace; strip it (ids are compared "
            "exactly, and an outer space is invisible when printed)"
        )
    return value


def check_run_id(run_id: object) -> str:
    """``check_id`` for the argument ``run_id``."""
    return check_id("run_id", run_id)
