"""What a replica reports to the router (`record_routing_stats`): its load, its tool pauses and
what its prefix cache holds, in the fields of `tandem.router.ReplicaStats`.

Read from the engine's scheduler by another thread than the engine's (Ray Serve calls
`record_routing_stats` on the replica's event loop): every figure is a read of plain Python
containers; a container changing size under the copy raises RuntimeError, and the read is retried.
"""

from __future__ import annotations

from typing import Any


def scheduler_routing_stats(sched: Any, replica_id: str, spec_last: tuple[int, int] | None = None,
                            digest: frozenset[int] | None = None) -> dict[str, Any]:
    """What a scheduler tells the router, as ReplicaStats fields (plus "_spec"). The Ray replica
    and the simulator's replicas (sim/cluster.py) both report through this. `digest`: the prefix
    digest if the caller keeps one (the simulator's DigestPool, the same set maintained
    incrementally); otherwise it is built from the KV manager's recent block hashes."""
    from tandem.router import DIGEST_SIZE, digest_of

    st = sched.stats()
    steps, drafted = st.spec_num_drafts, st.spec_num_draft_tokens
    if spec_last is not None and steps > spec_last[0]:        # since the last report
        avg_draft = (drafted - spec_last[1]) / (steps - spec_last[0])
    else:
        avg_draft = drafted / steps if steps else 0.0
    if digest is None:
        digest = digest_of(sched.recent_prefix_hashes(2 * DIGEST_SIZE), DIGEST_SIZE)  # most recent first
    return {"replica_id": replica_id, "waiting_tokens": sched.pending_prefill_tokens(),
            "running_requests": st.num_running, "kv_usage": float(st.kv_usage),
            "paused_kv_tokens": int(st.num_paused_kv_tokens), "avg_draft_len": float(avg_draft),
            "prefix_digest": digest, "max_num_seqs": int(sched.config.max_num_seqs),
            "waiting_requests": st.num_waiting, "_spec": (steps, drafted)}


def routing_stats(engine: Any, replica_id: str, spec_last: tuple[int, int] | None = None) -> dict[str, Any]:
    """The replica's ReplicaStats fields as a dict (plus "_spec", the speculation counters the next
    call's average starts from)."""
    for _ in range(5):
        try:
            return scheduler_routing_stats(engine.scheduler, replica_id, spec_last)
        except RuntimeError:                       # a container changed size under the copy: read again
            continue
    return scheduler_routing_stats(engine.scheduler, replica_id, spec_last)
