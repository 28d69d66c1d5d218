"""The error tree of the ``eval`` package.

::

    ValueError
     └── EvalError      every error raised by eval: bad counts, malformed batch
                        dicts, invalid EvalConfig fields, misuse of EvalCache

Messages name the offending value and say what to do about it.
"""


class EvalError(ValueError):
    """Root of the errors raised by the ``eval`` package."""


def short_repr(value: object) -> str:
    """``repr(value)`` for a message, cut to 60 characters.

    An int too long for ``repr`` (over 4300 digits by default) is described by its size.
    """
    try:
        text = repr(value)
    except ValueError:
        if not isinstance(value, int):
            raise
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."
