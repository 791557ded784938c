"""What a replica reports to the router (`record_routing_stats`): its load, its tool pauses and
what its prefix cache holds, in the fields of `tandem.router.ReplicaStats`.

Read from the engine's scheduler by another thread than the engine's (Ray Serve calls
`record_routing_stats` on the replica's event loop): every figure is a read of plain Python
containers; a container changing size under the copy raises RuntimeError, and the read is retried.
"""

from __future__ import annotations

import itertools
from typing import Any



def _attempt(engine: Any, replica_id: str, spec_last: tuple[int, int] | None) -> dict[str, Any]:
    from tandem.router import DIGEST_SIZE, digest_of

    sched = engine.scheduler
    kv = sched.kv
    waiting = list(sched.waiting)
    running = list(sched.running)
    # Tokens still to prefill: whole prompts of the waiting requests, the rest of running prefills.
    waiting_tokens = sum(max(0, len(r.token_ids) - r.num_computed_tokens) for r in waiting)
    waiting_tokens += sum(max(0, len(r.token_ids) - r.num_computed_tokens - 1) for r in running)
    paused_kv_tokens = sched.pauses.num_held_blocks * kv.block_size
    spec = sched.spec_stats
    steps, drafted = spec.num_steps, spec.num_draft_tokens
    if spec_last is not None and steps > spec_last[0]:        # since the last report
        avg_draft = (drafted - spec_last[1]) / (steps - spec_last[0])
    else:
        avg_draft = drafted / steps if steps else 0.0
    cached = kv.pool._cached                                   # chained block hash -> block, oldest first
    n = len(cached)
    recent = list(itertools.islice(iter(cached), max(0, n - 2 * DIGEST_SIZE), None)) if kv.enable_prefix_caching else []
    return {"replica_id": replica_id, "waiting_tokens": int(waiting_tokens), "running_requests": len(running),
            "kv_usage": float(kv.usage), "paused_kv_tokens": int(paused_kv_tokens), "avg_draft_len": float(avg_draft),
            "prefix_digest": digest_of(reversed(recent), DIGEST_SIZE),      # most recently cached first
            "max_num_seqs": int(sched.config.max_num_seqs), "waiting_requests": len(waiting),
            "_spec": (steps, drafted)}


def routing_stats(engine: Any, replica_id: str, spec_last: tuple[int, int] | None = None) -> dict[str, Any]:
    """The replica's ReplicaStats fields as a dict (plus "_spec", the speculation counters the next
    call's average starts from)."""
    for _ in range(5):
        try:
            return _attempt(engine, replica_id, spec_last)
        except RuntimeError:                       # a container changed size under the copy: read again
            continue
    return _attempt(engine, replica_id, spec_last)
