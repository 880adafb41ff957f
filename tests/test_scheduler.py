"""Scheduler on integer token lists: budgets, chunking, decode-first, preemption order."""
from __future__ import annotations

from docproc.engine.block_manager import BlockManager
from docproc.engine.scheduler import Scheduler
from docproc.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, max_seqs=8, budget=32, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return bm, Scheduler(bm, max_seqs, budget)


def apply(out, token=1):
    """What the engine does after a step: advance computed counts, append sampled tokens."""
    for s in [(s.seq, s.end, s.needs_sample) for s in out.scheduled]:
        seq, end, sample = s
        seq.num_computed_tokens = end
        if sample:
            seq.append_token(token)


def test_chunked_prefill_respects_budget():
    bm, sch = make(budget=8)
    s = Sequence(list(range(20)))
    sch.add(s)
    chunks = []
    while s.num_generated_tokens == 0:
        out = sch.schedule()
        assert out.num_batched_tokens <= 8
        chunks.append(out.scheduled[0].num_new_tokens)
        apply(out)
    assert chunks == [8, 8, 4]


def test_decode_first_then_prefill():
    bm, sch = make(budget=10)
    a = Sequence(list(range(6)))
    sch.add(a)
    apply(sch.schedule())  # a prefilled, has 1 generated token
    b = Sequence(list(range(100, 120)))
    sch.add(b)
    out = sch.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 1), (b, 9)]


def test_max_num_seqs():
    bm, sch = make(max_seqs=2, budget=100)
    seqs = [Sequence(list(range(i * 10, i * 10 + 5))) for i in range(3)]
    for s in seqs:
        sch.add(s)
    out = sch.schedule()
    assert [x.seq for x in out.scheduled] == seqs[:2]
    assert seqs[2].status == SequenceStatus.WAITING


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    # 3 blocks of 4 tokens: a (4 tokens) and b (4 tokens) each fill a block after prefill; when both
    # need a second block for decode and one is left, the later one (b) is preempted by recompute.
    bm, sch = make(num_blocks=3, budget=100, caching=False)
    a, b = Sequence([1, 2, 3]), Sequence([5, 6, 7])
    sch.add(a)
    sch.add(b)
    apply(sch.schedule())  # both prefilled (3 tokens) and sampled: 4 tokens, 1 block each
    assert bm.num_free_blocks == 1
    apply(sch.schedule())  # decode the 4th token (still 1 block each): 5 tokens each
    out = sch.schedule()  # the 5th token needs a 2nd block each; 1 is free
    assert out.preempted == [b]
    assert [x.seq for x in out.scheduled] == [a]
    assert sch.waiting[0] is b and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1
    apply(out)
    sch.finish(a, "stop")
    out = sch.schedule()  # b comes back and recomputes all its tokens (prompt + generated)
    assert out.scheduled[0].seq is b and out.scheduled[0].num_new_tokens == len(b)
    apply(out)
    sch.finish(b, "stop")
    assert not any(bm.ref_counts) and bm.num_free_blocks == 3


def test_request_larger_than_the_pool_fails_alone():
    bm, sch = make(num_blocks=2, budget=100)
    big, small = Sequence(list(range(20))), Sequence([1, 2])
    sch.add(big)
    sch.add(small)
    out = sch.schedule()
    assert [s for s, _ in out.failed] == [big]
    assert "KV blocks" in out.failed[0][1]
    assert [x.seq for x in out.scheduled] == [small]


def test_same_step_admissions_share_the_prefix():
    bm, sch = make(budget=100)
    a, b = Sequence(list(range(12)) + [50]), Sequence(list(range(12)) + [60])
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    # a computes 13 tokens; b hits a's 3 blocks registered at scheduling time and computes 1
    assert [x.num_new_tokens for x in out.scheduled] == [13, 1]
    assert b.num_cached_tokens == 12


def test_a_decode_preempts_a_later_decode_which_is_then_skipped():
    # 4 blocks: a, b and c fill one block each after prefill and decode; then each needs a second
    # block and one is free: a takes it, b preempts c (the latest admitted) and takes c's block,
    # and c, preempted in this step, is not scheduled
    bm, sch = make(num_blocks=4, budget=100, caching=False)
    a, b, c = Sequence([1, 2, 3]), Sequence([5, 6, 7]), Sequence([9, 10, 11])
    for s in (a, b, c):
        sch.add(s)
    apply(sch.schedule())  # prefilled and sampled: 4 tokens, 1 block each
    apply(sch.schedule())  # the 4th token computed: 5 tokens each, the 5th needs a 2nd block
    out = sch.schedule()
    assert out.preempted == [c]
    assert [x.seq for x in out.scheduled] == [a, b] and out.decoding == [a, b]
    assert sch.running == [a, b] and sch.waiting[0] is c and bm.num_free_blocks == 0


def test_a_decode_that_can_only_preempt_itself_is_not_scheduled():
    bm, sch = make(num_blocks=1, budget=100, caching=False)
    a = Sequence([1, 2, 3])
    sch.add(a)
    apply(sch.schedule())
    apply(sch.schedule())  # 5 tokens: the next decode needs a 2nd block and there is none
    out = sch.schedule()
    assert out.preempted == [a] and out.scheduled == [] and sch.waiting[0] is a


def test_decode_keeps_tables_and_block_hashes_exact_with_and_without_lookahead():
    """The decode loop's fast path (no block manager call when no block is needed or filled) leaves
    every sequence with room for its next tokens and the hash of every full block, in order, as
    calling the block manager every step does; a second sequence with the same tokens then hits
    those blocks."""
    from docproc.engine.block_manager import hash_block

    for lookahead in (0, 3):
        bm = BlockManager(64, BS, True)
        sch = Scheduler(bm, 8, 64, lookahead=lookahead)
        seqs = [Sequence(list(range(k, k + n))) for k, n in ((0, 5), (100, 7), (200, 4))]
        for s in seqs:
            sch.add(s)
        for step in range(13):
            out = sch.schedule()
            room = {id(s): len(s) + lookahead for s in out.decoding}
            apply(out, token=step)
            for s in seqs:
                if id(s) in room:  # a decode step's table holds its token and the lookahead
                    assert len(s.block_table) * BS >= room[id(s)]
                prev, want = None, []
                for i in range(s.num_computed_tokens // BS):
                    prev = hash_block(prev, s.block_key(i, BS))
                    want.append(prev)
                assert s.block_hashes == want, (lookahead, step)
        twin = Sequence(list(seqs[1].token_ids))
        assert len(bm._prefix_hits(twin)[0]) == (len(twin) - 1) // BS


def test_a_page_whose_pixels_are_not_prepared_waits_while_others_run():
    """With a readiness hook (the engine's image prefetcher), a waiting sequence with images is
    admitted once its pixels are prepared while others run (decoding on meanwhile), and at once
    when nothing runs; one without images never waits."""
    from docproc.engine.sequence import ImageSpan

    bm, sch = make(budget=64)
    ready = set()
    sch.ready = lambda seq: seq.seq_id in ready
    a = Sequence(list(range(6)), [ImageSpan(1, 4, "a", (1, 4, 4), 2)])
    b = Sequence(list(range(8)), [ImageSpan(1, 4, "b", (1, 4, 4), 2)])
    text = Sequence(list(range(5)))
    sch.add(a)
    out = sch.schedule()  # nothing runs: admitted though not ready (the step prepares it inline)
    assert [c.seq for c in out.scheduled] == [a]
    apply(out)
    sch.add(b)
    sch.add(text)
    for _ in range(3):
        out = sch.schedule()  # b's pixels are not ready: a decodes alone; text waits behind b (first come first served)
        assert [c.seq for c in out.scheduled] == [a]
        apply(out)
    ready.add(b.seq_id)
    out = sch.schedule()
    assert [c.seq for c in out.scheduled] == [a, b, text]
