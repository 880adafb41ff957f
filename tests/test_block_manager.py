"""BlockManager on integer token lists: ref counts, free list, prefix hits, image keys, rollback."""
from __future__ import annotations

import pytest

from docproc.engine.block_manager import BlockManager
from docproc.engine.sequence import ImageSpan, Sequence

BS = 4


def seq(tokens, images=None) -> Sequence:
    return Sequence(list(tokens), images)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What a scheduled full prefill does to the bookkeeping."""
    bm.allocate(s)
    bm.commit(s, len(s))
    s.num_computed_tokens = len(s)


def all_refs_zero(bm: BlockManager) -> bool:
    return not any(bm.ref_counts) and bm.num_free_blocks == bm.num_blocks


def test_allocate_and_free_returns_every_ref():
    bm = BlockManager(8, BS)
    a, b = seq(range(10)), seq(range(100, 105))
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    bm.deallocate(a)
    bm.deallocate(b)
    assert all_refs_zero(bm)


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    run_prefill(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.stats.num_hit_tokens == 8 and bm.stats.num_query_tokens == 20
    bm.deallocate(a)
    bm.deallocate(b)
    assert all_refs_zero(bm)


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS)
    a = seq(range(8))
    run_prefill(bm, a)
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed: its last token's logits are needed
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_prefix_match_stops_at_first_difference():
    bm = BlockManager(16, BS)
    run_prefill(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])  # second block equal, first not: chained hash -> no hit
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def image_span(offset, h, n=4):
    return ImageSpan(offset, n, h, (1, 4, 4), 2)  # 4 pad tokens


def test_same_tokens_next_to_a_different_image_never_hit():
    bm = BlockManager(16, BS)
    pad = 7
    toks = [1, 2, pad, pad, pad, pad, 3, 4, 5]
    run_prefill(bm, seq(toks, [image_span(2, "aaaa")]))
    other = seq(toks, [image_span(2, "bbbb")])
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    same = seq(toks, [image_span(2, "aaaa")])
    bm.allocate(same)
    assert same.num_cached_tokens == 8


def test_image_position_inside_block_is_part_of_the_key():
    # the same image at another offset yields other M-RoPE positions: it must not hit
    a = seq([7, 7, 7, 7, 1, 2, 3, 4], [image_span(0, "aaaa")])
    b = seq([1, 7, 7, 7, 7, 2, 3, 4], [image_span(1, "aaaa")])
    assert a.block_key(0, BS) != b.block_key(0, BS)


def test_freed_cached_blocks_are_reused_lru_and_evicted_only_when_needed():
    bm = BlockManager(6, BS)
    a = seq(range(9))  # 3 blocks, 2 full committed
    run_prefill(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 6
    assert len(bm.hash_to_block) == 2
    # uncached free blocks are used first: a 3-block request evicts nothing
    b = seq(range(100, 109))
    run_prefill(bm, b)
    assert bm.stats.num_evicted_blocks == 0
    c = seq(range(9))  # a's prefix is still cached
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    bm.deallocate(b)
    bm.deallocate(c)
    # a request needing every block evicts the cached ones
    d = seq(range(200, 224))
    run_prefill(bm, d)
    assert bm.stats.num_evicted_blocks > 0
    bm.deallocate(d)
    assert all_refs_zero(bm)


def test_blocks_are_taken_freed_first_then_unused_then_cached_oldest_first():
    bm = BlockManager(8, BS)
    old = seq(range(8))  # 2 full blocks, cached once freed
    run_prefill(bm, old)
    new = seq(range(50, 58))
    run_prefill(bm, new)
    scratch = seq(range(100, 102))  # one partial block: freed without a hash
    run_prefill(bm, scratch)
    old_blocks = list(old.block_table)
    bm.deallocate(old)
    bm.deallocate(new)
    (scratch_block,) = scratch.block_table
    bm.deallocate(scratch)
    assert bm.num_free_blocks == 8
    # 5 blocks: the freed block without a hash, then the 3 never used, then the oldest cached one
    big = seq(range(200, 220))
    bm.allocate(big)
    assert big.block_table[0] == scratch_block
    assert sorted(big.block_table[1:4]) == [5, 6, 7]
    assert big.block_table[4] == old_blocks[1]  # a document's tail is evicted before its head
    assert bm.stats.num_evicted_blocks == 1
    # the newer document's prefix is still served from the cache
    again = seq(range(50, 59))
    bm.allocate(again)
    assert again.num_cached_tokens == 8


def test_a_pool_of_millions_of_blocks_is_bookkeeping_of_plain_lists():
    bm = BlockManager(4_000_000, 16)
    assert bm.num_free_blocks == 4_000_000 and not bm.free
    s = seq(range(40))
    run_prefill(bm, s)
    assert s.block_table == [0, 1, 2] and bm.num_free_blocks == 4_000_000 - 3
    bm.deallocate(s)
    assert bm.num_free_blocks == 4_000_000


def test_can_allocate_counts_hits_in_use():
    bm = BlockManager(4, BS)
    a = seq(range(13))  # 4 blocks: pool full
    run_prefill(bm, a)
    assert bm.num_free_blocks == 0
    b = seq(list(range(12)) + [99])  # 3 shared blocks in use + 1 new: no free block
    assert not bm.can_allocate(b)
    with pytest.raises(RuntimeError):
        bm.allocate(b)


def test_append_slots_and_truncate_for_rollback():
    bm = BlockManager(8, BS)
    s = seq(range(6))
    run_prefill(bm, s)
    assert len(s.block_table) == 2
    bm.append_slots(s, 6 + 5)  # a speculative window of 5 -> 11 tokens, 3 blocks
    assert len(s.block_table) == 3
    bm.truncate(s, 7)  # 4 rejected: back to 2 blocks
    assert len(s.block_table) == 2
    bm.deallocate(s)
    assert all_refs_zero(bm)


def test_decode_commits_generated_blocks():
    bm = BlockManager(8, BS)
    s = seq(range(3))
    run_prefill(bm, s)
    s.append_token(50)
    assert bm.can_append(s, len(s))
    bm.append_slots(s, len(s))
    bm.commit(s, len(s))
    assert len(s.block_hashes) == 1
    s.append_token(51)
    bm.append_slots(s, len(s))
    assert len(s.block_table) == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    run_prefill(bm, seq(range(9)))
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.hash_to_block


def test_discard_takes_a_failed_steps_blocks_out_of_the_prefix_cache():
    """commit registers hashes when a step is scheduled; if the step then raises, those blocks
    hold no K/V, and a later request must not hit them."""
    bm = BlockManager(16, BS)
    a = seq(range(13))
    bm.allocate(a)
    bm.commit(a, len(a))  # scheduled ... and the step raised
    bm.discard(a)
    assert all_refs_zero(bm) and not bm.hash_to_block
    again = seq(range(13))
    bm.allocate(again)
    assert again.num_computed_tokens == 0  # no hit on the unwritten blocks
    done = seq(range(100, 109))  # a finished sequence's blocks stay cached as before
    run_prefill(bm, done)
    bm.deallocate(done)
    hit = seq(range(100, 109))
    bm.allocate(hit)
    assert hit.num_computed_tokens == 8
