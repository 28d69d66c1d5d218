"""A producer process of the walk-through (docs/deploy.md): features into the store,
refs committed to the ledger and streamed to the ranks over ZeroMQ.

    python examples/deploy/producer.py INDEX
"""

from __future__ import annotations

import sys
import time

from common import env, features, sample_ids

from dataflow import Ledger, Producer
from dataflow.streams import SenderConfig, ZmqRefSender
from stores import open_store


def main(index: int) -> None:
    producers = int(env("PRODUCERS"))
    ledger = Ledger.open(env("DATAFLOW_LEDGER"))
    store = open_store(env("STORE"))
    # A rank restart takes seconds: wait that long for credit before the ref is left to
    # the ledger (the ranks lease it from there).
    sender = ZmqRefSender(
        SenderConfig(endpoints=tuple(env("ENDPOINTS").split(",")), send_timeout=60)
    )
    producer = Producer(
        ledger, store, run_id=env("RUN"), producer_id=f"rollout-{index}", stream=sender
    )
    delay = float(env("PRODUCE_DELAY"))
    for sample_id in sample_ids(index, producers, int(env("SAMPLES"))):
        producer.emit(sample_id, features(sample_id))
        time.sleep(delay)  # stands in for the inference that makes a sample
    sender.close()  # the end of the stream first: every ref sent has reached the ranks
    producer.close()
    store.close()
    ledger.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
