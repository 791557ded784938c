"""Per-request block tables over a `BlockPool`, with prefix caching (check/act pairs).

The scheduler asks `get_computed_blocks` (prefix-cache hit), then `can_allocate` / `allocate`
for the tokens it wants to compute; `free` returns a request's blocks. Full blocks whose tokens
are known are published to the prefix cache as soon as they are allocated: the runner writes a
step's KV before any attention of that step reads it, so a request admitted in the same step may
already share them.
"""

from __future__ import annotations

from tandem.kv.block_pool import Block, BlockPool
from tandem.kv.hashing import BlockHash, hash_full_blocks, root_hash
from tandem.types import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, pool: BlockPool | None = None) -> None:
        """`pool`: a BlockPool of `num_blocks` blocks to use (a subclass that also keeps a digest,
        as the simulated cluster's replicas do); None: a plain one."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if pool is not None and len(pool.blocks) != num_blocks:
            raise ValueError(f"the pool holds {len(pool.blocks)} blocks, not {num_blocks}")
        self.block_size = block_size
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        # Host (swap) space: plain free list; swapped requests keep their host block ids here.
        self.num_host_blocks = num_host_blocks
        self._free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_released: list[int] = []     # freed by swap-in: reusable from the next step on
        self._swapped: dict[str, list[int]] = {}
        self._parked: dict[str, list[Block]] = {}   # a swapped request's device blocks, beside _swapped
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[Block]] = {}
        self._ids: dict[str, list[int]] = {}       # the same tables as block ids (read every step)
        self._num_published: dict[str, int] = {}   # leading blocks already offered to the cache
        # Counters (prefix-cache effectiveness): tokens asked for vs served from the cache.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # --- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        ids = self._ids.get(request_id)
        return list(ids) if ids else []

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix cache --------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request, in full blocks; at least one token stays to compute."""
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        hits = self._cached_prefix(self._hash(request), (request.num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    # --- check / act ---------------------------------------------------------------------
    def num_blocks_to_take(self, request: Request, num_new_tokens: int, computed_blocks: list[Block] = ()) -> int:
        """Free blocks an `allocate` with these arguments would consume."""
        table = self._blocks.get(request.request_id, ())
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        new_blocks = max(0, self.blocks_needed(total) - len(table) - len(computed_blocks))
        if not computed_blocks:           # the common case (every decode step): skip the scan
            return new_blocks
        # Cached blocks nobody references sit in the free queue: taking them uses free capacity.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return new_blocks + revived

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[Block] = ()) -> bool:
        return self.num_blocks_to_take(request, num_new_tokens, computed_blocks) <= self.pool.num_free_blocks

    def try_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """`allocate(request, num_new_tokens)` if the blocks are free (True), else nothing (False):
        the check and the act in one call, for the scheduler's per-request, per-step path. A
        decode step that fits in the request's last block takes no block at all."""
        table = self._blocks.get(request.request_id)
        total = request.num_computed_tokens + num_new_tokens
        if table and total <= len(table) * self.block_size:
            self._cache_full_blocks(request, total)
            return True
        if not self.can_allocate(request, num_new_tokens):
            return False
        self.allocate(request, num_new_tokens)
        return True

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[Block] = ()) -> None:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` (a prefix-cache hit from `get_computed_blocks`, for a request that holds no
        blocks yet) join the table first and count as computed tokens before the new ones; the
        caller then advances `num_computed_tokens` past them.
        """
        rid = request.request_id
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(f"not enough free KV blocks for request {rid}")
        table = self._blocks.setdefault(rid, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(table) - len(computed_blocks)
        ids = self._ids.setdefault(rid, [])
        if not table:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += len(computed_blocks) * self.block_size
        if computed_blocks:
            assert not table, "computed blocks join only an empty block table"
            self.pool.touch(list(computed_blocks))
            table.extend(computed_blocks)
            ids.extend(b.block_id for b in computed_blocks)
        if num_new_blocks > 0:
            new = self.pool.get_new_blocks(num_new_blocks)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        self._cache_full_blocks(request, total)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (tail first, so shared heads are evicted last)."""
        self.drop_swapped(request)
        table = self._blocks.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if table:
            self.pool.free(list(reversed(table)))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the KV of the first `num_tokens` tokens (speculation rollback).

        Blocks past them are freed; a kept block that is no longer full stops being a cached prefix
        (its hash named tokens that were rolled back), and will be published again once refilled.
        """
        rid = request.request_id
        table = self._blocks.get(rid)
        if not table:
            return
        keep, full = self.blocks_needed(num_tokens), num_tokens // self.block_size
        for block in table[full:keep]:
            self.pool.uncache(block)
        del self._known_hashes(request)[full:]
        self._num_published[rid] = min(self._num_published.get(rid, 0), full)
        if keep < len(table):
            dropped = table[keep:]
            del table[keep:]
            del self._ids[rid][keep:]
            self.pool.free(list(reversed(dropped)))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def recent_block_hashes(self, n: int) -> list[BlockHash]:
        """Hashes of the `n` blocks most recently published to the prefix cache or reused from it,
        most recent first (none without prefix caching): what a router's prefix digest is made of."""
        return self.pool.recent_hashes(n) if self.enable_prefix_caching else []

    def transfer(self, src: Request, dst: Request, num_tokens: int) -> int:
        """Hand the KV of `src`'s first `num_tokens` tokens (which `dst` starts with) to `dst`, which
        holds none, in whole blocks and where it lies: device blocks, or host copies that `swap_in`
        brings back. `src` keeps nothing (the rest is freed). Returns the tokens `dst` now has."""
        rid, bs = dst.request_id, self.block_size
        if rid in self._blocks or rid in self._swapped:
            raise ValueError(f"request {rid!r} already holds KV")
        keep = num_tokens // bs
        if src.request_id in self._swapped:
            keep = min(keep, len(self._swapped[src.request_id]))
            self._release_host(src.request_id, keep)
            if keep:
                self._swapped[rid] = self._swapped.pop(src.request_id)
                self._parked[rid] = self._parked.pop(src.request_id)
            return keep * bs
        table = self._blocks.pop(src.request_id, None) or []
        ids = self._ids.pop(src.request_id, None) or []
        published = self._num_published.pop(src.request_id, 0)
        keep = min(keep, len(table))
        if keep:
            self._blocks[rid], self._ids[rid] = table[:keep], ids[:keep]
            self._num_published[rid] = min(published, keep)
        if table[keep:]:
            self.pool.free(list(reversed(table[keep:])))
        return keep * bs

    # --- swapping (tool pauses) ----------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def can_swap_out(self, request: Request) -> bool:
        return 0 < self.num_blocks_of(request.request_id) <= len(self._free_host)

    def swap_out(self, request: Request) -> None:
        """Move the request's blocks to host memory, lazily: host blocks are reserved, and the
        device blocks are released with their copies deferred (BlockPool: a block's copy is made
        when the block is handed out again, in the plan of the step that reuses it). Until then
        a cached prefix among them stays cached, and `swap_in` takes back what was not reused."""
        rid = request.request_id
        table = self._blocks.pop(rid)
        self._ids.pop(rid, None)
        host = [self._free_host.pop() for _ in table]
        for block, h in zip(table, host):
            self.pool.defer_copy(block, h)
        self._swapped[rid] = host
        self._parked[rid] = table
        self._num_published.pop(rid, None)
        self.pool.free(list(reversed(table)))

    def take_due_copies(self) -> list[tuple[int, int]]:
        """(device block, host block) copies the next step must make before it computes."""
        return self.pool.take_due_copies()

    def can_swap_in(self, request: Request) -> bool:
        return len(self._swapped.get(request.request_id, ())) <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back: its device blocks that nobody reused, as they are, and new
        ones for the rest, with the (host block, device block) copies to make."""
        rid = request.request_id
        host = self._swapped.pop(rid)
        parked = self._parked.pop(rid)
        kept = [self.pool.take_back(b, h) for b, h in zip(parked, host)]
        new = iter(self.pool.get_new_blocks(kept.count(False)))
        blocks = [b if k else next(new) for b, k in zip(parked, kept)]
        self._blocks[rid] = blocks
        self._ids[rid] = [b.block_id for b in blocks]
        # The copy back happens during this step: its host blocks must not take a copy out now.
        self._host_released.extend(reversed(host))
        self._cache_full_blocks(request, request.num_computed_tokens)
        return [(h, b.block_id) for h, b, k in zip(host, blocks, kept) if not k]

    def drop_swapped_if_cached(self, request: Request) -> bool:
        """Host memory is the second tier: a swap-out leaves the device blocks in the prefix cache
        until something reuses them. If every full block of a swapped request's context is still
        there, forget the host copy (its blocks are reusable after this step, as after a swap-in)
        and return True: the request takes its context from the prefix cache like a new one,
        without the copy back (the caller resets its computed tokens). False: swap it in."""
        host = self._swapped.get(request.request_id)
        if not host or not self.enable_prefix_caching:
            return False
        full = request.num_computed_tokens // self.block_size
        if len(self._cached_prefix(self._hash(request, full * self.block_size), full)) < full:
            return False
        self._release_host(request.request_id)
        return True

    def end_step(self) -> None:
        """Host blocks released by this step's swap-ins become reusable."""
        self._free_host.extend(self._host_released)
        self._host_released.clear()

    def drop_swapped(self, request: Request) -> None:
        """Forget a swapped request's host copy (aborted while paused, or ended): free at once."""
        self._release_host(request.request_id, at_once=True)

    def _release_host(self, rid: str, keep: int = 0, at_once: bool = False) -> None:
        """Free the host blocks of swapped request `rid` past its first `keep`, and cancel their
        copies out. Not `at_once`: from the next step on (this step may read them: a copy back)."""
        host, parked = self._swapped.pop(rid, None), self._parked.pop(rid, None)
        if host is None:
            return
        for b, h in zip(parked[keep:], host[keep:]):
            self.pool.cancel_copy(b, h)
        (self._free_host if at_once else self._host_released).extend(reversed(host[keep:]))
        if keep:
            self._swapped[rid], self._parked[rid] = host[:keep], parked[:keep]

    # --- internals -----------------------------------------------------------------------
    def _cached_prefix(self, hashes: list[BlockHash], max_blocks: int) -> list[Block]:
        """The cached blocks of the longest prefix of `hashes` (at most `max_blocks`)."""
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _hash(self, request: Request, limit_tokens: int | None = None) -> list[BlockHash]:
        return hash_full_blocks(request.token_ids, self.block_size, self._known_hashes(request), limit_tokens,
                                root_hash(request.session.cache_salt))

    @staticmethod
    def _known_hashes(request: Request) -> list[BlockHash]:
        """The request's block hashes computed so far. Kept on the request, not here: its tokens only
        grow, so they stay valid when its KV is freed and recomputed (after a discard or a
        preemption, which would otherwise re-hash the whole context) and go away with it."""
        return request.block_hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_published.get(rid, 0)
        if num_tokens // self.block_size <= start:    # no new full block (most steps): nothing to hash
            return
        table = self._blocks[rid]
        hashes = self._hash(request, num_tokens)
        end = min(len(hashes), len(table), num_tokens // self.block_size)
        for i in range(start, end):
            self.pool.cache(table[i], hashes[i])
        self._num_published[rid] = max(start, end)
