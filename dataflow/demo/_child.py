"""What the demo's child processes share: the run's config (one JSON file, never pickle),
their logs, and their entry point."""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Write ``config`` readable by this user only: a ledger URL may hold a password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(config, file, indent=2)


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def log_to(path: str | os.PathLike[str]) -> None:
    """In a child process: stdout, stderr and logging (INFO) go to the file at ``path``."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr, force=True
    )


def run_child(role: str, config_path: str, log_path: str, *args: object) -> None:
    """A child process's entry point: ``dataflow.demo._{role}.main(config, *args)``, its
    output going to ``log_path``. (Named by a string, so that the demo's own process never
    imports the roles' modules, nor torch with them.)"""
    log_to(log_path)
    config = load_config(config_path)
    _end_with(config["demo_pid"])
    module = importlib.import_module(f"dataflow.demo._{role}")
    module.main(config, *args)


def _end_with(pid: int) -> None:
    """Kill this process once the demo's own process (``pid``) is gone, however it ended:
    no producer or rank outlives the demo, even one that was SIGKILLed itself."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGKILL)
            except PermissionError:  # alive (as another user: pid reuse); keep watching
                pass

    threading.Thread(target=watch, name="demo-watch", daemon=True).start()


def kill_self(marker: str | os.PathLike[str]) -> None:
    """A planned crash at a chosen point: note the moment in ``marker`` (for the conductor,
    which did not send this kill itself), then SIGKILL this process, as a crash would."""
    Path(marker).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
