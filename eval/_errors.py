"""The error tree of the ``eval`` package.

::

    ValueError
     └── EvalError      every error raised by eval: bad counts, malformed batch
                        dicts, invalid EvalConfig fields, misuse of EvalCache

Messages name the offending value and say what to do about it.
"""


class EvalError(ValueError):
    """Root of the errors raised by the ``eval`` package."""
