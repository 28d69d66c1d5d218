"""How the suite shares a few cores between pytest-xdist workers (``-n``).

Three rules, all inert in a plain ``pytest`` run without ``-n``:

- A module whose tests share a module-scoped fixture (a server, a network namespace,
  processes) runs on one worker (``xdist_group``, with ``--dist loadgroup``), so the
  fixture is set up once, not once per worker that happens to run one of its tests.
- A test marked ``alone`` (a wall-clock bound, a heartbeat timeout) runs while no other
  test of the run does: workers take a shared lock around each test, an ``alone`` test
  an exclusive one (a turnstile first, so that the exclusive lock is not starved).
- The long tests are handed out first (``LONG_MODULES``, then the ``slow`` marker), so
  that no worker starts a long test while the others are running out of work.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The modules whose tests take longest in all (from ``--durations=0``), longest first.
LONG_MODULES = (
    "test_property_ledger.py",
    "test_training_checkpoint_ranks.py",
    "test_chaos.py",
    "test_docs.py",
    "test_training_resume_ranks.py",
    "test_ledger_rank_restart.py",
    "test_training_e2e.py",
    "test_benchmarks_runner.py",
    "test_deploy.py",
    "test_benchmarks_rows.py",
    "test_gc.py",
    "test_demo.py",
    "test_training_step.py",
    "test_training_agreement.py",
    "test_store_shared_dir.py",
    "test_mooncake_restart.py",
    "test_streams_processes.py",
    "test_cli.py",
    "test_metrics.py",
    "test_ledger_lineage.py",
)


def worker() -> str | None:
    """This process's xdist worker id (``gw0``...), or None outside a distributed run."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def worker_index() -> int:
    """This worker's number (0 outside a distributed run)."""
    name = worker()
    return int(name.removeprefix("gw")) if name and name.removeprefix("gw").isdigit() else 0


def _uses_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or session-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module_id = item.nodeid.split("::", 1)[0]
    return any(
        definition.scope in ("module", "session") and definition.baseid == module_id
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


def _long_rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in LONG_MODULES:
        return LONG_MODULES.index(name)
    return len(LONG_MODULES) + (0 if item.get_closest_marker("slow") else 1)


def arrange(items: list[pytest.Item]) -> None:
    """Group the modules with module-scoped fixtures; hand out the long tests first."""
    if worker() is None:
        return  # one process: keep the files' order, so module fixtures are set up once
    for item in items:
        if _uses_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=_long_rank)  # stable: each module keeps its order


@contextlib.contextmanager
def turn(root: Path, *, alone: bool) -> Iterator[None]:
    """Hold the run's lock around one test: shared, or exclusive for an ``alone`` test."""
    gate = os.open(root / "dataflow-tests.gate", os.O_RDWR | os.O_CREAT, 0o644)
    room = os.open(root / "dataflow-tests.room", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)  # an alone test waiting here keeps new ones out
        if alone:
            fcntl.flock(room, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)
        fcntl.flock(gate, fcntl.LOCK_UN)
        os.close(room)
        os.close(gate)


def quick_tier(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``--quick``: (kept, left out). Leaves out the ``slow`` tests and the long modules;
    the ledger tests on PostgreSQL, the Mooncake store's and the CLI's subprocess tests
    keep a real PostgreSQL server, a real ``mooncake_master`` and real processes."""
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        long = item.get_closest_marker("slow") or item.path.name in LONG_MODULES
        (left_out if long else kept).append(item)
    return kept, left_out
