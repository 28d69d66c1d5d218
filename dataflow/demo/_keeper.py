"""A demo process that lends a Mooncake store its memory for the whole run.

Mooncake keeps an object in the memory a client lends the cluster (its segment), and a
SIGKILLed rank's segment goes with it, features and all. So the producers and ranks lend
none, and this process, which nobody kills, holds the segment until the demo ends: what
``dataflow mooncake-keeper`` does (``stores.lend_memory``).
"""

from __future__ import annotations

from pathlib import Path

from stores import lend_memory


def main(config: dict, ready: str) -> None:
    """Open the store with a segment, say so (the file ``ready``), hold it until SIGTERM."""
    lend_memory(config["lender_store_uri"], ready=lambda _store: Path(ready).touch())
