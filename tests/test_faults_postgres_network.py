"""A PostgreSQL ledger behind a link that goes silent: no lockout, no hang, nothing lost.

Real processes on both sides of a real link: a throw-away PostgreSQL server on the host,
listening on one end of a veth pair, and clients started inside a network namespace at
the other end (``ip netns exec``). ``Link.cut()`` makes every frame vanish both ways,
without FIN or RST, as when the client's machine dies or a switch port fails.

The bounds asserted are those docs/reliability.md ("Timeouts") documents, for
``busy_timeout`` B: a dead client's run lock is freed within D = max(B, 2 s), and every
ledger call on a silent link returns or raises within 3 D + 2 s. SLACK covers a
loaded two-core machine; before these bounds existed, the lock stayed taken for about
two hours and the calls hung for about fifteen minutes (the kernel's defaults), and
these tests failed once their bounded waits ran out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.engine import make_url

from dataflow import Kind, Ledger, Producer, replay
from dataflow.testing._postgres import PostgresServer
from stores import SharedDirFeatureStore
from tests import _zygote
from tests._netns import Link, veth_namespace, why_unavailable
from tests.conftest import unavailable

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

RUN = "run"
BUSY_TIMEOUT = 2.0
DEAD = max(BUSY_TIMEOUT, 2.0)  # dataflow.recorder._postgres.dead_peer_s
LOCK_FREED_WITHIN = DEAD
CALL_WITHIN = 3 * DEAD + 2
SLACK = 8.0

PRELUDE = """
import json, os, sys, time, torch
from dataflow import Consumer, Ledger, OperationalError, Producer
from stores import SharedDirFeatureStore

def say(**fields):
    print(json.dumps(fields), flush=True)

def timed(call):
    started = time.monotonic()
    try:
        result = call()
    except OperationalError as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - started}
    return {"result": repr(result)[:60], "seconds": time.monotonic() - started}
"""

# Inside the namespace: take the run's lock in an append transaction and stay in it, as a
# client does whose machine dies between two statements.
HOLD_RUN_LOCK = PRELUDE + textwrap.dedent(
    """
    url, busy = sys.argv[1], float(sys.argv[2])
    ledger = Ledger.open(url, busy_timeout=busy)
    with ledger.write("run", "commit"):
        say(locked=True)
        time.sleep(600)
    """
)

# On the host: another writer of the run, ready before the lock is taken; on "go" it
# tries until it gets through, and says how long that took and how often it failed.
CONTEND = PRELUDE + textwrap.dedent(
    """
    url, root, role, busy, give_up = sys.argv[1:6]
    ledger = Ledger.open(url, busy_timeout=float(busy))
    store = SharedDirFeatureStore(root)
    if role == "producer":
        producer = Producer(ledger, store, run_id="run", producer_id="host-producer")
        steps = [lambda: producer.emit("after", {"x": torch.ones(2)})]
    else:
        consumer = Consumer(ledger, store, run_id="run", consumer_id="host-trainer")
        consumer.resume()
        leased = []
        steps = [lambda: leased.extend(consumer.lease(1)), lambda: consumer.ack(leased, step=1)]
    say(ready=True)
    sys.stdin.readline()
    started, failures, first_error = time.monotonic(), 0, None
    for step in steps:
        while True:
            outcome = timed(step)
            if "error" not in outcome:
                break
            failures, first_error = failures + 1, first_error or outcome["message"]
            if time.monotonic() - started > float(give_up):
                say(through=False, failures=failures, first_error=first_error)
                sys.exit(0)
    leased_ids = None if role == "producer" else [ref.sample_id for ref in leased]
    say(through=True, seconds=time.monotonic() - started, failures=failures,
        first_error=first_error, leased=leased_ids)
    """
)

# Inside the namespace: a producer and a trainer; on "go" (the link is cut by then) an
# emit, a lease and a read, each timed; on "healed", the emit and the lease once more.
CALLS_ON_A_CUT_LINK = PRELUDE + textwrap.dedent(
    """
    url, root, busy = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ledger = Ledger.open(url, busy_timeout=busy)
    store = SharedDirFeatureStore(root)
    producer = Producer(ledger, store, run_id="run", producer_id="ns-producer")
    consumer = Consumer(ledger, store, run_id="run", consumer_id="ns-trainer")
    consumer.resume()
    producer.emit("before", {"x": torch.ones(2)})
    say(ready=True)
    sys.stdin.readline()
    say(emit=timed(lambda: producer.emit("during", {"x": torch.ones(2)})))
    say(lease=timed(lambda: consumer.lease(2)))
    say(read=timed(lambda: ledger.head_seq("run")))
    sys.stdin.readline()
    say(emit=timed(lambda: producer.emit("during", {"x": torch.ones(2)})))
    say(leased=sorted(ref.sample_id for ref in consumer.lease(2)))
    """
)

# Inside the namespace: emit s-0, s-1, ... until told to stop; an emit that fails waits
# for "healed" and is emitted again, the way the docs tell a producer to retry.
EMIT_UNTIL_STOPPED = PRELUDE + textwrap.dedent(
    """
    url, root, busy, stop = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    ledger = Ledger.open(url, busy_timeout=busy)
    producer = Producer(ledger, SharedDirFeatureStore(root), run_id="run")
    i = 0
    while not os.path.exists(stop):
        while True:
            outcome = timed(lambda: producer.emit(f"s-{i}", {"x": torch.full((2,), float(i))}))
            if "error" not in outcome:
                break
            say(failed=f"s-{i}", **outcome)
            sys.stdin.readline()
        if i == 0:
            say(emitting=True)
        i += 1
    say(emitted=i)
    """
)


@pytest.fixture(scope="module")
def network() -> Iterator[tuple[Link, PostgresServer]]:
    """A namespace linked to the host, and a PostgreSQL server listening on the host's end."""
    reason = why_unavailable()
    if reason is not None:
        unavailable(reason)
    with contextlib.ExitStack() as stack:
        try:
            link = stack.enter_context(veth_namespace("df-pgn", "10.41.0.0/16"))
        except RuntimeError as exc:  # e.g. a container without CAP_SYS_ADMIN
            unavailable(f"cannot make a network namespace: {exc}")
        subnet = ipaddress.ip_interface(f"{link.host_address}/24").network
        try:
            server = PostgresServer(listen=[link.host_address], trust=[str(subnet)])
            server.start()
        except (RuntimeError, OSError) as exc:
            unavailable(f"no PostgreSQL server for the network fault tests: {exc}")
        stack.callback(server.stop)
        yield link, server


@pytest.fixture
def cut_link(network, request) -> Iterator[tuple[Link, str, str]]:
    """The link (healed after the test), a fresh database's URL from the host and from
    the namespace."""
    link, server = network
    name = f"net_{os.getpid()}_{random.getrandbits(32):08x}"
    host_url = server.create_database(name)
    namespace_url = make_url(host_url).set(host=link.host_address).render_as_string(False)
    try:
        yield link, host_url, namespace_url
    finally:
        link.heal()
        server.drop_database(name)


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)


def python(script: str, *args: object) -> list[str]:
    """The argv that runs ``script`` with ``args`` in a Python process of its own."""
    return [sys.executable, "-c", script, *map(str, args)]


def start(started: list[subprocess.Popen[str]], argv: list[str]) -> subprocess.Popen[str]:
    # A python child on this host forks from the test zygote (torch imported once); one
    # in the namespace starts afresh there (``ip netns exec``).
    popen = _zygote.Popen if argv[0] == sys.executable else subprocess.Popen
    process = popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    started.append(process)
    return process


def said(process: subprocess.Popen[str], within: float) -> dict[str, Any]:
    """The next line ``process`` says, as JSON; fails the test after ``within`` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], within)
    named = [arg for arg in process.args if "\n" not in arg]  # not the script's text
    assert ready, f"no word from {named} within {within:.1f}s"
    line = process.stdout.readline()
    assert line, f"{named} exited ({process.wait()}) without a word"
    return json.loads(line)


def tell(process: subprocess.Popen[str], word: str = "go") -> None:
    assert process.stdin is not None
    process.stdin.write(word + "\n")
    process.stdin.flush()


def commits(host_url: str) -> Counter[str]:
    with Ledger.open(host_url) as ledger:
        return Counter(e.sample_id for e in ledger.events(RUN) if e.kind == Kind.COMMIT)


STARTUP = 60.0  # a Python process importing torch on a loaded machine


def test_a_client_that_vanishes_holding_the_run_lock_stops_blocking_its_writers_within_the_bound(
    cut_link, tmp_path: Path
) -> None:
    link, host_url, namespace_url = cut_link
    root = str(tmp_path / "store")
    with Ledger.open(host_url) as ledger, SharedDirFeatureStore(root) as store:
        Producer(ledger, store, run_id=RUN).emit("before", {"x": torch.ones(2)})
    give_up = LOCK_FREED_WITHIN + SLACK
    with processes() as started:
        writers = [
            start(started, python(CONTEND, host_url, root, role, BUSY_TIMEOUT, give_up))
            for role in ("producer", "trainer")
        ]
        for writer in writers:
            assert said(writer, STARTUP) == {"ready": True}
        holder = start(started, link.exec(*python(HOLD_RUN_LOCK, namespace_url, BUSY_TIMEOUT)))
        assert said(holder, STARTUP) == {"locked": True}
        link.cut()
        holder.send_signal(signal.SIGKILL)  # its machine is gone: no FIN reaches the server
        holder.wait(timeout=30)
        for writer in writers:
            tell(writer)
        outcomes = [said(writer, give_up + STARTUP) for writer in writers]
    for outcome in outcomes:
        assert outcome["through"], outcome
        assert outcome["seconds"] < LOCK_FREED_WITHIN + SLACK, outcome
    assert outcomes[1]["leased"] == ["before"]
    assert commits(host_url) == {"before": 1, "after": 1}
    with Ledger.open(host_url) as ledger:
        assert replay(ledger, RUN).verify() == []


def test_calls_on_a_silently_cut_link_raise_unreachable_within_the_bound_and_a_retry_settles(
    cut_link, tmp_path: Path
) -> None:
    link, host_url, namespace_url = cut_link
    root = str(tmp_path / "store")
    with processes() as started:
        client = start(
            started, link.exec(*python(CALLS_ON_A_CUT_LINK, namespace_url, root, BUSY_TIMEOUT))
        )
        assert said(client, STARTUP) == {"ready": True}
        link.cut()
        tell(client)
        during_cut = [said(client, CALL_WITHIN + SLACK) for _ in range(3)]
        link.heal()
        tell(client, "healed")
        after_heal = [said(client, CALL_WITHIN + SLACK) for _ in range(2)]
    for outcome in during_cut:
        ((_call, result),) = outcome.items()
        assert result.get("error") == "OperationalError", outcome
        assert "the ledger is unreachable" in result["message"], outcome
        assert "retry" in result["message"], outcome
        assert result["seconds"] < CALL_WITHIN + SLACK, outcome
    assert "SampleRef" in after_heal[0]["emit"]["result"], after_heal
    assert after_heal[1] == {"leased": ["before", "during"]}
    assert commits(host_url) == {"before": 1, "during": 1}  # the retry: no loss, no duplicate
    with Ledger.open(host_url) as ledger:
        assert replay(ledger, RUN).verify() == []


def test_emits_cut_off_at_a_random_moment_are_each_committed_once_after_the_link_heals(
    cut_link, tmp_path: Path
) -> None:
    link, host_url, namespace_url = cut_link
    root, stop = str(tmp_path / "store"), tmp_path / "stop"
    with processes() as started:
        producer = start(
            started,
            link.exec(*python(EMIT_UNTIL_STOPPED, namespace_url, root, BUSY_TIMEOUT, stop)),
        )
        assert said(producer, STARTUP) == {"emitting": True}
        time.sleep(random.uniform(0, 0.3))
        link.cut()
        failed = said(producer, CALL_WITHIN + SLACK)
        link.heal()
        tell(producer, "healed")
        time.sleep(0.3)
        stop.touch()
        emitted = said(producer, CALL_WITHIN + SLACK)["emitted"]
    assert failed["error"] in ("OperationalError", "CommitOutcomeUnknownError"), failed
    assert failed["seconds"] < CALL_WITHIN + SLACK, failed
    assert commits(host_url) == {f"s-{i}": 1 for i in range(emitted)}
    with Ledger.open(host_url) as ledger:
        assert replay(ledger, RUN).verify() == []
