"""The ``dataflow`` command run as a real subprocess, as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def run_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> subprocess.CompletedProcess[str]:
    """``python -m dataflow.cli ARGS``, its output captured. Without ``env``, the test's
    environment less ``DATAFLOW_LEDGER``, so that only the arguments name a ledger.
    ``runner``: what starts it (``subprocess.run``; ``tests._zygote.run`` forks it warm)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "DATAFLOW_LEDGER"}
    return runner(
        [sys.executable, "-m", "dataflow.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], expected: str) -> None:
    """A refused command line: exit 2, nothing on stdout, one stderr line saying ``expected``."""
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
