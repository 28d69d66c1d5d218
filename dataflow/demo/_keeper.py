"""A demo process that lends a Mooncake store its memory for the whole run.

Mooncake keeps an object in the memory a client lends the cluster (its segment), and a
SIGKILLed rank's segment goes with it, features and all. So the producers and ranks lend
none, and this process, which nobody kills, holds the segment until the demo ends.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from stores import open_store


def main(config: dict, ready: str) -> None:
    """Open the store with a segment, say so (the file ``ready``), hold it until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    store = open_store(config["lender_store_uri"])
    try:
        Path(ready).touch()
        while True:
            time.sleep(3600)
    finally:
        store.close()
