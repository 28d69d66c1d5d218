"""A trainer rank on a host of its own, for the network fault scenarios (``python -m``).

``python -m dataflow.testing._net_rank CONFIG_JSON`` joins a run as one consumer rank:
it resumes from the ledger, then leases, reads the features, meets its peer in one
all_reduce per step when it has one (gloo on the hosts' addresses, as a gradient
reduction would), acks, and records a checkpoint every ``checkpoint_every`` steps,
until the run is drained on every rank. Ledger calls that fail with an
``OperationalError`` (a link that stalls or resets) are retried for ``retry_s``.

It appends what it acked to ``progress`` (a JSON line per step: its monotonic time and
the ids) and writes ``result`` (JSON: acked ids, producer losses, the receiver's
counters, the error that stopped it if one did). With ``after`` (paths) it first waits
for those files to appear (at most ``after_s`` seconds): a rank started ahead of its
moment. Exit status 0 when the run is drained, 3 when an error stopped it. The config
keys are those :mod:`_host_faults_net` writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dataflow.live._collectives import join_gloo, reduce_max
from dataflow.live._consumer import Consumer
from dataflow.model._errors import OperationalError, ProducerLostError
from dataflow.recorder._ledger import Ledger
from dataflow.streams._receiver import ReceiverConfig, ZmqRefReceiver
from dataflow.streams._security import CurveServerConfig
from stores import open_store

_T = TypeVar("_T")
#: The failures :func:`retrying` retried past, by the error's type (this process's).
RETRIED: Counter[str] = Counter()


def retrying(retry_s: float, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)``, again after an ``OperationalError`` until ``retry_s``
    passed (a lease or ack that landed before its reply was lost returns as if it had
    not failed: the consumer settles it from the ledger)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return call(*args, **kwargs)
        except OperationalError as exc:
            RETRIED[type(exc).__name__] += 1
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def wait_for_files(paths: list[str], timeout_s: float) -> None:
    """Wait until every file of ``paths`` exists, at most ``timeout_s`` seconds, then go
    on regardless: a child started ahead imports torch (seconds of CPU) meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not all(Path(p).exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def _receiver(config: dict[str, Any]) -> ZmqRefReceiver | None:
    stream = config.get("stream")
    if stream is None:
        return None
    curve = stream.get("curve")
    receiver = ZmqRefReceiver(
        ReceiverConfig(
            endpoint=stream["endpoint"],
            expected_producers=stream.get("expected_producers", 1),
            window=stream.get("window", 64),
            heartbeat_interval=stream["heartbeat_interval"],
            heartbeat_timeout=stream["heartbeat_timeout"],
            idle_timeout=stream.get("idle_timeout", 60.0),
            curve=None if curve is None else CurveServerConfig(**curve),
        )
    )
    where = Path(stream["endpoint_file"])
    where.with_suffix(".tmp").write_text(receiver.endpoint)
    where.with_suffix(".tmp").replace(where)  # whole, or not there
    return receiver


def run(config: dict[str, Any], result: dict[str, Any]) -> None:
    """The rank's life; fills ``result`` as it goes."""
    if config.get("gloo") is not None:
        import torch.distributed  # noqa: F401 (seconds: before the wait, not after)
    wait_for_files(config.get("after", ()), config.get("after_s", 60.0))
    rank, world_size = config["rank"], config.get("world_size", 1)
    retry_s = config.get("retry_s", 0.0)
    gloo = config.get("gloo")
    if gloo is not None:
        join_gloo(
            rank,
            world_size,
            gloo["address"],
            gloo["port"],
            timeout_s=gloo["timeout_s"],
            interface=gloo.get("interface"),
        )
    receiver = _receiver(config)
    ledger = retrying(
        retry_s, Ledger.open, config["ledger_url"], busy_timeout=config.get("busy_timeout", 30.0)
    )
    consumer = retrying(
        retry_s,
        Consumer,
        ledger,
        open_store(config["store_uri"]),
        run_id=config["run_id"],
        consumer_id=config["consumer_id"],
        rank=rank,
        world_size=world_size,
        stream=receiver,
    )
    plan = retrying(retry_s, consumer.resume, "latest")
    step = plan.checkpoint_step or 0
    batch, every = config.get("batch", 4), config.get("checkpoint_every", 0)
    step_s = config.get("step_s", 0.0)  # a step's compute: a fault lands mid-run, not after
    checkpoints = Path(config["checkpoint_dir"])
    progress = Path(config["progress"])
    result["acked"], result["producer_lost"], result["steps"] = [], 0, 0
    try:
        while True:
            step += 1
            refs = []
            if not consumer.drained:
                try:
                    refs = retrying(retry_s, consumer.lease, batch, timeout=0.2)
                except ProducerLostError:
                    result["producer_lost"] += 1
            for ref in refs:
                consumer.load(ref)  # the features are there to read
            if refs and step_s:
                time.sleep(step_s)
            more = bool(refs) or not consumer.drained
            if gloo is not None:  # the step's reduction: every rank goes on while one has work
                [more] = reduce_max([int(more)])
            if refs:
                retrying(retry_s, consumer.ack, refs, step=step)
                ids = [ref.sample_id for ref in refs]
                result["acked"] += ids
                with progress.open("a") as file:
                    file.write(json.dumps({"t": time.monotonic(), "ids": ids}) + "\n")
            result["steps"] += 1
            if every and step % every == 0:
                path = checkpoints / f"step-{step:06d}-rank{rank}"
                path.write_text(json.dumps({"step": step}))
                consumer.record_checkpoint(step, path)  # a collective: never retried alone
            if not more:
                break
    finally:
        result["retried"] = dict(RETRIED)
        if receiver is not None:
            result["receiver"] = dataclasses.asdict(receiver.stats())
    consumer.close()
    ledger.close()


def run_and_exit(
    body: Callable[[dict[str, Any], dict[str, Any]], None],
    config: dict[str, Any],
    result: dict[str, Any],
) -> None:
    """Run a host child's ``body``, write its result file atomically, and exit (3 on error)."""
    status = 0
    try:
        body(config, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        status = 3
    where = Path(config["result"])
    where.with_suffix(".tmp").write_text(json.dumps(result))
    where.with_suffix(".tmp").replace(where)
    sys.stdout.flush()
    # Without the interpreter's teardown: a gloo group whose peer is gone can hang it.
    os._exit(status)


def main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    run_and_exit(run, config, {"rank": config["rank"], "error": None})


if __name__ == "__main__":
    main(sys.argv)
