"""The read of which ids a run holds, at every length of id list it pads to.

The read is compiled for a few lengths of ``IN`` list (SQLite) and pads a list to the
next one with its last id; on PostgreSQL the ids go as one array. Either way it answers
exactly the ids held, for any number of ids asked, repeated or not.
"""

from __future__ import annotations

import pytest

from dataflow import Ledger, Producer
from stores import LocalFeatureStore


@pytest.mark.parametrize("asked", [1, 2, 3, 17, 64, 65, 900, 901, 2000])
def test_the_held_ids_are_exactly_those_committed(ledger: Ledger, asked: int) -> None:
    with LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="r")
        producer.commit([store.put(f"s{i}", {}) for i in range(0, 1200, 2)])
        ids = [f"s{i}" for i in range(asked)]
        ids += ids[: asked // 3]  # some asked twice
        held = ledger.commits("r", ids)
        assert set(held) == {f"s{i}" for i in range(0, min(asked, 1200), 2)}
        assert all(revision == 0 and '"sample_id"' in ref for revision, ref in held.values())
        revisions = {sid: 0 for sid in held} | {"s1": 0}  # s1 was never committed
        assert ledger.commit_payloads("r", revisions) == {s: ref for s, (_, ref) in held.items()}
