"""A producer on a host of its own, for the network fault scenarios (``python -m``).

``python -m dataflow.testing._net_producer CONFIG_JSON`` emits ``samples`` samples
(``s00000``...; small tensors that name their index), ``batch`` per ``emit_many``
(default 1), ``interval_s`` apart, to its ledger
and store, through a ZeroMQ stream (CURVE) when the config names one, then closes.

An emit that fails with a ledger ``OperationalError`` or a ``StoreError`` (a link that
is cut, stalls or resets) is tried again, same id, for ``retry_s``: the ledger settles
whether a commit whose reply was lost landed. Each failure is counted by its error's
type, and the first message of each type kept. It appends its progress (the count
emitted) to ``progress`` and writes ``result`` (JSON). With ``hold`` it then waits for
that file to appear before it exits (its memory may hold the features: a Mooncake
segment). With ``after`` (paths) it first waits for those files to appear (at most
``after_s`` seconds): started beside the ranks, it imports torch while they do, and
connects once their receivers are up. With ``gate`` (a path) it waits, once ``gate_at``
samples are emitted, for that file to appear (at most ``gate_s`` seconds, default 60):
a fault injected meanwhile then lands while it still has samples to emit, however late
a loaded machine lets the caller inject it. Exit status 0, or 3 when an error stopped it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dataflow.live._producer import Producer
from dataflow.model._errors import OperationalError, StoreError
from dataflow.recorder._ledger import Ledger
from dataflow.streams._security import CurveClientConfig
from dataflow.streams._sender import SenderConfig, ZmqRefSender
from dataflow.testing._net_rank import RETRIED, retrying, run_and_exit, wait_for_files
from stores import open_store


def _sender(config: dict[str, Any]) -> ZmqRefSender | None:
    stream = config.get("stream")
    if stream is None:
        return None
    curve = stream.get("curve")
    return ZmqRefSender(
        SenderConfig(
            endpoints=tuple(stream["endpoints"]),
            heartbeat_interval=stream["heartbeat_interval"],
            heartbeat_timeout=stream["heartbeat_timeout"],
            send_timeout=stream.get("send_timeout", 30.0),
            close_timeout=stream.get("close_timeout", 5.0),
            curve=None if curve is None else CurveClientConfig(**curve),
        )
    )


def features(index: int) -> dict[str, torch.Tensor]:
    """Sample ``index``'s features: they name it, so a mix-up would show."""
    return {"x": torch.full((4,), float(index))}


def run(config: dict[str, Any], result: dict[str, Any]) -> None:
    """Emit, then close; fills ``result`` as it goes."""
    retry_s = config.get("retry_s", 0.0)
    wait_for_files(config.get("after", ()), config.get("after_s", 60.0))
    ledger = retrying(
        retry_s, Ledger.open, config["ledger_url"], busy_timeout=config.get("busy_timeout", 30.0)
    )
    store = open_store(config["store_uri"])
    producer = retrying(
        retry_s,
        Producer,
        ledger,
        store,
        run_id=config["run_id"],
        producer_id=config["producer_id"],
        stream=_sender(config),
    )
    progress = Path(config["progress"])
    failures: dict[str, int] = result.setdefault("failures", {})
    messages: dict[str, str] = result.setdefault("messages", {})
    first, batch = config.get("first", 0), config.get("batch", 1)
    for start in range(first, first + config["samples"], batch):
        indices = range(start, min(start + batch, first + config["samples"]))
        deadline = time.monotonic() + retry_s
        while True:
            started = time.monotonic()
            try:
                producer.emit_many((f"s{i:05d}", features(i)) for i in indices)
                break
            except (OperationalError, StoreError) as exc:
                kind = type(exc).__name__
                failures[kind] = failures.get(kind, 0) + 1
                messages.setdefault(kind, f"{exc} (after {time.monotonic() - started:.1f} s)")
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        done = indices[-1] - first + 1
        with progress.open("a") as file:
            file.write(f"{done} {time.monotonic()}\n")
        if config.get("gate") is not None and done - len(indices) < config["gate_at"] <= done:
            wait_for_files([config["gate"]], config.get("gate_s", 60.0))
        time.sleep(config.get("interval_s", 0.0))
    producer.close()
    result["emitted"] = config["samples"]
    result["retried"] = dict(RETRIED)
    hold = config.get("hold")
    if hold is not None:
        deadline = time.monotonic() + config.get("hold_s", 60.0)
        while not Path(hold).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    store.close()
    ledger.close()


def main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    run_and_exit(run, config, {"producer_id": config["producer_id"], "error": None})


if __name__ == "__main__":
    main(sys.argv)
