"""Processes to SIGKILL in the crash-then-gc tests: a rank releasing, a producer putting.

Both talk to a real ledger and open their store from a URI (``sys.argv``); each
prints ``working`` once it has done its first step (a checkpoint, a put), which
:func:`kill_at_random` waits for. The producer puts samples ``{name}{i}`` of a
tensor of ``sys.argv[3]`` floats (``name``: ``sys.argv[4]``, by default ``p``).
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time

from dataflow import Ledger, replay
from tests import _zygote

RUN = "run"
SAMPLES = 300


def live_generations(led: Ledger) -> set[tuple[str, int]]:
    state = replay(led, RUN)
    kept = [s for s in state.committed if s not in state.released and s not in state.lost]
    return {(sample_id, ref.generation) for sample_id, ref in state.refs(kept).items()}


def child(code: str, *args: str) -> subprocess.Popen[str]:
    return _zygote.Popen(  # forked warm: a fresh interpreter imports torch
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def kill_at_random(child: subprocess.Popen[str], rng: random.Random, most: float) -> None:
    """SIGKILL ``child`` a random moment after it says it is working (and before it ends)."""
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "working"
    time.sleep(rng.uniform(0.0, most))
    assert child.poll() is None, "it ended before the kill"
    child.kill()
    child.wait(10)


RANK = """
    import sys, time, torch
    from dataflow import Consumer, Ledger
    from stores import open_store
    led, store = Ledger.open(sys.argv[1]), open_store(sys.argv[2])
    rank = Consumer(led, store, run_id="run", consumer_id="rank0")
    rank.resume()
    step = 0
    while refs := rank.lease(8):
        for ref in refs:
            store.get(ref)  # a read lease on every tensor it releases below
        time.sleep(0.02)  # the step's training: 38 steps outlast the kill's window
        step += 1
        rank.ack(refs, step=step)
        rank.checkpoint(step, sys.argv[3])  # releases and deletes what step trained
        if step == 1:
            print("working", flush=True)
"""

PRODUCER = """
    import sys, torch
    from dataflow import Ledger, Producer
    from stores import open_store
    led, store = Ledger.open(sys.argv[1]), open_store(sys.argv[2])
    name = sys.argv[4] if len(sys.argv) > 4 else "p"
    producer = Producer(led, store, run_id="run", producer_id=name)
    for i in range(100000):
        x = torch.full((int(sys.argv[3]),), float(i))
        producer.emit(f"{name}{i}", {"x": x, "y": torch.ones(3, 7)})
        if i == 0:
            print("working", flush=True)
"""
