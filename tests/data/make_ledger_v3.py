"""Make ``ledger_v3.db`` and ``ledger_v3.json``: a schema-3 ledger written by dataflow at
commit c05a553 (one row per sample for every lease, ack, nack and release), and what that
dataflow's fold made of it.

tests/test_ledger_migration.py opens the ledger with the current dataflow and checks that
it folds to the same state. To make them again (they are committed; this never runs in
the tests)::

    tmp=$(mktemp -d) && git archive c05a553 | tar -x -C "$tmp"
    PYTHONPATH="$tmp" python tests/data/make_ledger_v3.py tests/data

``plain`` is imported by the test too: it turns a fold's ``observable()`` into JSON data
the same way on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Set
from pathlib import Path
from typing import Any

RUN = "migrate"


def plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses as dicts, tuples and sets as lists, keys as str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Set):  # sets, and a plan's lazily computed trained set
        return sorted(plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def make(out: Path) -> None:
    import torch

    from dataflow import Consumer, Ledger, Producer, replay
    from dataflow.recorder._schema import SCHEMA_VERSION
    from stores import LocalFeatureStore

    assert SCHEMA_VERSION == 3, f"run against dataflow c05a553 (schema 3), not {SCHEMA_VERSION}"
    db = out / "ledger_v3.db"
    db.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ledger-v3-"))
    ledger = Ledger.open(f"sqlite:///{db}")
    store = LocalFeatureStore()

    def emit(producer: Producer, *ids: str) -> None:
        producer.emit_many(
            (s, {"x": torch.tensor(list(s.encode()), dtype=torch.uint8)}) for s in ids
        )

    p1 = Producer(ledger, store, run_id=RUN, producer_id="p1")
    p2 = Producer(ledger, store, run_id=RUN, producer_id="p2")
    emit(p1, *(f"a{i}" for i in range(6)))
    emit(p2, *(f"b{i}" for i in range(6)))

    first = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", max_attempts=2)
    first.resume()
    batch = first.lease(4)
    first.ack(batch[:2], step=1)
    first.nack(batch[2:3], reason="retry me")
    first.nack(batch[3:4], retryable=False, reason="broken")
    batch = first.lease(3)
    first.ack(batch, step=2)
    checkpoint = work / "step-2"
    checkpoint.mkdir()
    first.record_checkpoint(2, checkpoint)  # releases what steps 1 and 2 trained
    batch = first.lease(2)
    first.ack(batch[:1], step=3)  # the other stays leased: the resume requeues it

    second = Consumer(ledger, store, run_id=RUN, consumer_id="rank0", max_attempts=2)
    second.resume()  # from the checkpoint at step 2: step 3's ack is cut off
    emit(p1, "a6", "a7")
    p1.close()
    batch = second.lease(3)
    second.ack(batch[:2], step=3)
    second.nack(batch[2:], reason="once more")

    state = replay(ledger, RUN)
    expected = {
        "run_id": RUN,
        "observable": plain(state.observable()),
        "verify": state.verify(),
        "rows": sum(1 for _ in ledger.rows(RUN)),
    }
    ledger.close()
    (out / "ledger_v3.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    make(Path(sys.argv[1]))
