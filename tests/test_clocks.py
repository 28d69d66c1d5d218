"""One host's clock hours off: its events still carry the database server's time.

A producer and a rank run under libfaketime (``faketime -f +5h``) against a real
PostgreSQL ledger. Their events' times are the server's (PostgreSQL stamps them in
the INSERT), so ``dataflow replay --at`` with a time of the server's clock picks the
events before it, and a rank's lease timeout, a duration on the monotonic clock,
waits what it says.

The producer runs as a host whose wall clock was set wrong: its monotonic clock
left true (``FAKETIME_DONT_FAKE_MONOTONIC=1``). The rank cannot: with that setting
libfaketime 0.9.10 turns the absolute ``clock_nanosleep`` on CLOCK_MONOTONIC that
Python's ``time.sleep`` makes into EINVAL. Its monotonic clock is shifted by the
same 5 h instead, a constant that leaves every duration true.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dataflow import Ledger, Producer
from dataflow.testing._postgres import create_database, drop_database
from tests._cli import run_cli
from tests.conftest import unavailable

pytestmark = pytest.mark.postgres

RUN = "clocks"
SKEW_S = 5 * 3600
#: How far an event's time may be from the test's clock: the time the children take to
#: start and write on a loaded machine, never hours.
NEAR_S = 120.0

# Each child is started ahead (the three import torch at once) and works on a line of
# stdin: a producer per line "PREFIX N", the rank on its first line.
PRODUCER = """
    import json, sys, time, torch
    from dataflow import Ledger, Producer
    from stores import open_store
    url, store_uri = sys.argv[1:3]
    while line := sys.stdin.readline():
        prefix, n = line.split()
        with Ledger.open(url) as led:
            producer = Producer(led, open_store(store_uri), run_id="clocks", producer_id=prefix)
            for i in range(int(n)):
                producer.emit(f"{prefix}{i}", {"x": torch.full((2,), float(i))})
        print(json.dumps({"local": time.time()}), flush=True)
"""

RANK = """
    import json, sys, time
    from dataflow import Consumer, Ledger
    from stores import open_store
    url, store_uri = sys.argv[1:3]
    sys.stdin.readline()
    with Ledger.open(url) as led:
        rank = Consumer(led, open_store(store_uri), run_id="clocks", consumer_id="rank0")
        rank.resume()
        leased = [ref.sample_id for ref in rank.lease(100, timeout=30)]
        started = time.monotonic()
        more = rank.lease(100, timeout=1.0)  # every commit is leased: it waits, then []
        waited = time.monotonic() - started
        rank.ack(leased, step=1)
    print(json.dumps({"local": time.time(), "leased": leased, "more": len(more),
                      "waited": waited}))
"""


def _skewed(code: str, *args: str, monotonic_true: bool = True) -> subprocess.Popen[str]:
    """Start ``code`` under faketime +5h, waiting for its lines (see PRODUCER, RANK)."""
    env = dict(os.environ)
    if monotonic_true:
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    command = ["faketime", "-f", f"+{SKEW_S // 3600}h", sys.executable, "-c"]
    return subprocess.Popen(
        [*command, textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _ask(child: subprocess.Popen[str], line: str) -> dict[str, Any]:
    """Tell ``child`` ``line``; what it printed (within 180 s, else it is killed)."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()
    ready, _, _ = select.select([child.stdout], [], [], 180)
    answer = child.stdout.readline() if ready else ""
    if not answer:
        child.kill()
        assert child.stderr is not None
        raise AssertionError(f"a skewed child said nothing: {child.stderr.read()[-3000:]}")
    return json.loads(answer)


@pytest.fixture(scope="module")
def skewed_run(postgres_server, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A run whose producer (two phases) and rank ran 5 h ahead; ``between``: a time of the
    server's clock after the first phase's commits and before the second's."""
    if shutil.which("faketime") is None:
        unavailable("no faketime here (apt-get install faketime; scripts/dev.sh installs it)")
    name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    url = create_database(postgres_server, name)
    store = f"dir://{tmp_path_factory.mktemp('clock_store')}"
    producer = _skewed(PRODUCER, url, store)
    ranker = _skewed(RANK, url, store, monotonic_true=False)  # it sleeps: see above
    try:
        before = time.time()
        first = _ask(producer, "a 5")
        with Ledger.open(url) as led:
            between = led.clock()
        second = _ask(producer, "b 3")
        rank = _ask(ranker, "go")
        after = time.time()
        with Ledger.open(url, create=False, read_only=True) as led:
            events = list(led.events(RUN))
        yield {
            "url": url,
            "before": before,
            "after": after,
            "between": between,
            "children": [first, second, rank],
            "rank": rank,
            "events": events,
        }
    finally:
        for child in (producer, ranker):
            child.kill()
            child.communicate()
        drop_database(postgres_server, name)


def test_the_children_ran_hours_ahead(skewed_run):
    # Else the test proves nothing: faketime must have moved their clocks.
    for child in skewed_run["children"]:
        assert child["local"] > skewed_run["after"] + SKEW_S - NEAR_S, child


def test_every_event_carries_the_database_servers_time(skewed_run):
    events = skewed_run["events"]
    assert {e.kind for e in events} >= {"claim", "commit", "resume", "lease", "ack"}
    for event in events:
        assert skewed_run["before"] - NEAR_S < event.ts < skewed_run["after"] + NEAR_S, event


def test_replay_at_a_server_time_picks_the_events_before_it(skewed_run):
    done = run_cli(
        "replay",
        "--ledger",
        skewed_run["url"],
        "--run",
        RUN,
        "--at",
        repr(skewed_run["between"]),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["committed"] == 5  # the first phase's a0..a4, none of b0..b2
    done = run_cli("replay", "--ledger", skewed_run["url"], "--run", RUN, "--json")
    assert json.loads(done.stdout)["committed"] == 8


def test_a_skewed_ranks_lease_timeout_is_a_duration(skewed_run):
    rank = skewed_run["rank"]
    assert sorted(rank["leased"]) == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]
    # Nothing was left: the second lease waited its timeout (monotonic, unskewed) for
    # nothing and returned, neither at once nor hours later.
    assert rank["more"] == 0
    assert rank["waited"] >= 1.0


def test_the_ledger_clock_is_the_clock_that_stamps_its_events(ledger, store):
    before = ledger.clock()
    Producer(ledger, store, run_id="stamped").emit("s", {"x": torch.ones(1)})
    after = ledger.clock()
    (commit,) = [e for e in ledger.events("stamped") if e.kind == "commit"]
    assert before <= commit.ts <= after
    assert abs(after - time.time()) < NEAR_S  # this machine's clock, or its server's
