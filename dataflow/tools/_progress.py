"""The progress hook of the long reads: called with the seq reached every few thousand events."""

from __future__ import annotations

from collections.abc import Callable

#: A progress bar's hook: called with the seq a read has reached.
Progress = Callable[[int], None]
#: Rows read between two calls of a Progress hook.
PROGRESS_EVERY = 4096
