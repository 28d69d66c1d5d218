"""A demo producer process: synthetic prompts -> the target's hidden states -> the store;
the refs are committed to the ledger and pushed to the trainer ranks over ZeroMQ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dataflow import Ledger, Producer
from dataflow.demo._child import kill_self
from dataflow.demo._model import TargetNetwork, producer_id, sample_id
from dataflow.streams import CurveClientConfig, SenderConfig, ZmqRefSender
from stores import open_store

CHUNK = 8  # samples per emit_many: one ledger transaction


def produce(config: dict, index: int) -> None:
    torch.set_num_threads(1)
    target = TargetNetwork(config["seed"])
    this = producer_id(index)
    ledger = Ledger.open(config["ledger_url"], busy_timeout=config.get("busy_timeout_s", 30.0))
    store = open_store(config["store_uri"])
    # Without a stream (a committed dataset, trained in a seeded order) the ranks lease
    # from the ledger alone.
    sender = (
        ZmqRefSender(
            # Long enough to wait out a restart of both ranks; a ref that still finds no
            # credit stays pending in the ledger, and the ranks lease it from there.
            SenderConfig(
                endpoints=tuple(config["endpoints"]),
                producer_id=this,
                send_timeout=60,
                curve=_curve(config),
            )
        )
        if config.get("stream", True)
        else None
    )
    producer = Producer(ledger, store, run_id=config["run_id"], producer_id=this, stream=sender)
    _kill_in_commit(config, index, store)
    mine = list(range(index, config["samples"], config["producers"]))
    # A restarted producer emits everything again: the ledger answers the ids it holds
    # without a put, so only what the killed one did not commit is stored and committed.
    for start in range(0, len(mine), CHUNK):
        chunk = mine[start : start + CHUNK]
        producer.emit_many([(sample_id(i), target.features(i)) for i in chunk])
    # End the stream before the ledger records the close: once every rank acknowledged the
    # EOF, every ref sent before it has reached them. (Producer.close records the close
    # first, and a rank that folds it counts this producer as closed at once: it could
    # settle its last micro-batches while refs are still on the wire, and strand them.)
    if sender is not None:
        sender.close()
    producer.close()  # 'close' in the ledger (the stream is closed already)
    store.close()
    ledger.close()


def _curve(config: dict) -> CurveClientConfig | None:
    """The sender's CURVE keys, when the config names them (chaos --hosts)."""
    curve = config.get("curve")
    if curve is None:
        return None
    return CurveClientConfig(
        secret_key_file=curve["secret"], server_public_key_file=curve["server_public"]
    )


def _kill_in_commit(config: dict, index: int, store: Any) -> None:
    """``dataflow chaos``: SIGKILL this producer after the n-th put of its run, in the middle
    of a batch (features stored, the batch's commit not written yet)."""
    plan = config.get("kill_in_commit")
    if plan is None or plan["producer"] != index or Path(plan["marker"]).exists():
        return  # not this one, or this is the restarted producer
    put, put_many, count = store.put, store.put_many, 0

    def put_then_die(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        ref = put(*args, **kwargs)
        count += 1
        if count == plan["after_puts"]:
            kill_self(plan["marker"])
        return ref

    def put_many_then_die(*args: Any, **kwargs: Any) -> Any:
        # emit_many stores a batch in one put_many: the death comes after the batch that
        # holds the n-th put, its features stored and its commit not written.
        nonlocal count
        refs = put_many(*args, **kwargs)
        before, count = count, count + len(refs)
        if before < plan["after_puts"] <= count:
            kill_self(plan["marker"])
        return refs

    store.put = put_then_die
    store.put_many = put_many_then_die


def main(config: dict, index: int) -> None:
    """The producer process (``dataflow.demo._child.run_child`` calls it)."""
    produce(config, index)
