"""KV-cache bookkeeping (mechanism only, no torch, no clock): blocks, ref counts, prefix hashing."""

from tandem.kv.block_pool import Block, BlockPool
from tandem.kv.manager import KVCacheManager

__all__ = ["Block", "BlockPool", "KVCacheManager"]
