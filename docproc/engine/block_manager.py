"""BlockManager: a paged KV pool's bookkeeping (no torch): ref counts, a free list in LRU order,
and prefix caching by chained block hashes."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from docproc.engine.sequence import Sequence


def hash_block(prev_hash: bytes | None, key: bytes) -> bytes:
    """Chained SHA-256: a block's hash covers its own key and, through prev_hash, every block
    before it. 256 bits rule out collisions in practice, so a hit needs no token compare."""
    h = hashlib.sha256()
    h.update(prev_hash or b"\0" * 32)
    h.update(key)
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    num_query_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of those, served from cached blocks
    num_evicted_blocks: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Per block: its reference count and, once full, committed and registered, its hash.
        # Plain lists, no object per block: a small model's pool on a large card is millions of
        # blocks, and building them must not delay the engine's start.
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        # Free blocks that have been used; the first entry is reused first. Blocks without a hash
        # go to the front; freed cached blocks go to the back, so the least recently used cached
        # block goes first. Blocks never used yet are the range [num_fresh_from, num_blocks): they
        # are taken after the freed blocks without a hash and before any cached block.
        self.free: OrderedDict[int, None] = OrderedDict()
        self.num_fresh_from = 0
        self.hash_to_block: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()
        # can_allocate then allocate look up the same prefix: keep the last lookup while the
        # hash map is unchanged (_version counts its changes)
        self._version = 0
        self._last_lookup: tuple | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_blocks - self.num_fresh_from

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks matching the sequence's leading full blocks (stops at the first miss)."""
        key = (seq.seq_id, len(seq), self._version)
        if self._last_lookup is not None and self._last_lookup[0] == key:
            return list(self._last_lookup[1]), list(self._last_lookup[2])
        hits: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return hits, hashes
        prev = None
        # Leave at least one token to compute: the last token's logits are needed to sample.
        num_full = (len(seq) - 1) // self.block_size
        for i in range(num_full):
            h = hash_block(prev, seq.block_key(i, self.block_size))
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(h)
            prev = h
        self._last_lookup = (key, hits, hashes)
        return list(hits), list(hashes)

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._prefix_hits(seq)
        hits_in_use = sum(1 for b in hits if self.ref_counts[b] > 0)
        needed = self.num_blocks_for(len(seq)) - hits_in_use
        return needed <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the table can grow to hold `num_tokens` tokens in all."""
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    # ---- actions -------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self.free and self.hashes[next(iter(self.free))] is None:
            block_id, _ = self.free.popitem(last=False)
        elif self.num_fresh_from < self.num_blocks:
            block_id = self.num_fresh_from
            self.num_fresh_from += 1
        else:
            block_id, _ = self.free.popitem(last=False)
        h = self.hashes[block_id]
        if h is not None:  # evict: its content is about to be overwritten
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
                self._version += 1
            self.hashes[block_id] = None
            self.stats.num_evicted_blocks += 1
        self.ref_counts[block_id] = 1
        return block_id

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        if not self.can_allocate(seq):
            raise RuntimeError("allocate() called without room: check can_allocate() first")
        hits, hashes = self._prefix_hits(seq)
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
            self.ref_counts[block_id] += 1
        table = list(hits)
        for _ in range(self.num_blocks_for(len(seq)) - len(hits)):
            table.append(self._take_free_block())
        seq.block_table = table
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:  # a recompute after preemption is not a prompt-cache hit
            seq.num_cached_tokens = seq.num_computed_tokens
        self.stats.num_query_tokens += len(seq)
        self.stats.num_hit_tokens += seq.num_computed_tokens

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the table to hold `num_tokens` tokens in all (decode, or a speculative window)."""
        if not self.can_append(seq, num_tokens):
            raise RuntimeError("append_slots() called without room: check can_append() first")
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Register the hashes of blocks that are full once `num_tokens` tokens are computed.

        Called when a step is scheduled: a sequence admitted later in the same step may then hit
        these blocks, which is safe because each layer stores the whole batch's K/V before any
        attention reads it. A block holding a placeholder (a token not read yet) waits for a
        later commit.
        """
        num_full = min(num_tokens, len(seq) - seq.num_placeholders) // self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            h = hash_block(prev, seq.block_key(i, self.block_size))
            seq.block_hashes.append(h)
            prev = h
            if not self.enable_prefix_caching:
                continue
            block_id = seq.block_table[i]
            if self.hashes[block_id] is None and h not in self.hash_to_block:
                self.hashes[block_id] = h
                self.hash_to_block[h] = block_id
                self._version += 1

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a sequence back to its first `num_tokens` tokens (rejected draft tokens): only the
        blocks past the new end are returned; committed blocks stay as they are."""
        keep = self.num_blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            for block_id in seq.block_table[keep:]:
                self._release(block_id)
            # a new list, not pops in place: a table list only ever grows in place (append_slots),
            # so a list object and its length identify its content (GraphRunner caches on that)
            seq.block_table = seq.block_table[:keep]
        del seq.block_hashes[num_tokens // self.block_size:]

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None
            if self.hashes[block_id] is None:
                self.free.move_to_end(block_id, last=False)

    def discard(self, seq: Sequence) -> None:
        """Deallocate a sequence whose step failed: its blocks leave the prefix cache too (commit
        registers a block's hash when its step is scheduled, so a failed step leaves hashes over
        K/V that was never written). Blocks it hit in the cache go with them: lost entries, never
        wrong ones."""
        for block_id in seq.block_table:
            h = self.hashes[block_id]
            if h is not None:
                if self.hash_to_block.get(h) == block_id:
                    del self.hash_to_block[h]
                    self._version += 1
                self.hashes[block_id] = None
        self.deallocate(seq)

    def deallocate(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Its tail is released first, so among its cached blocks the
        head of the prefix (the part other requests share) is evicted last."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
