"""docs/deploy.md runs as written: PostgreSQL, a mooncake_master, a memory lender, two
streaming producers, two Trainer ranks SIGKILLed after a checkpoint and restarted, then
``replay --verify`` and ``gc``, all real processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stores.mooncake_master import find_master_binary, free_port

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "deploy.md"
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

pytestmark = [pytest.mark.postgres, pytest.mark.mooncake, pytest.mark.slow]


def walkthrough() -> str:
    """The page's bash blocks, in order, as one script."""
    return "\n".join(match.group(1) for match in _BLOCK.finditer(PAGE.read_text()))


def test_the_page_has_every_step() -> None:
    script = walkthrough()
    for command in (
        "mooncake_master",
        "mooncake-keeper",
        "producer.py",
        "trainer.py",
        "kill -KILL",
        "replay",
        "--verify",
        "gc --run",
    ):
        assert command in script, command


def _free_port_pair() -> int:
    """A port whose successor is free too (both bound once, then released)."""
    for _ in range(200):
        port = free_port()
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def test_the_deploy_walkthrough_runs_as_written(postgres_url, mooncake_installed, tmp_path):
    ports = {
        name: str(free_port())
        for name in ("MASTER_PORT", "RANK0_PORT", "RANK1_PORT", "MC_RPC", "MC_HTTP", "MC_ADMIN")
    }
    metrics = _free_port_pair()  # rank r serves its metrics on METRICS_PORT + r
    env = dict(
        os.environ,
        **ports,
        METRICS_PORT=str(metrics),
        WORK=str(tmp_path / "work"),
        DATAFLOW_LEDGER=postgres_url,
        RUN="walkthrough-test",
        SAMPLES="240",
        # The kill waits for the first checkpoint: at step 2 of 8, while the producers
        # (6 s of inference at 0.05 s a sample) are still at work, so the ranks cannot
        # have finished by then however fast this machine is.
        CHECKPOINT_EVERY="2",
        PRODUCE_DELAY="0.05",
        PYTHONPATH=str(ROOT),
        PATH=os.pathsep.join(
            [str(Path(sys.executable).parent), str(find_master_binary().parent), os.environ["PATH"]]
        ),
    )
    script = "set -euo pipefail\n" + walkthrough()
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "\n".join(
        f"--- {log.name}\n{log.read_text()[-3000:]}"
        for log in sorted((tmp_path / "work").glob("*.log"))
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
    out = result.stdout
    assert "verify: clean" in out
    assert "dataflow_events_total" in out  # the metrics scrape
    assert re.search(r"crash: .*epoch 1", out), out
    assert "rank 0: done" in (tmp_path / "work" / "rank0.log").read_text()
    assert "rank 1: done" in (tmp_path / "work" / "rank1.log").read_text()
