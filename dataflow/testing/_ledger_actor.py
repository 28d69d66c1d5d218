"""A producer or a rank on a simulated host, driven by JSON lines (for the ledger fault trials).

Run inside a host's namespace by :mod:`dataflow.testing._host_faults_ledger`::

    python -m dataflow.testing._ledger_actor ROLE LEDGER_URL STORE_DIR RUN_ID ACTOR_ID BUSY_TIMEOUT

or without arguments, started ahead of its trial (its imports done meanwhile): then its
first line on stdin is ``{"argv": [ROLE, LEDGER_URL, ...]}``.

``ROLE`` is ``producer`` (a :class:`Producer` on a shared-dir store) or ``rank`` (a
:class:`Consumer` that resumes). It says ``{"ready": true}``, then answers each command
line on stdin with one line on stdout: ``{"ok": true, "result": ..., "at": T}`` or
``{"error": NAME, "message": ..., "at": T}`` (``at``: ``time.monotonic()``, one clock for
every process of the machine). Commands (``op``):

- ``emit`` ``ids``: ``emit_many`` of those ids (the result: each id, or None when the
  ledger already held it);
- ``lease`` ``n``, ``ack`` ``ids`` ``step``, ``resume``, ``close``;
- ``train_loop`` ``n`` ``retry_s`` ``stop``: lease ``n`` (4) and ack them, again
  and again, each call retried until it returns (at most ``retry_s`` seconds); ends
  once the file ``stop`` names exists and a lease finds nothing. It says
  ``{"looping": true}`` after its first ack, and at the end the ids trained and the
  errors seen;
- ``emit_loop`` ``first`` ``retry_s`` ``stop``: emit ``s-FIRST``, ``s-FIRST+1`` ... one at a time,
  each retried (the same id, as the docs say) until it returns, at most ``retry_s``
  seconds; stops before the next id once the file ``stop`` names exists. It says
  ``{"looping": true}`` after its first emit, and at the end the ids emitted, when each
  returned (``done``) and the errors seen.

``"pause": true`` on a command holds its first write transaction just before its COMMIT:
the actor says ``{"committing": true}`` and waits for a line on stdin, so that the
caller can stall or cut the link at exactly that moment. Results go through stdout,
never pickle.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import event

from dataflow.live._consumer import Consumer
from dataflow.live._producer import Producer
from dataflow.model._errors import DataflowError
from dataflow.recorder._db import WRITE_OPTION
from dataflow.recorder._ledger import Ledger
from stores import SharedDirFeatureStore


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class _CommitPause:
    """Holds the next write transaction's COMMIT until the caller says go (``pause``)."""

    def __init__(self, ledger: Ledger) -> None:
        self.armed = False
        # The engine's commit event fires before the driver sends COMMIT.
        event.listen(ledger._engine, "commit", self._before_commit)

    def _before_commit(self, conn: Any) -> None:
        if self.armed and conn.get_execution_options().get(WRITE_OPTION):
            self.armed = False
            say(committing=True)
            sys.stdin.readline()


def _tensors(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), float(sum(map(ord, sample_id))))}


def _answer(call: Any) -> dict[str, Any]:
    try:
        result = call()
    except DataflowError as exc:
        notes = getattr(exc, "__notes__", [])
        return {"error": type(exc).__name__, "message": str(exc), "notes": notes,
                "at": time.monotonic()}  # fmt: skip
    return {"ok": True, "result": result, "at": time.monotonic()}


def _emit_one(producer: Producer, sample_id: str) -> bool:
    return producer.emit(sample_id, _tensors(sample_id)) is not None


def _retrying(call: Any, retry_s: float, errors: list[dict[str, Any]], **what: Any) -> Any:
    """``call()`` until it returns (its answer), at most ``retry_s`` seconds (then None);
    each error it raises meanwhile goes into ``errors``."""
    started = time.monotonic()
    while True:
        outcome = _answer(call)
        if "ok" in outcome:
            return outcome
        errors.append({**what, **outcome})
        if time.monotonic() - started > retry_s:
            return None
        time.sleep(0.2)


def _emit_loop(producer: Producer, first: int, retry_s: float, stop: Path) -> dict[str, Any]:
    emitted: list[str] = []
    done: list[float] = []  # when each emitted one returned
    errors: list[dict[str, Any]] = []
    index = first
    while not stop.exists():
        sample_id = f"s-{index}"
        call = functools.partial(_emit_one, producer, sample_id)
        outcome = _retrying(call, retry_s, errors, id=sample_id)
        if outcome is None:
            return {"ok": False, "emitted": emitted, "done": done, "errors": errors,
                    "gave_up": sample_id}  # fmt: skip
        emitted.append(sample_id)
        done.append(outcome["at"])
        if index == first:
            say(looping=True)
        index += 1
    return {"ok": True, "emitted": emitted, "done": done, "errors": errors}


def _lease_ids(consumer: Consumer, n: int) -> list[str]:
    return [ref.sample_id for ref in consumer.lease(n)]


def _train_loop(consumer: Consumer, n: int, retry_s: float, stop: Path) -> dict[str, Any]:
    """Lease ``n`` and ack them, step after step, each call retried (the same ack again)
    until it returns; ends once ``stop`` exists and a lease finds nothing. ``done``: when
    each ack returned, and each first call that returned after an error."""
    trained: list[str] = []
    done: list[float] = []
    errors: list[dict[str, Any]] = []
    step = 1
    while True:
        leased = _retrying(functools.partial(_lease_ids, consumer, n), retry_s, errors)
        if leased is None:
            return {"ok": False, "trained": trained, "done": done, "errors": errors}
        if errors and (not done or done[-1] < errors[-1]["at"]):
            done.append(leased["at"])
        if not leased["result"]:
            if stop.exists():
                return {"ok": True, "trained": trained, "done": done, "errors": errors}
            time.sleep(0.05)
            continue
        ids = leased["result"]
        acked = _retrying(functools.partial(consumer.ack, ids, step=step), retry_s, errors)
        if acked is None:
            return {"ok": False, "trained": trained, "done": done, "errors": errors}
        trained += ids
        done.append(acked["at"])
        if step == 1:
            say(looping=True)
        step += 1


def _end_with_parent() -> None:
    """Exit once the process that started this one is gone, however it ended (a trial
    SIGKILLed mid-loop leaves no actor emitting on its own)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def main(argv: list[str]) -> None:
    _end_with_parent()
    if not argv:  # started ahead of its trial: the arguments come as the first line
        argv = json.loads(sys.stdin.readline())["argv"]
    role, url, root, run_id, actor, busy = argv
    ledger = Ledger.open(url, busy_timeout=float(busy))
    store = SharedDirFeatureStore(root)
    pause = _CommitPause(ledger)
    producer = consumer = None
    if role == "producer":
        producer = Producer(ledger, store, run_id=run_id, producer_id=actor)
    else:
        consumer = Consumer(ledger, store, run_id=run_id, consumer_id=actor)
        consumer.resume()
    say(ready=True)
    while line := sys.stdin.readline():
        command = json.loads(line)
        op = command["op"]
        pause.armed = bool(command.get("pause"))
        if op == "emit_loop":
            assert producer is not None
            say(**_emit_loop(producer, command["first"], command["retry_s"], Path(command["stop"])))
            continue
        if op == "train_loop":
            assert consumer is not None
            stop = Path(command["stop"])
            say(**_train_loop(consumer, command.get("n", 4), command["retry_s"], stop))
            continue
        say(**_answer(functools.partial(_run, op, command, producer, consumer)))


def _run(
    op: str, command: dict[str, Any], producer: Producer | None, consumer: Consumer | None
) -> Any:
    """One command's result (JSON): what a producer or a consumer call returned."""
    if producer is not None:
        if op == "close":
            return producer.close()
        refs = producer.emit_many([(s, _tensors(s)) for s in command["ids"]])
        return [None if ref is None else ref.sample_id for ref in refs]
    assert consumer is not None
    if op == "lease":
        return [ref.sample_id for ref in consumer.lease(command["n"])]
    if op == "ack":
        return consumer.ack(command["ids"], step=command["step"])
    consumer.resume()
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
