"""What a ledger's write transactions were for, recorded in the order they began."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dataflow import Ledger


def record_writes(ledger: Ledger) -> list[str]:
    """Wrap this ``ledger``'s ``write``; the returned list gets each write's ``what``."""
    seen: list[str] = []
    write = ledger.write

    @contextlib.contextmanager
    def recorded(run_id: str, what: str, **options: bool) -> Iterator[object]:
        seen.append(what)
        with write(run_id, what, **options) as tx:
            yield tx

    ledger.write = recorded  # type: ignore[method-assign]
    return seen
