"""The write-back host tier (KVCacheManager.swap_out / swap_in over BlockPool's deferred copies):
a swap copies a block out only when the pool hands it out again, and back only if it was."""

from __future__ import annotations

from tandem.kv import KVCacheManager
from tests.test_kv import admit, blocks, req


def test_a_swap_out_copies_a_block_only_when_it_is_handed_out_and_an_abort_cancels_the_copy():
    """Write-back host tier: swap_out reserves host blocks and copies nothing; a block falls due when
    the pool hands it out (before the new owner writes it); ending the swapped request cancels
    its copies, even one that fell due and no plan took yet, and frees its host blocks at once."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False, num_host_blocks=4)
    a = req("a", list(range(8)))
    admit(kv, a)                                   # blocks 0, 1
    kv.swap_out(a)
    assert kv.take_due_copies() == [] and kv.num_free_blocks == 4 and kv.num_free_host_blocks == 2
    b = req("b", list(range(100, 112)))
    admit(kv, b)                                   # 3 blocks: 2 never used, then a's last one (block 1)
    host = kv._swapped["a"]
    assert kv.take_due_copies() == [(1, host[1])]
    kv.free(b)
    c = req("c", list(range(200, 216)))
    admit(kv, c)                                   # all 4 blocks: block 0 falls due too
    kv.free(a)                                     # a ends before the plan takes that copy
    assert kv.take_due_copies() == [] and kv.num_free_host_blocks == 4 and not kv.is_swapped("a")


def test_a_prefix_block_shared_by_two_swapped_requests_owes_its_content_to_both():
    """Two requests share a cached prefix block and both swap out: the block owes a copy to each
    one's host block. When it is reused both copies fall due, and each owner gets its own back."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True, num_host_blocks=4)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [1, 2, 3, 4, 6])
    admit(kv, a)                                   # blocks 0 (the shared prefix), 1
    assert admit(kv, b) == 4 and blocks(kv, "b")[0] is blocks(kv, "a")[0]
    kv.swap_out(a)
    kv.swap_out(b)
    ha, hb = kv._swapped["a"], kv._swapped["b"]
    c = req("c", list(range(100, 116)))
    admit(kv, c)                                   # takes every block, the shared one too
    due = sorted(kv.take_due_copies())
    assert (0, ha[0]) in due and (0, hb[0]) in due and len(due) == 4
    kv.free(c)
    copies_a = kv.swap_in(a)
    assert sorted(h for h, _ in copies_a) == sorted(ha)    # every block of a comes back from its host copy
