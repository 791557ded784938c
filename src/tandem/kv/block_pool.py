"""A fixed pool of KV blocks with reference counts and a prefix cache of full blocks.

Free blocks wait in an LRU queue; a free block may still hold a cached prefix (it keeps its hash)
until it is handed out again, so a returning prompt can take it back for free. Eviction order is
least recently freed first; callers free a sequence's tail blocks before its head blocks, because
heads (system prompts, shared prefixes) are the ones worth keeping.

Copies to host memory wait for need (a write-back tier): a swapped-out block stays where it is with
a copy out registered (`defer_copy`); the copy falls due only when the block is handed out again or
its content changes (`take_due_copies`: the executor makes those copies before it computes), and
the owner that comes back first takes the block back without any copy (`take_back`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from tandem.kv.hashing import BlockHash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        self._copy_out: dict[int, list[int]] = {}      # block id -> host blocks its content is owed to
        self._due: list[tuple[int, int]] = []          # (block id, host block) copies to make now
        self.num_copies_deferred = 0
        self.num_copies_due = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take n free blocks (evicting their cached prefixes). Check `num_free_blocks` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._settle_copy(block)
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to cached blocks (taking them off the free queue if unreferenced); a
        reused block counts as recently cached again (`recent_hashes`)."""
        cached = self._cached
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            h = block.block_hash
            if h is not None and cached.get(h) is block:
                del cached[h]
                cached[h] = block               # to the end: most recent

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; pass them in eviction order (first evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its chained hash (first writer wins)."""
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is cached already; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def recent_hashes(self, n: int) -> list[BlockHash]:
        """The hashes of the `n` most recently cached or reused blocks, most recent first."""
        cached = self._cached                     # insertion order: oldest first
        return list(itertools.islice(reversed(cached), n))

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            block.block_hash = None
        self._cached.clear()

    def uncache(self, block: Block) -> None:
        """Withdraw a block from the prefix cache (its content no longer matches its hash)."""
        self._settle_copy(block)
        self._uncache(block)

    # --- copies out that wait for need ----------------------------------------------------
    def defer_copy(self, block: Block, host_block: int) -> None:
        """`block`'s content belongs in `host_block`; copy it only when the block is reused. A block
        shared by several requests (a common prefix) may owe its content to several host blocks."""
        self._copy_out.setdefault(block.block_id, []).append(host_block)
        self.num_copies_deferred += 1

    def take_back(self, block: Block, host_block: int) -> bool:
        """The owner of a deferred copy comes back: if its block still holds the content (not
        handed out since), reference it again and drop the copy; False if the copy was made."""
        if not self._drop_copy(block, host_block):
            return False
        self.touch([block])
        return True

    def cancel_copy(self, block: Block, host_block: int) -> None:
        """The host copy is not needed any more (its owner ended, or took its KV elsewhere), even
        if it fell due and no plan has taken it yet: the host block may take another copy now."""
        if not self._drop_copy(block, host_block) and (block.block_id, host_block) in self._due:
            self._due.remove((block.block_id, host_block))

    def _drop_copy(self, block: Block, host_block: int) -> bool:
        owed = self._copy_out.get(block.block_id)
        if not owed or host_block not in owed:
            return False
        owed.remove(host_block)
        if not owed:
            del self._copy_out[block.block_id]
        return True

    def take_due_copies(self) -> list[tuple[int, int]]:
        """(block, host block) copies that must happen before the next compute writes the blocks."""
        out, self._due = self._due, []
        return out

    def _settle_copy(self, block: Block) -> None:
        for host in self._copy_out.pop(block.block_id, ()):
            self._due.append((block.block_id, host))
            self.num_copies_due += 1

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.num_evictions += 1
            block.block_hash = None
