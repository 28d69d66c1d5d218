"""Calls the loader makes again while they fail for a reason that passes: a store's server
restarting (``unavailable_timeout``), the ledger unreachable (``ledger_timeout``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dataflow import LedgerFilesReplacedError, OperationalError

#: The first and the longest pause between tries.
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0
log = logging.getLogger("training")
T = TypeVar("T")


def patiently(
    attempt: Callable[[], T],
    *,
    passing: type[BaseException] | tuple[type[BaseException], ...],
    patience: float,
    warning: Callable[[BaseException], str],
    note: Callable[[], str],
    lasting: tuple[type[BaseException], ...] = (),
) -> T:
    """``attempt()``, again while it raises one of ``passing`` (and not of ``lasting``), for
    up to ``patience`` seconds from the first failure; with pauses from 0.1 s up to 2 s, a
    logged warning at the first failure, and the error raised at the end with a note.

    ``warning(exc)`` is what the log says at the first failure; ``note()``, what the
    error raised at the end gets added (both built only on a failure: the attempt is on
    the loader's hot path). ``patience`` 0 raises at once.
    """
    deadline: float | None = None
    pause = RETRY_FIRST_S
    while True:
        try:
            return attempt()
        except passing as exc:
            if isinstance(exc, lasting):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + patience
                if patience > 0:
                    log.warning("%s", warning(exc))
            if now >= deadline:
                if patience > 0:
                    exc.add_note(note())
                raise
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, RETRY_MAX_S)


class LedgerPatience:
    """The loader's ledger calls (a part of ``FeatureLoader``): each made again while it
    fails with ``OperationalError``, the same call, as docs/reliability.md says to, for up
    to ``LoaderConfig.ledger_timeout`` seconds. A call in doubt (``CommitOutcomeUnknownError``)
    is settled by that same call; ledger files replaced under the process are not retried."""

    consumer: Any
    config: Any

    def _ledger(self, call: Callable[..., T], *args: Any, **kw: Any) -> T:
        patience = self.config.ledger_timeout

        def what() -> str:
            return f"{call.__name__}() of consumer {self.consumer.consumer_id!r}"

        return patiently(
            lambda: call(*args, **kw),
            passing=OperationalError,
            lasting=(LedgerFilesReplacedError,),
            patience=patience,
            warning=lambda exc: (
                f"{what()} failed ({exc}); making it again for up to "
                f"{patience:g}s (LoaderConfig.ledger_timeout)"
            ),
            note=lambda: (
                f"the loader made {what()} again for {patience:g}s "
                "(LoaderConfig.ledger_timeout) and the ledger did not take it"
            ),
        )
