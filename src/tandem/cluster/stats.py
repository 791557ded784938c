"""What a replica reports to the router (`record_routing_stats`): its load, its tool pauses and
what its prefix cache holds, in the fields of `tandem.router.ReplicaStats`.

Read from the engine's scheduler by another thread than the engine's (Ray Serve calls
`record_routing_stats` on the replica's event loop): every figure is a read of plain Python
containers; a container changing size under the copy raises RuntimeError, and the read is retried.
"""

from __future__ import annotations

from typing import Any


def _attempt(engine: Any, replica_id: str, spec_last: tuple[int, int] | None) -> dict[str, Any]:
    from tandem.router import DIGEST_SIZE, digest_of

    sched = engine.scheduler
    st = sched.stats()
    steps, drafted = st.spec_num_drafts, st.spec_num_draft_tokens
    if spec_last is not None and steps > spec_last[0]:        # since the last report
        avg_draft = (drafted - spec_last[1]) / (steps - spec_last[0])
    else:
        avg_draft = drafted / steps if steps else 0.0
    recent = sched.recent_prefix_hashes(2 * DIGEST_SIZE)       # most recently cached first
    return {"replica_id": replica_id, "waiting_tokens": sched.pending_prefill_tokens(),
            "running_requests": st.num_running, "kv_usage": float(st.kv_usage),
            "paused_kv_tokens": int(st.num_paused_kv_tokens), "avg_draft_len": float(avg_draft),
            "prefix_digest": digest_of(recent, DIGEST_SIZE), "max_num_seqs": int(sched.config.max_num_seqs),
            "waiting_requests": st.num_waiting, "_spec": (steps, drafted)}


def routing_stats(engine: Any, replica_id: str, spec_last: tuple[int, int] | None = None) -> dict[str, Any]:
    """The replica's ReplicaStats fields as a dict (plus "_spec", the speculation counters the next
    call's average starts from)."""
    for _ in range(5):
        try:
            return _attempt(engine, replica_id, spec_last)
        except RuntimeError:                       # a container changed size under the copy: read again
            continue
    return _attempt(engine, replica_id, spec_last)
