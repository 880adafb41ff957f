"""Scheduler: continuous batching with chunked prefill (no torch).

Each step: running sequences that are decoding get one token each first (preempting the most
recently admitted sequence, by recompute, when blocks run out), then sequences part-way through
their prefill continue, then waiting sequences are admitted first come first served while the
token budget, `max_num_seqs` and the block pool allow (and, while others run, once their pages'
pixels are prepared: a step never waits for them). A prefill chunk may end inside an image's
pad tokens: the runner takes the slice of the cached vision output it needs, so an image never
forces a chunk to grow past the budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from docproc.engine.block_manager import BlockManager
from docproc.engine.sequence import Chunk, Sequence, SequenceStatus


def _random(seq: Sequence) -> bool:
    """Sampled from the engine's own generator (no seed of its own)."""
    sp = seq.sampling
    return sp is not None and sp.temperature > 0 and sp.seed is None


@dataclass
class SchedulerOutput:
    scheduled: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # can never run: why
    # the scheduled sequences that compute one token, their last, and sample the next: decode
    # steps (and a prompt whose cached prefix left one token), the rows a draft may propose for
    decoding: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 0) -> None:
        """lookahead: extra slots a decoding sequence gets for a speculative window (its K/V is
        written during verification and rolled back by length)."""
        self.block_manager = block_manager
        self.lookahead = lookahead
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.max_running = 0  # the most sequences running at once so far
        # ready(seq): whether a waiting sequence's images could be encoded without waiting for their
        # preprocessing (the engine's image prefetcher); while others run, one that is not waits
        self.ready = None
        self._random: set[int] = set()  # ids of unfinished sequences that sample from the engine's generator

    @property
    def num_random(self) -> int:
        """Unfinished sequences that sample from the engine's generator (no seed of their own)."""
        return len(self._random)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if _random(seq):
            self._random.add(seq.seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the blocks (committed ones stay in the prefix cache, so the
        recompute often hits them) and requeue at the front."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.max_num_batched_tokens

        # 1. decode: one token each, preempting from the back of the admission order
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        gone: set[int] = set()  # ids of the sequences preempted in this loop (a set: `in running` is O(n))
        bs = bm.block_size
        for seq in decoding:
            if budget == 0:
                break
            if id(seq) in gone:  # preempted below for an earlier sequence
                continue
            n = len(seq)
            # most steps need no new block and fill none: those skip the block manager (the same
            # outcome as can_append/append_slots/commit, without their calls: host time per sequence)
            if n + self.lookahead > len(seq.block_table) * bs:
                while not bm.can_append(seq, n + self.lookahead):
                    victim = self.running[-1]
                    self._preempt(victim, out)
                    gone.add(id(victim))
                    if victim is seq:
                        break
                if id(seq) in gone:
                    continue
                bm.append_slots(seq, n + self.lookahead)
            out.scheduled.append(Chunk.next(seq, 1))
            out.decoding.append(seq)
            if n // bs > len(seq.block_hashes):  # a block became full: register its hash
                bm.commit(seq, n)
            budget -= 1

        # 2. prefills already under way (chunked)
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                s = Chunk.next(seq, min(seq.num_uncomputed_tokens, budget))
                out.scheduled.append(s)
                bm.commit(seq, s.end)  # later admissions this step may hit these blocks
                budget -= s.num_new_tokens

        # 3. admit waiting sequences, first come first served
        preempted_now = {id(s) for s in out.preempted}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if id(seq) in preempted_now:
                break  # do not readmit in the step that preempted it
            if bm.num_blocks_for(len(seq)) > bm.num_blocks:
                self.waiting.popleft()
                out.failed.append((seq, (
                    f"request needs {bm.num_blocks_for(len(seq))} KV blocks of {bm.block_size} tokens but the "
                    f"cache has only {bm.num_blocks}: raise gpu_memory_utilization / kv_cache_memory_bytes "
                    f"or shorten the prompt")))
                continue
            if not bm.can_allocate(seq):
                break
            if self.ready is not None and self.running and seq.images and not self.ready(seq):
                break  # its pages are being prepared: the running ones step on meanwhile
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            left = seq.num_uncomputed_tokens
            n = min(left, budget)
            out.scheduled.append(Chunk.next(seq, n))
            if left == 1:
                out.decoding.append(seq)
            budget -= n
            bm.commit(seq, seq.num_computed_tokens + n)  # later admissions this step may hit these
        self.max_running = max(self.max_running, len(self.running))
        return out

    def retire(self, seq: Sequence) -> None:
        """A running sequence that stops for sure at the token a step in flight is sampling for it
        (engine/overlap.py): it leaves the running set and its blocks go back now, so that the next
        step can admit in its place (that step runs after the one in flight, which writes them
        first); finish() completes it once the token is read."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._random.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
