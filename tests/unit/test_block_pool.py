"""Block pool and KV cache manager: ref counts, free queue, LRU eviction, prefix hashes.

Pure Python, no model: blocks are ids, requests are token lists.
"""

from __future__ import annotations

import pytest

from worker.engine.block_pool import BlockPool
from worker.engine.kv_cache import KVCacheManager, hash_block
from worker.request import Request, SamplingParams

ROOT = b"kvflow-prefix-root"


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0)


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- block pool ---------------------------------------------------------------------------


def test_allocate_and_free_track_ref_counts_and_usage():
    pool = BlockPool(8)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (8, 0, 0.0)

    a = pool.allocate(3)
    assert len({b.block_id for b in a}) == 3
    assert all(b.ref_cnt == 1 for b in a)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)
    assert pool.usage == pytest.approx(3 / 8)

    pool.touch(a[:1])  # a second owner of the first block
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0 and a[2].ref_cnt == 0
    assert pool.num_free_blocks == 7
    pool.free(a[:1])
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    assert pool.num_free_blocks == 2


def test_allocation_takes_never_used_blocks_before_evicting_cached_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.free(reversed(a))
    # The two never-touched blocks are in front of the freed cached ones.
    fresh = pool.allocate(2)
    assert set(_ids(fresh)).isdisjoint(_ids(a))
    assert pool.lookup(b"h0") is a[0] and pool.lookup(b"h1") is a[1]
    assert pool.num_cached_blocks == 2


def test_lru_eviction_order_is_free_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache(b, f"h{i}".encode())
    # A request's blocks are freed tail first: the tail is evicted first.
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4

    (first,) = pool.allocate(1)
    assert first is blocks[3]
    assert first.block_hash is None and pool.lookup(b"h3") is None
    assert pool.lookup(b"h0") is blocks[0]

    (second,) = pool.allocate(1)
    assert second is blocks[2]
    assert pool.lookup(b"h2") is None
    assert pool.num_cached_blocks == 2


def test_touch_of_cached_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], b"h0")
    pool.free(blocks)  # queue: 0, 1, 2
    assert pool.num_free_blocks == 3

    hit = pool.lookup(b"h0")
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 2
    # The touched block is not handed out again, and keeps its hash.
    rest = pool.allocate(2)
    assert hit not in rest
    assert pool.lookup(b"h0") is hit
    with pytest.raises(ValueError):
        pool.allocate(1)

    pool.free([hit])
    assert pool.num_free_blocks == 1
    assert pool.lookup(b"h0") is hit  # still cached while free


def test_touch_of_referenced_block_only_adds_a_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.num_free_blocks == 1


def test_cache_keeps_first_block_for_a_hash_and_uncache_withdraws():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") is a and b.block_hash is None
    pool.cache(a, b"other")  # a block is published once
    assert pool.lookup(b"other") is None
    pool.uncache(a)
    assert pool.lookup(b"same") is None and a.block_hash is None
    pool.uncache(a)  # no-op


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")
    assert pool.lookup(b"h") is None and pool.num_cached_blocks == 0


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is b


# -- KV cache manager ---------------------------------------------------------------------


def test_hash_chain_depends_on_the_parent():
    h0 = hash_block(ROOT, [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(ROOT, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(h0, [5, 6, 7, 8]) == hash_block(hash_block(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_allocate_slots_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req("a", list(range(10)))
    assert not kv.allocate_slots(r, 13)  # 4 blocks > 3
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 0
    assert kv.usage == 1.0
    kv.free(r)
    assert kv.num_free_blocks == 3 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_computed_blocks_are_shared_and_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(100, 108)))  # exactly 2 full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8

    b = _req("b", list(range(100, 108)))
    hits, n = kv.get_computed_blocks(b)
    # Both blocks are cached, but the last token must be computed to get logits.
    assert n == 4 and _ids(hits) == kv.block_ids("a")[:1]

    c = _req("c", [*range(100, 108), 1])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8 and _ids(hits) == kv.block_ids("a")
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(c, 1, hits)
    assert kv.num_free_blocks == free_before - 1  # only the new tail block
    assert kv.block_ids("c")[:2] == kv.block_ids("a")
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in kv.block_ids("a"))

    kv.free(a)
    kv.free(c)
    assert kv.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_same_block_content_after_a_different_prefix_is_not_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    b = _req("b", [11, 12, 13, 14, 5, 6, 7, 8, 9])  # second block equal, first not
    assert kv.get_computed_blocks(b) == ([], 0)
    c = _req("c", [1, 2, 3, 4, 15, 16, 17, 18, 9])  # first block equal only
    hits, n = kv.get_computed_blocks(c)
    assert n == 4 and _ids(hits) == kv.block_ids("a")[:1]


def test_hit_on_a_free_cached_block_is_not_double_counted_as_free():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    b = _req("b", [*range(8), 50, 51, 52, 53, 54])  # 2 hit blocks + needs 2 more
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # 3 free blocks, 2 of them are the hits: only 1 is left for the 2 new ones.
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.allocate_slots(b, 4, hits)  # 12 tokens: 1 new block
    assert kv.num_free_blocks == 0


def test_free_evicts_the_tail_first_and_keeps_the_prefix():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _req("a", list(range(13)))  # 3 full blocks + 1 partial
    assert kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.free(a)
    assert kv.pool.num_cached_blocks == 3

    other = _req("o", [90, 91, 92, 93, 94])  # 2 blocks: takes the tail two
    assert kv.allocate_slots(other, 5)
    assert kv.pool.lookup(a.block_hashes[2]) is None  # evicted
    assert kv.pool.lookup(a.block_hashes[0]) is not None
    assert kv.pool.lookup(a.block_hashes[1]) is not None

    b = _req("b", list(range(13)))
    _, n = kv.get_computed_blocks(b)
    assert n == 8  # the first two blocks survived


def test_uncomputed_published_blocks_are_withdrawn_on_free():
    # Blocks are published when the step that fills them is scheduled; a request freed
    # before that step ran must not leave hashes of content that was never computed.
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    assert kv.pool.num_cached_blocks == 2
    kv.free(a)  # num_computed_tokens is still 0
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)


def test_prefix_hit_rate():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.prefix_hit_rate == 0.0
    kv.count_prefix_query(10, 0)
    kv.count_prefix_query(10, 8)
    assert kv.prefix_hit_rate == pytest.approx(0.4)
