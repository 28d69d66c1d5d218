"""Free text from a ledger or a store made safe to print on a terminal.

Reasons, paths, ids and payload strings come from whoever wrote the ledger (a
reason is often ``str(exc)`` of whatever failed on the data, and a hand-edited
row may hold anything): printed raw, a control character could retitle the
terminal, clear the screen, overwrite a line after ``\\r`` or reorder text with a
bidi override. ``--json`` output needs none of this: ``json.dumps`` escapes
every control and non-ASCII character.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each character ``str.isprintable`` refuses written as its escape,
    as ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``); unchanged when it has none.

    Refused: C0 and C1 controls (newline, carriage return, escape ...), DEL, bidi and
    other format characters (U+202E), line and paragraph separators, spaces other
    than ' ', unassigned code points.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
