"""No Mooncake memory leaks on a crash: what a SIGKILLed process leaves, `gc` finds.

A real ``mooncake_master``, real processes SIGKILLed at a random moment of their
releases (a rank) or puts (a producer), a real SQLite ledger, then
``collect_garbage(grace=0)``: every key left in the namespace belongs to a sample
the ledger keeps alive (the master's admin API lists them all). The memory lives
in this process (the ``lender`` store's segment), as it would in a keeper that
nobody kills; the killed processes lend none.
"""

from __future__ import annotations

import random
import re
import time
import urllib.parse
import uuid

import pytest
import torch

from dataflow import Consumer, Ledger, Producer, collect_garbage, replay
from stores import MooncakeFeatureStore
from stores._mooncake_client import _OPENER
from stores.mooncake_master import MooncakeMaster
from tests._crash import PRODUCER, RANK, RUN, SAMPLES, child, kill_at_random, live_generations

pytestmark = pytest.mark.mooncake

LEASE_MS = 6000  # the read lease in the close() test: long beside a close that does not wait


def _namespace_keys(admin: str, namespace: str) -> list[str]:
    """Every key of ``namespace`` that the master holds, from its admin API."""
    with _OPENER.open(f"http://{admin}/get_all_keys", timeout=5) as response:
        keys = response.read().decode().split()
    return [key for key in keys if key.startswith(f"{namespace}/")]


_GENERATION_KEY = re.compile(r"(.+)/g([0-9]+)/[^/]+")  # a record (@) or a tensor
_HEAD_KEY = re.compile(r"(.+)/@head")


def _unreferenced(admin: str, namespace: str, live: set[tuple[str, int]]) -> list[str]:
    """The keys of ``namespace`` that no sample alive in the ledger owns (claims of
    generations aside: 8 bytes per block of 2**20 generations, kept on purpose)."""
    live_ids = {sample_id for sample_id, _ in live}
    left = []
    for key in _namespace_keys(admin, namespace):
        rest = key.removeprefix(f"{namespace}/")
        generation, head = _GENERATION_KEY.fullmatch(rest), _HEAD_KEY.fullmatch(rest)
        if rest.startswith("@generations/"):
            continue
        if head and head.group(1) in live_ids:
            continue
        if generation and (generation.group(1), int(generation.group(2))) in live:
            continue
        left.append(key)
    return left


def _lending_none(master: MooncakeMaster, namespace: str) -> str:
    """A URI of the namespace for a process that lends no memory (the killed ones)."""
    uri = master.store_uri(namespace=namespace)
    return f"{uri}&segment_size=0&buffer_size={urllib.parse.quote('4M')}"


@pytest.fixture
def crash_setup(mooncake_master, tmp_path):
    namespace = f"crash{uuid.uuid4().hex[:10]}"
    led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    lender = MooncakeFeatureStore(  # the memory: this process is never killed
        mooncake_master.master_address,
        metadata=mooncake_master.metadata_url,
        admin=mooncake_master.admin_address,
        namespace=namespace,
        segment_size=256 << 20,
    )
    yield led, lender, namespace
    lender.close()
    led.close()


def test_a_rank_killed_while_releasing_leaves_nothing_gc_cannot_find(
    mooncake_master,
    crash_setup,
    tmp_path,
):
    led, store, namespace = crash_setup
    producer = Producer(led, store, run_id=RUN, producer_id="p0")
    producer.emit_many(
        (f"s{i}", {"x": torch.full((512,), float(i)), "y": torch.ones(2, 5)})
        for i in range(SAMPLES)
    )
    producer.close()
    seed = random.randrange(1 << 30)
    rank = child(RANK, led.url, _lending_none(mooncake_master, namespace), str(tmp_path))
    kill_at_random(rank, random.Random(seed), 0.5)
    time.sleep(0.3)  # the killed rank's read leases (200 ms) end
    released = len(replay(led, RUN).released)
    assert released > 0, f"seed {seed}: the rank released nothing before the kill"

    report = collect_garbage(led, store, grace=0)

    live = live_generations(led)
    assert _unreferenced(mooncake_master.admin_address, namespace, live) == [], (
        f"seed {seed}: {released} released, gc removed {report.removed}"
    )
    state = replay(led, RUN)
    for sample_id, generation in sorted(live)[:20]:  # what the ledger keeps still reads
        assert store.get(state.ref(sample_id))["x"][0] == int(sample_id[1:]), generation


def test_a_producer_killed_while_putting_leaves_nothing_gc_cannot_find(
    mooncake_master,
    crash_setup,
):
    led, store, namespace = crash_setup
    seed = random.randrange(1 << 30)
    producer = child(PRODUCER, led.url, _lending_none(mooncake_master, namespace), "512")
    kill_at_random(producer, random.Random(seed), 1.0)
    assert _namespace_keys(mooncake_master.admin_address, namespace), f"seed {seed}: no puts"

    collect_garbage(led, store, grace=0)

    live = live_generations(led)
    assert _unreferenced(mooncake_master.admin_address, namespace, live) == [], f"seed {seed}"
    consumer = Consumer(led, store, run_id=RUN, consumer_id="check")
    consumer.resume()
    refs = consumer.lease(len(live))
    assert {(ref.sample_id, ref.generation) for ref in refs} == live
    for ref in refs:
        assert store.get(ref)["x"][0] == int(ref.sample_id[1:])


_CLOSER = """
    import sys, time, torch
    from stores import open_store

    class TimedTeardown:  # the Mooncake client's own close(), timed apart
        def __init__(self, raw):
            self.raw, self.took = raw, 0.0
        def __getattr__(self, name):
            return getattr(self.raw, name)
        def close(self):
            started = time.monotonic()
            self.raw.close()
            self.took = time.monotonic() - started

    store = open_store(sys.argv[1])
    store._client.raw = raw = TimedTeardown(store._client.raw)
    refs = store.put_many([(f"s{i}", {"x": torch.ones(64)}) for i in range(20)])
    for ref in refs:
        store.get(ref)
        store.delete(ref)  # under the read lease: queued
    started = time.monotonic()
    store.close()
    took = time.monotonic() - started
    import threading
    for thread in threading.enumerate():  # what the interpreter waits for at exit
        if thread.name == "mooncake-teardown":
            thread.join()
    print(took, raw.took, flush=True)
"""


def test_close_returns_within_a_second_and_gc_frees_what_a_lease_held(mooncake_installed, tmp_path):
    # A lease long enough to see close() wait for it (Mooncake's default is 10 s).
    with MooncakeMaster(lease_ttl_ms=LEASE_MS) as master:
        namespace = "close"
        lender = MooncakeFeatureStore(  # the memory, in a process that outlives the closer
            master.master_address,
            metadata=master.metadata_url,
            admin=master.admin_address,
            namespace=namespace,
            segment_size=64 << 20,
        )
        led = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
        try:
            closer = child(_CLOSER, _lending_none(master, namespace))
            out, _ = closer.communicate(timeout=60)
            assert closer.returncode == 0
            took, teardown = (float(word) for word in out.split())
            # The old close waited out the lease; Mooncake's own teardown of a client that
            # lends nothing (about 1 s) runs on after close() returns. (It returns in
            # milliseconds: half the lease only catches such a wait, not a loaded machine.)
            assert took < LEASE_MS / 2000, f"close() took {took:.2f}s"
            assert teardown > 0, "the client was torn down before the process ended"
            assert _unreferenced(master.admin_address, namespace, set())  # left to gc

            deadline = time.monotonic() + 60  # the lease ends meanwhile
            while _unreferenced(master.admin_address, namespace, set()):
                assert time.monotonic() < deadline
                collect_garbage(led, lender, grace=0)
                time.sleep(0.2)
            assert _unreferenced(master.admin_address, namespace, set()) == []
        finally:
            led.close()
            lender.close()
