"""Chained block hashes for prefix caching.

The hash of block i covers all tokens of blocks 0..i (it includes the parent's hash), so equal
hashes mean equal prefixes. SHA-256 makes an accidental collision (which would silently serve
another prompt's KV) practically impossible; it costs about a microsecond per block.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
ROOT_HASH: BlockHash = b"tandem-kv-root"


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_hash(salt: str | None) -> BlockHash:
    """The parent of a request's first block: salted requests (vLLM's `cache_salt`) share cached
    blocks only with requests of the same salt."""
    return ROOT_HASH if salt is None else hashlib.sha256(ROOT_HASH + salt.encode()).digest()


def hash_full_blocks(token_ids: list[int], block_size: int, known: list[BlockHash] | None = None,
                     limit_tokens: int | None = None, root: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (up to `limit_tokens`), extending `known` in place."""
    hashes = known if known is not None else []
    n = len(token_ids) if limit_tokens is None else min(limit_tokens, len(token_ids))
    for i in range(len(hashes), n // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
