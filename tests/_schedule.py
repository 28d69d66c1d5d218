"""How the suite shares a few cores between pytest-xdist workers (``-n``).

Three rules, all inert in a plain ``pytest`` run without ``-n``:

- A module whose tests share a module-scoped fixture (a server, a network namespace,
  processes) runs on one worker (``GROUPED_MODULES``, by the scheduler of
  :func:`make_scheduler`), so the fixture is set up once, not once per worker that runs
  one of its tests. (xdist's own ``--dist loadgroup`` does nothing under pytest 9: it
  renames ``item._nodeid``, which pytest 9 no longer reads.)
- A test marked ``alone`` (a wall-clock bound, a heartbeat timeout) runs while no other
  test of the run does: workers take a shared lock around each test, an ``alone`` test
  an exclusive one (a turnstile first, so that the exclusive lock is not starved).
- The long tests are handed out first (``LONG_MODULES``, then the ``slow`` marker), so
  that no worker starts a long test while the others are running out of work; the
  ``alone`` tests last, when no long test is left to wait for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The modules whose tests take longest in all (from ``--durations=0`` of the idle full run
# of 2026-11-27, 14:12: the module's total in seconds), longest first.
LONG_MODULES = (
    "test_chaos_hosts.py",  # 99
    "test_hosts_ledger_ranks.py",  # 74
    "test_hosts_ledger_producers.py",  # 59
    "test_hosts_mooncake.py",  # 49
    "test_hosts_latency.py",  # 44, one test
    "test_example_eagle3.py",  # 34, one test of 32
    "test_property_ledger.py",  # 34
    "test_chaos.py",  # 34
    "test_deploy.py",  # 33, one test
    "test_faults_postgres_network.py",  # 33
    "test_doctor.py",  # 33
    "test_docs.py",  # 28
    "test_mooncake_restart.py",  # 27
    "test_hosts_gloo.py",  # 26
    "test_benchmarks_rows.py",  # 22
    "test_training_resume_ranks.py",  # 22
    "test_metrics.py",  # 20
    "test_streams_processes.py",  # 19
    "test_mooncake_crash_gc.py",  # 19
    "test_benchmarks_producer.py",  # 17
    "test_benchmarks_runner.py",  # 17
    "test_forget_finished.py",  # 17
    "test_store_shared_dir_links.py",  # 16-19 (serial, loaded)
    "test_cluster.py",  # 15
    "test_store_mooncake.py",  # 15
    "test_training_stream_blip.py",  # 15
    "test_demo.py",  # 15
    "test_consumer_producers.py",  # 14
    "test_training_full_batches.py",  # 13
    "test_hosts_stream.py",  # 12
    "test_seeded_stream_processes.py",  # 10
    "test_training_resize.py",  # 10
    "test_training_step.py",  # 9
    "test_mooncake_keeper.py",  # 9
    "test_ledger_rank_restart.py",
    "test_training_e2e.py",
    "test_diff.py",
    "test_gc.py",
    "test_training_agreement.py",
    "test_store_shared_dir.py",
    "test_cli.py",
    "test_ledger_lineage.py",
    "test_training_checkpoint_ranks.py",  # 6 s since its ranks fork (72 s spawned)
    "test_clocks.py",
)


# The modules whose tests mostly wait (on cut links, timeouts, leases, restarts) and take
# little CPU: at most half the workers run them at a time (see make_scheduler), so that
# the others keep both cores busy with the tests that compute.
WAITING_MODULES = frozenset(
    {
        "test_chaos_hosts.py",
        "test_hosts_ledger_ranks.py",
        "test_hosts_ledger_producers.py",
        "test_hosts_mooncake.py",
        "test_hosts_latency.py",
        "test_hosts_gloo.py",
        "test_hosts_stream.py",
        "test_faults_postgres_network.py",
        "test_mooncake_restart.py",
        "test_mooncake_crash_gc.py",
        "test_training_stream_blip.py",
        "test_cluster.py",
    }
)

# The modules that define a module- or session-scoped fixture their tests share
# (checked at collection: :func:`arrange` names one missing here).
GROUPED_MODULES = frozenset(
    {
        "test_cli_inspect.py",
        "test_cli_subprocess.py",
        "test_clocks.py",
        "test_cluster.py",
        "test_diff.py",
        "test_doctor.py",
        "test_eval_distributed.py",
        "test_faults_postgres_network.py",
        "test_hosts_gloo.py",
        "test_hosts_latency.py",
        "test_hosts_ledger_producers.py",
        "test_hosts_ledger_ranks.py",
        "test_hosts_mooncake.py",
        "test_hosts_stream.py",
        "test_ledger_concurrency.py",
        "test_ledger_pg_concurrent.py",
        "test_mooncake_keeper.py",
        "test_store_mooncake.py",
        "test_training_master_weights.py",
        "test_training_resize.py",
        "test_training_resume_ranks.py",
    }
)

# Left out of the quick tier besides the slow and long ones: state machines, a
# process per sample, sub-second bounds that make the other workers wait.
QUICK_LEAVES_OUT = frozenset(
    {
        "test_property_stores.py",
        "test_forget_finished.py",
        "test_mooncake_keeper.py",
        "test_mooncake_crash_gc.py",
        "test_shared_dir_crash_gc.py",
        "test_faults_wal_deleted.py",
        "test_cli_crash_time.py",
    }
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


def _long_rank(item: pytest.Item) -> tuple[bool, int]:
    """Long tests first; ``alone`` tests last, once the long ones are done (an ``alone``
    test waits for every running test to end, and keeps new ones out meanwhile: early on,
    the other workers would sit idle until a long test ended)."""
    alone = item.get_closest_marker("alone") is not None
    name = item.path.name
    if name in LONG_MODULES:
        return alone, LONG_MODULES.index(name)
    return alone, len(LONG_MODULES) + (0 if item.get_closest_marker("slow") else 1)


def arrange(items: list[pytest.Item]) -> None:
    """Check ``GROUPED_MODULES``; under xdist, hand out the long tests first."""
    ungrouped = sorted({i.path.name for i in items if _uses_module_fixture(i)} - GROUPED_MODULES)
    if ungrouped:
        raise pytest.UsageError(
            f"{', '.join(ungrouped)}: a module-scoped fixture; add it to "
            "GROUPED_MODULES in tests/_schedule.py (its tests then share one xdist worker)"
        )
    missing = sorted(
        name
        for name in (*LONG_MODULES, *WAITING_MODULES, *GROUPED_MODULES, *QUICK_LEAVES_OUT)
        if not (Path(__file__).parent / name).exists()
    )
    if missing:
        raise pytest.UsageError(f"tests/_schedule.py names no such module: {', '.join(missing)}")
    if worker() is None:
        return  # one process: keep the files' order, so module fixtures are set up once
    items.sort(key=_long_rank)  # stable: each module keeps its order


def _waits(scope: str) -> bool:
    """Whether a unit of work (a module or a test id) is of ``WAITING_MODULES``."""
    return scope.split("::", 1)[0].rsplit("/", 1)[-1] in WAITING_MODULES


def make_scheduler(config: pytest.Config, log: object) -> object | None:
    """xdist's load scheduling, with each of ``GROUPED_MODULES`` one unit of work, and at
    most half the workers (rounded up) on ``WAITING_MODULES`` at a time: in queue order,
    a worker takes the first waiting unit while fewer others hold one, else the first
    other unit (either kind when the other is used up)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None  # another --dist the user asked for
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:  # an xdist_group, should xdist's own marking work again
                return nodeid.rsplit("@", 1)[-1]
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in GROUPED_MODULES else nodeid

        def _assign_work_unit(self, node: Any) -> None:
            waiting = sum(
                1
                for other, units in self.assigned_work.items()
                if other is not node
                and any(_waits(scope) and not all(done.values()) for scope, done in units.items())
            )
            wanted = waiting < (len(self.nodes) + 1) // 2
            scope = next((s for s in self.workqueue if _waits(s) == wanted), None)
            if scope is not None:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleGroups(config, log)


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
    """``--quick``: (kept, left out). Leaves out the ``slow`` and ``alone`` tests, the long
    modules and ``QUICK_LEAVES_OUT``; the ledger tests on PostgreSQL, the Mooncake store's
    tests and the subprocess tests (CLI, fencing) keep a real PostgreSQL server, a real
    ``mooncake_master`` and real processes."""
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        name = item.path.name
        long = item.get_closest_marker("slow") or item.get_closest_marker("alone")
        long = long or name in LONG_MODULES or name in QUICK_LEAVES_OUT
        (left_out if long else kept).append(item)
    return kept, left_out
