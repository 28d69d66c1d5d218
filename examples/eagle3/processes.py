"""The entry point of the job's child processes, and what they preload.

``run.py`` forks its producers and ranks from a server that imported this module once
(torch, ``transformers``, dataflow and the job's modules): each child starts in a fraction
of a second instead of importing them anew, and a restarted rank is back at once. Each is
still a process of its own, and a SIGKILL a real crash.
"""

from __future__ import annotations

import os
import sys
import time

import producer
import rank
import torch
import torch._dynamo  # noqa: F401  (DDP's constructor imports it: seconds)
import transformers.models.llama  # noqa: F401  (preloaded: the lazy import takes seconds)


def child(log: str, role: str, *args: object) -> None:
    """Run ``role`` ("producer" or "rank") with ``args``, its output into ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    print(f"{role} {args[1:]}: started at {time.time():.3f}", flush=True)
    if role == "producer":
        producer.main(*args)  # type: ignore[arg-type]
    else:
        rank.main(*args)  # type: ignore[arg-type]
