"""Mooncake's return codes, and their translation into the dataflow error tree.

:func:`_error` is the only place that maps a Mooncake code to a dataflow
error; every Mooncake call of the stores goes through it.
"""

from __future__ import annotations

from dataflow import (
    StaleRefError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)

OK, NOT_FOUND, ALREADY_EXISTS, BUFFER_TOO_SMALL, NOT_READY = 0, -704, -705, -600, -703
NO_AVAILABLE_HANDLE = -200
TRANSFER_FAIL = -800
# A read whose transfer outlasted the read lease it was granted: its bytes may be torn.
LEASE_EXPIRED = -707
# What a write of a key that another client is writing at the same moment gets.
_BUSY = {-601, -703, -714}
_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
_UNAVAILABLE = frozenset({-103, -800, -900, -901, -1010})
# What may pass once the master answers and has taken this client back (see _Client.call).
_TRANSIENT = _UNAVAILABLE | {NO_AVAILABLE_HANDLE}


def _error(code: int, what: str, *, mounted: bool | None = True) -> StoreError:
    """The dataflow error for a Mooncake return code. ``mounted``: whether the master
    listed this client's memory when it got the code (None: unknown; see _Client.call)."""
    name = f"{_NAMES.get(code, 'error')} ({code})"
    if code == NO_AVAILABLE_HANDLE and mounted is False:
        return StoreUnavailableError(
            f"{what}: Mooncake found no memory, {name}, and the master does not list this "
            "client's segment (or, for a client that mounts none, any segment): a master "
            "that restarted takes its clients back, and mounts their memory again, at their "
            "next heartbeat; check that the master runs, that this process reaches it, and "
            "that some process mounts memory (a store opened with segment_size > 0)"
        )
    if code == NO_AVAILABLE_HANDLE:
        unknown = (
            " (the master's HTTP server, admin=, did not answer, so it is unknown whether "
            "this is a master that restarted and has not taken this client back yet)"
            if mounted is None
            else ""
        )
        return StoreFullError(
            f"{what}: Mooncake has no space left, {name}{unknown}; delete released samples "
            "or mount larger segments (segment_size), and check that some process mounts "
            "memory (a store opened with segment_size > 0)"
        )
    if code in _UNAVAILABLE:
        return StoreUnavailableError(
            f"{what}: Mooncake is unreachable or not ready, {name}; check that the master "
            "runs and that this process reaches it"
        )
    if code == NOT_FOUND:
        return StaleRefError(f"{what}: {name}")
    return StoreError(f"{what} failed: {name}")
