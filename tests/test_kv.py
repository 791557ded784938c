"""KV-cache bookkeeping: BlockPool ref counts and LRU free queue, KVCacheManager block tables and
prefix caching (chained hashes, revived blocks, eviction order, truncation). Pure Python, no torch."""

from __future__ import annotations

import pytest

from tandem.kv import BlockPool, KVCacheManager
from tandem.kv.hashing import ROOT_HASH, hash_block
from tandem.sampling_params import SamplingParams
from tandem.types import Request

BS = 4  # block size used throughout


def req(rid: str, tokens, max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler: take the cached prefix, allocate the rest, mark it computed."""
    computed, num_cached = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_cached
    kv.allocate(request, num_new, computed)         # the cached blocks count before the new tokens
    request.num_computed_tokens = num_cached + num_new
    return num_cached


def decode(kv: KVCacheManager, request: Request, token: int) -> None:
    """Append a sampled token and allocate room for computing it (one decode step)."""
    request.token_ids.append(token)
    kv.allocate(request, 1)
    request.num_computed_tokens += 1


def blocks(kv: KVCacheManager, rid: str):
    return [kv.pool.blocks[i] for i in kv.block_ids(rid)]


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


# --- BlockPool ---------------------------------------------------------------------------------
def test_pool_get_and_free_keep_ref_counts():
    """New blocks have ref_cnt 1 and leave the free queue; free drops them back to 0 and returns them."""
    pool = BlockPool(5)
    got = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 3
    pool.free(got)
    assert [b.ref_cnt for b in got] == [0, 0, 0]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0


def test_pool_double_free_raises():
    """Freeing a block with no references is an error, not a silent negative count."""
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2


def test_pool_overdraw_raises_and_rejects_bad_size():
    """Asking for more blocks than are free fails without taking any; a pool needs >= 1 block."""
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_touch_shares_and_revives():
    """touch() adds a reference; a free (ref 0) cached block is taken off the free queue."""
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free([b])
    pool.free([b])
    assert pool.num_free_blocks == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2


def test_pool_cache_first_writer_wins_and_eviction_uncaches():
    """A hash maps to the first block published under it; reusing that block evicts the entry."""
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    pool.cache(a, h)
    pool.cache(b, h)
    assert pool.lookup(h) is a and b.block_hash is None
    pool.free([a, b])
    pool.get_new_blocks(1)                          # a was freed first: it is reused first
    assert pool.lookup(h) is None and a.block_hash is None and pool.num_evictions == 1


# --- KVCacheManager: allocation ----------------------------------------------------------------
def test_allocate_grows_block_table_by_token_count():
    """A 10-token prompt takes 3 blocks; decodes add a block only when crossing a block boundary."""
    kv = KVCacheManager(16, BS)
    r = req("r", range(10))
    admit(kv, r)
    assert kv.num_blocks_of("r") == 3
    decode(kv, r, 50)   # token 10 -> still block 2
    decode(kv, r, 51)   # token 11 -> still block 2
    assert kv.num_blocks_of("r") == 3
    decode(kv, r, 52)   # token 12 -> block 3
    assert kv.num_blocks_of("r") == 4
    assert kv.num_free_blocks == 12
    assert all(b.ref_cnt == 1 for b in blocks(kv, "r"))


def test_free_every_request_leaks_no_blocks():
    """After allocating, decoding and freeing several requests, every block is free again."""
    kv = KVCacheManager(32, BS)
    reqs = [req(f"r{i}", range(i * 100, i * 100 + n)) for i, n in enumerate([1, 4, 7, 13, 16])]
    for r in reqs:
        admit(kv, r)
    for step in range(6):
        for r in reqs:
            decode(kv, r, 900 + step)
    assert kv.num_free_blocks == 32 - sum(kv.num_blocks_of(r.request_id) for r in reqs)
    for r in reqs:
        kv.free(r)
        assert kv.num_blocks_of(r.request_id) == 0
    assert_all_free(kv)
    kv.free(reqs[0])                                # freeing an already-freed request is a no-op
    assert_all_free(kv)


def test_allocate_beyond_capacity_is_refused():
    """can_allocate says no and allocate raises when the pool cannot hold the tokens."""
    kv = KVCacheManager(2, BS)
    r = req("r", range(9))                          # needs 3 blocks
    assert not kv.can_allocate(r, 9)
    with pytest.raises(RuntimeError):
        kv.allocate(r, 9)
    assert_all_free(kv)


# --- prefix caching ----------------------------------------------------------------------------
def test_shared_two_block_prefix_hits_and_shares_blocks():
    """The second request with the same 2 full blocks gets them from the cache, shared (ref 2)."""
    kv = KVCacheManager(16, BS)
    prefix = list(range(10, 18))
    a, b = req("a", prefix + [1, 2, 3]), req("b", prefix + [7, 8])
    admit(kv, a)
    computed, n = kv.get_computed_blocks(b)
    assert n == 2 * BS
    assert [x.block_id for x in computed] == kv.block_ids("a")[:2]
    free_before = kv.num_free_blocks
    admit(kv, b)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert [x.ref_cnt for x in blocks(kv, "b")] == [2, 2, 1]
    assert kv.num_free_blocks == free_before - 1   # only the tail block is new
    kv.free(a)
    assert [x.ref_cnt for x in blocks(kv, "b")] == [1, 1, 1]
    kv.free(b)
    assert_all_free(kv)


def test_recent_block_hashes_are_the_last_published_most_recent_first():
    """A router's prefix digest reads these: the full blocks' chained hashes, newest first, none
    without prefix caching."""
    kv = KVCacheManager(16, BS)
    a, b = req("a", range(10, 22)), req("b", range(40, 48))       # 3 and 2 full blocks
    admit(kv, a)
    admit(kv, b)
    newest = [blk.block_hash for blk in reversed(blocks(kv, "b"))] + [blocks(kv, "a")[-1].block_hash]
    assert kv.recent_block_hashes(3) == newest and None not in newest
    assert len(kv.recent_block_hashes(99)) == 5
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    admit(off, req("a", range(10, 22)))
    assert off.recent_block_hashes(3) == []


@pytest.mark.parametrize("length, expected_hit", [(8, 4), (9, 8), (12, 8)])
def test_fully_cached_prompt_leaves_a_token_to_compute(length, expected_hit):
    """Even if the whole prompt is cached, at most num_tokens-1 tokens (in full blocks) are hits."""
    kv = KVCacheManager(16, BS)
    tokens = list(range(30, 30 + length))
    admit(kv, req("a", tokens))
    _, n = kv.get_computed_blocks(req("b", tokens))
    assert n == expected_hit
    assert n < length


def test_different_prefixes_do_not_hit():
    """A different first block gives no hit; a different second block stops the hit after one."""
    kv = KVCacheManager(16, BS)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.get_computed_blocks(req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))[1] == BS


def test_hashes_are_chained_over_the_parent():
    """The same block content after a different parent block is not a hit."""
    kv = KVCacheManager(16, BS)
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    admit(kv, req("a", x + y + [9]))
    computed, n = kv.get_computed_blocks(req("b", z + y + [9]))
    assert (computed, n) == ([], 0)
    computed, n = kv.get_computed_blocks(req("c", y + [9]))   # y at position 0: also a miss
    assert (computed, n) == ([], 0)


def test_prefix_caching_disabled_never_hits():
    """With prefix caching off, identical prompts are computed again and nothing is published."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    admit(kv, req("a", range(12)))
    assert kv.get_computed_blocks(req("b", range(12))) == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)


def test_freed_cached_blocks_are_revived():
    """Freed blocks keep their prefix until evicted: a later identical prefix takes them back."""
    kv = KVCacheManager(8, BS)
    a = req("a", range(12))
    admit(kv, a)
    a_ids = kv.block_ids("a")
    kv.free(a)
    assert_all_free(kv)
    b = req("b", list(range(12)) + [99])
    assert admit(kv, b) == 12
    assert kv.block_ids("b")[:3] == a_ids
    assert [x.ref_cnt for x in blocks(kv, "b")] == [1, 1, 1, 1]
    assert kv.num_free_blocks == 4


def test_eviction_least_recently_freed_first_and_tail_before_head():
    """Blocks of the request freed first are evicted first, and within it the tail goes first."""
    kv = KVCacheManager(6, BS)
    a, b = req("a", range(0, 12)), req("b", range(100, 112))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)

    probes = iter(range(100))

    def hits(tokens):   # a fresh request id each time: the manager memoizes hashes per request id
        return kv.get_computed_blocks(req(f"probe{next(probes)}", list(tokens) + [999]))[1] // BS

    assert (hits(range(0, 12)), hits(range(100, 112))) == (3, 3)
    admit(kv, req("c1", range(200, 204)))          # one new block: evicts a's tail
    assert (hits(range(0, 12)), hits(range(100, 112))) == (2, 3)
    admit(kv, req("c2", range(300, 304)))          # then a's middle block
    assert (hits(range(0, 12)), hits(range(100, 112))) == (1, 3)
    admit(kv, req("c3", range(400, 408)))          # then a's head, then b's tail
    assert (hits(range(0, 12)), hits(range(100, 112))) == (0, 2)
    assert kv.pool.num_evictions == 4


def test_can_allocate_counts_revived_free_blocks():
    """Cached blocks with ref_cnt 0 sit in the free queue, so reviving them uses free capacity."""
    kv = KVCacheManager(3, BS)
    prefix = list(range(8))
    a = req("a", prefix)
    admit(kv, a)
    kv.free(a)                                      # both blocks cached, ref 0, in the free queue
    admit(kv, req("d", [50]))                       # takes the one uncached free block
    assert kv.num_free_blocks == 2
    b = req("b", prefix + [1, 2, 3, 4])
    computed, n = kv.get_computed_blocks(b)
    assert n == 8 and all(x.ref_cnt == 0 for x in computed)
    assert not kv.can_allocate(b, 4, computed)      # 2 revived + 1 new > 2 free
    with pytest.raises(RuntimeError):
        kv.allocate(b, 4, computed)
    assert kv.num_free_blocks == 2 and all(x.ref_cnt == 0 for x in computed)
    assert kv.can_allocate(b, 0, computed)          # reviving the 2 cached blocks alone fits


def test_can_allocate_does_not_count_referenced_shared_blocks():
    """Cached blocks that another request holds cost nothing to share: only new blocks count."""
    kv = KVCacheManager(4, BS)
    prefix = list(range(8))
    admit(kv, req("a", prefix + [5]))               # holds 3 blocks, 2 of them cached
    assert kv.num_free_blocks == 1
    b = req("b", prefix + [7])
    computed, n = kv.get_computed_blocks(b)
    assert n == 8 and all(x.ref_cnt == 1 for x in computed)
    assert kv.can_allocate(b, 1, computed)          # 2 shared blocks + 1 new block <= 1 free
    kv.allocate(b, 1, computed)
    assert kv.num_free_blocks == 0 and [x.ref_cnt for x in computed] == [2, 2]


def test_truncate_frees_blocks_beyond_needed():
    """truncate keeps the blocks for the first num_tokens tokens and returns the rest to the pool."""
    kv = KVCacheManager(8, BS)
    r = req("r", range(20))
    admit(kv, r)
    ids = kv.block_ids("r")
    assert len(ids) == 5 and kv.num_free_blocks == 3
    kv.truncate(r, 9)
    assert kv.block_ids("r") == ids[:3]
    assert kv.num_free_blocks == 5
    assert [kv.pool.blocks[i].ref_cnt for i in ids[3:]] == [0, 0]
    kv.truncate(r, 12)                              # nothing beyond 3 blocks: no change
    assert kv.block_ids("r") == ids[:3]
    kv.free(r)
    assert_all_free(kv)
    kv.truncate(r, 0)                               # unknown / empty table: no-op
    assert_all_free(kv)


def test_partial_blocks_are_not_published_until_full():
    """Only full blocks enter the prefix cache; the tail block is published once it fills up."""
    kv = KVCacheManager(8, BS)
    r = req("r", range(10))
    admit(kv, r)
    assert [b.block_hash is not None for b in blocks(kv, "r")] == [True, True, False]
    decode(kv, r, 10)                               # 11 tokens: block 2 still partial
    assert blocks(kv, "r")[2].block_hash is None
    assert kv.get_computed_blocks(req("p", list(range(12)) + [0]))[1] == 8
    decode(kv, r, 11)                               # 12 tokens: block 2 full
    assert blocks(kv, "r")[2].block_hash is not None
    assert kv.get_computed_blocks(req("q", list(range(12)) + [0]))[1] == 12


def test_truncate_rollback_does_not_serve_rolled_back_tokens():
    """After a speculative rollback, the cache must reflect the accepted tokens, not the rejected ones."""
    kv = KVCacheManager(8, BS)
    r = req("r", [1, 2, 3, 4, 5, 6])
    admit(kv, r)
    r.token_ids += [70, 71, 72]                     # 3 draft tokens: block 1 = [5, 6, 70, 71] is full
    kv.allocate(r, 3)
    r.num_computed_tokens += 3
    del r.token_ids[6:]                             # all drafts rejected: roll back to 6 tokens
    r.num_computed_tokens = 6
    kv.truncate(r, 6)
    # The rejected prefix [1..6, 70, 71] must no longer be served from the cache.
    assert kv.get_computed_blocks(req("probe", [1, 2, 3, 4, 5, 6, 70, 71, 0]))[1] == BS
    r.token_ids += [80, 81]                         # accepted continuation fills block 1 differently
    kv.allocate(r, 2)
    assert kv.get_computed_blocks(req("probe2", [1, 2, 3, 4, 5, 6, 80, 81, 0]))[1] == 2 * BS


def test_a_reused_block_counts_as_recent_again():
    """A shared prefix that requests keep reusing stays in the digest a router sees, however many
    blocks were published since."""
    kv = KVCacheManager(16, BS)
    a, b = req("a", range(10, 18)), req("b", range(40, 52))        # 2 and 3 full blocks
    admit(kv, a)
    admit(kv, b)
    assert kv.recent_block_hashes(2) == [blk.block_hash for blk in reversed(blocks(kv, "b")[1:])]
    kv.free(a)
    again = req("a2", list(range(10, 18)) + [1])                   # a's 2 blocks from the cache
    admit(kv, again)
    assert kv.recent_block_hashes(2) == [blk.block_hash for blk in blocks(kv, "a2")[:2]][::-1]


def test_the_simulators_digest_is_the_one_a_ray_replica_reports():
    """sim/cluster.py's DigestPool keeps its digest incrementally; the Ray replica builds it from
    the KV manager's recent hashes. Through publishing, reuse and eviction they stay equal."""
    from tandem.router import digest_of
    from tandem.sim.cluster import DigestPool

    size = 4
    plain = KVCacheManager(12, BS)
    sim = KVCacheManager(12, BS, pool=DigestPool(12, size))
    for step, tokens in enumerate([range(10, 22), range(40, 48), range(10, 19), range(60, 84), range(40, 50),
                                   range(90, 130), range(10, 22)]):
        for kv in (plain, sim):
            r = req(f"r{step}", list(tokens))
            admit(kv, r)
            kv.free(r)
        assert sim.pool.digest() == digest_of(plain.recent_block_hashes(2 * size), size), step
        assert sim.pool.digest() == digest_of(sim.recent_block_hashes(2 * size), size), step
    assert plain.pool.num_evictions > 0                            # evictions were part of it
