"""Mooncake's own log: quiet unless asked for, and held back while its client sets up."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

#: Set to 1 to see Mooncake's own log (its INFO lines on stderr), quiet by default.
LOG_ENV = "DATAFLOW_MOONCAKE_LOG"
# Mooncake's log level; its client reads it when it starts (values TRACE, INFO, WARNING, ERROR).
_LEVEL_ENV = "MC_LOG_LEVEL"
_OURS_ENV = "DATAFLOW_SET_MC_LOG_LEVEL"  # marks an MC_LOG_LEVEL that dataflow set
# A glog line ("E1126 23:43:37.598625  6534 file.cpp:292] ...") or glog's own notice.
_GLOG_LINE = re.compile(
    rb"([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] |WARNING: Logging before )"
)


def _log_wanted() -> bool:
    """Whether Mooncake's own log shows: asked for (``DATAFLOW_MOONCAKE_LOG=1``), or its
    level set by hand (``MC_LOG_LEVEL``); otherwise only its errors, and none at setup.

    The level this sets is inherited by child processes, marked as ours, so that a
    child asked for the log (or not) is treated as if its parent had set nothing."""
    env = os.environ
    ours = env.pop(_OURS_ENV, None) is not None
    if ours:
        env.pop(_LEVEL_ENV, None)
    if env.get(LOG_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    if _LEVEL_ENV in env:
        return True
    env[_LEVEL_ENV], env[_OURS_ENV] = "ERROR", "1"
    return False


@contextlib.contextmanager
def _setup_log(quiet: bool) -> Iterator[list[bytes]]:
    """While ``quiet``, what the process writes to stderr (fd 2) meanwhile is held back: the
    Mooncake lines are kept in the list yielded (for an error message), the rest written
    out after. Its setup logs an ERROR that is none ("http=404 body: metadata not found":
    its own segment, looked up before it registers it) and that MC_LOG_LEVEL keeps."""
    lines: list[bytes] = []
    if not quiet:
        yield lines
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lines
        finally:
            with contextlib.suppress(ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().splitlines(keepends=True):
                if _GLOG_LINE.match(line):
                    lines.append(line.rstrip())
                else:
                    os.write(2, line)
