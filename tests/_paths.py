"""Checkpoint directories for the ledger tests: checkpoint paths must exist when recorded."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Run in tmp_path, where ``ckpt`` makes the checkpoint directories (import it to use it)."""
    monkeypatch.chdir(tmp_path)


def ckpt(name: object) -> str:
    """The path of checkpoint directory ``ckpt/NAME``, made (checkpoint paths must exist)."""
    path = Path("ckpt", str(name)).absolute()
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
