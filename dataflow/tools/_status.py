"""What ``dataflow status`` shows of a live run: in-flight work, lag and rates."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dataflow.model._events import Kind
from dataflow.tools._run_fold import RunFold
from dataflow.tools._times import iso_time


def status(fold: RunFold, now: float) -> dict[str, Any]:
    """In-flight work per consumer and producer, lag and rates, from a RunFold with a window."""
    state = fold.state
    window = fold.window or 0.0
    recent = fold.rates(now)

    def per_s(kind: str, actor: str | None = None) -> float:
        hits = sum(n for (k, a), n in recent.items() if k == kind and actor in (None, a))
        return round(hits / window, 3) if window else 0.0

    leased_by = Counter(state.leased.values())
    consumers = sorted(
        {a for (k, a, e) in fold.counts if e == state.epoch and k in Kind.FENCED} | set(leased_by)
    )
    committed = len(state.committed)
    return {
        "run_id": state.run_id,
        "events": fold.events,
        "head_seq": state.head_seq,
        "epoch": state.epoch,
        "world_size": state.world_size,
        "last_event": iso_time(fold.last_ts) if fold.last_ts is not None else None,
        "idle_s": round(now - fold.last_ts, 3) if fold.last_ts is not None else None,
        "committed": committed,
        "pending": len(state.pending),
        "leased": len(state.leased),
        "trained": len(state.trained),
        "regenerate": len(state.regenerate),
        "lost": len(state.lost),
        "dead": len(state.dead),
        "released": len(state.released),
        "lag": committed - len(state.trained) - len(state.dead),
        "producers_done": state.producers_done,
        "stores": list(state.store_uris),
        "window_s": window,
        "rates": {
            "commits_per_s": per_s(Kind.COMMIT),
            "leases_per_s": per_s(Kind.LEASE),
            "acks_per_s": per_s(Kind.ACK),
        },
        "pending_per_rank": [state.pending_count(rank) for rank in range(state.world_size)],
        "producers": {
            pid: {
                "committed": sum(
                    n for (k, a, _e), n in fold.counts.items() if k == Kind.COMMIT and a == pid
                ),
                "closed": pid in state.closed,
                "epoch": state.producer_epochs.get(pid, 0),
                "commits_per_s": per_s(Kind.COMMIT, pid),
            }
            for pid in sorted(state.producers | state.closed)
        },
        "consumers": {
            cid: {
                "leased": leased_by[cid],
                "acked": fold.counts[Kind.ACK, cid, state.epoch],
                "last_step": state.last_ack_step(cid),
                "acks_per_s": per_s(Kind.ACK, cid),
            }
            for cid in consumers
        },
    }
