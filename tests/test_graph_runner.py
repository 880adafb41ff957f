"""The CUDA-graph step path: padded static buffers, scratch slot, gathered rows. On CPU the same
path runs eagerly ("static" mode) with the Triton kernels in their interpreter, and must give the
tokens the plain path gives; on a GPU the captured graphs are compared with eager steps."""
from __future__ import annotations

import pytest
import torch
from test_fp4_engine import reqs  # two queries of one page (prefix hits) and a text-only prompt

import docproc.engine.model_runner as model_runner
from docproc import LLM, SamplingParams
from docproc.engine.graph_runner import bucket
from docproc.engine.step_inputs import text_position_delta
from docproc.engine.sequence import ImageSpan
from docproc.models.rope import mrope_positions


def test_buckets_and_text_positions_match_mrope():
    assert bucket(1, (1, 2, 4)) == 1 and bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    images = [ImageSpan(3, 12, "a", (1, 6, 8), 2), ImageSpan(20, 6, "b", (1, 4, 6), 2)]
    for start, end in [(0, 3), (15, 20), (26, 30), (40, 41)]:
        delta = text_position_delta(images, start, end)
        ref = mrope_positions(images, start, end)
        assert (ref == torch.arange(start + delta, end + delta)).all(), (start, end)
    assert text_position_delta(images, 10, 16) is None  # touches the first image


def test_graph_keys_take_the_eager_plans_split_count_and_decode_shape():
    """A step's graph key (B, q, splits, keys per step) agrees with the plan the eager path makes
    for the same step: the dense kernel's wide decode shape (up to 32 (sequence, KV head) pairs over
    >= 1k keys), at two KV heads its narrow one (9-16 pairs over >= 4k keys), and their split
    counts; the default elsewhere and for the FP4 kernel."""
    from types import SimpleNamespace

    from docproc.engine.graph_runner import GraphRunner
    from kernels.attention_plan import plan_tiles

    class Runner:  # what GraphRunner reads of a ModelRunner
        def __init__(self, wide, gluon, kv_heads):
            self.device = torch.device("cpu")
            self.block_size = 16
            self.backend = SimpleNamespace(num_heads=7 * kv_heads, num_kv_heads=kv_heads, num_sms=132,
                                           wide_decode=wide, fp4_gluon=gluon)

    def chunks(ends):
        return [SimpleNamespace(start=e - 1, end=e, seq=SimpleNamespace(block_table=[0] * (-(-e // 16))))
                for e in ends]

    # the dense backend (wide), the FP4 backend with the Triton kernel, and with the Gluon decode;
    # 4 KV heads (7B) and 2 (2B)
    seen = set()
    for kv_heads in (4, 2):
        for wide, gluon in ((True, False), (False, False), (False, True)):
            runner = Runner(wide, gluon, kv_heads)
            g = GraphRunner(runner, max_batch=16, max_len=40000, capture=False)
            for ends in ([16384], [5000, 9000], [3000], [1000], [1024] * 2, [16384] * 4, [16384] * 5, [4096] * 3,
                         [2048] * 9, [8192] * 6, [4095] * 8, [4096] * 8):
                key = g.key_for(chunks(ends))
                # the eager plan at the graph's (padded) batch, as the dense or the FP4 backend makes it
                b = key[0]
                plan = plan_tiles(list(range(b + 1)), (ends + [1] * b)[:b], [[0]] * b, 7, "cpu",
                                  num_kv_heads=kv_heads, dense=wide, fp4_gluon=gluon)
                assert key[2] == plan.num_splits and key[3] == plan.dense_block_n, (kv_heads, wide, ends, key)
                pairs = b * kv_heads
                narrow = wide and kv_heads == 2 and 8 < pairs <= 16 and max(ends) >= 4096
                expect = 64 if narrow else 128 if wide and max(ends) >= 1024 and pairs <= 32 else None
                assert key[3] == expect, (kv_heads, wide, ends, key)
                seen.add(key[3])
    assert seen == {None, 64, 128}


# the interpreter path on CPU; on a GPU the captured graphs are tested instead (below)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter path (CPU only)")


def static_engine(m, folder, **kw) -> LLM:
    """An engine on the static graph path (inside the monkeypatch context m)."""
    m.setattr(model_runner, "resolve_step_graphs", lambda config, device: "static")
    return LLM(str(folder), device="cpu", max_num_seqs=8, **kw)


def run(folder, static, monkeypatch, max_tokens=10, **kw):
    with monkeypatch.context() as m:
        if static:
            m.setattr(model_runner, "resolve_step_graphs", lambda config, device: "static")
        llm = LLM(str(folder), device="cpu", max_num_seqs=8, **kw)
        outs = llm.generate(reqs(), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


@cpu_only
@pytest.mark.parametrize("kv", ["fp32", "fp4"])
@pytest.mark.slow
def test_static_step_path_gives_the_plain_tokens(qwen2_vl_dir, monkeypatch, kv):
    tokens = 10 if kv == "fp32" else 3  # (FP4's kernels are slow in the interpreter)
    _, plain = run(qwen2_vl_dir, False, monkeypatch, tokens, kv_cache_dtype=kv)
    llm, static = run(qwen2_vl_dir, True, monkeypatch, tokens, kv_cache_dtype=kv)
    g = llm.runner.graphs
    assert g is not None and g.num_replays >= tokens - 1  # every decode step went through the padded path
    assert llm.cache_info()["num_reserved_blocks"] == 1
    assert llm.block_manager.num_free_blocks <= llm.runner.kv_cache.num_blocks - 1  # scratch never handed out
    assert static == plain
    # every tile array of every layout starts 16-byte aligned, as an eager step's separate tensors
    # do: Triton specializes pointers on that, and warm-up compiles with aligned ones
    for b in g.batches:
        for q in (1, 2, 3, 5, 16):
            views = g._layout((b, q, 1))[0]
            assert all(views[k].data_ptr() % 16 == 0 for k in ("tile_seq", "tile_tok", "tile_nq", "tile_pos", "table"))


@cpu_only
@pytest.mark.slow
def test_static_path_under_speculation_with_padded_windows(qwen2_vl_dir, monkeypatch):
    """The target verifies windows of K+1 = 5 in graphs of 6 rows per sequence (padded inside each
    window; shorter windows near max_tokens) and the draft (the target itself) catches up 1 or 2
    tokens per sequence: all through the padded path, output identical to plain greedy decoding,
    every draft accepted."""
    _, plain = run(qwen2_vl_dir, False, monkeypatch)
    llm, spec = run(qwen2_vl_dir, True, monkeypatch, speculative_model=str(qwen2_vl_dir), num_speculative_tokens=4)
    assert spec == plain
    assert llm.runner.graphs.num_replays > 0 and llm.speculator.runner.graphs.num_replays > 0
    stats = llm.spec_info()
    assert stats["draft_proposed"] > 0 and stats["draft_accepted"] == stats["draft_proposed"]
    # greedy rounds after the first read their input token on the device (chained)
    assert stats["draft_chained_rounds"] > 0


@cpu_only
@pytest.mark.slow
def test_chained_draft_rounds_match_unchained(qwen2_vl_dir, tmp_path, monkeypatch):
    """A draft that disagrees with the target (another random model): with its greedy rounds
    chained on the device, the same proposals, acceptances and output as with a sync per round,
    and both equal plain decoding."""
    from fixtures.checkpoints import make_model

    draft = make_model(tmp_path / "draft", "qwen2_vl", naming="new", seed=11)
    _, plain = run(qwen2_vl_dir, False, monkeypatch, max_tokens=7)
    results = {}
    for chain in (False, True):
        with monkeypatch.context() as m:
            llm = static_engine(m, qwen2_vl_dir, speculative_model=str(draft), num_speculative_tokens=3)
            llm.speculator.chain_greedy = chain
            outs = llm.generate(reqs(), SamplingParams(max_tokens=7, ignore_eos=True))
        info = llm.spec_info()
        results[chain] = ([o.outputs[0].token_ids for o in outs], info["draft_proposed"], info["draft_accepted"])
        assert (info["draft_chained_rounds"] > 0) == chain
    assert results[True] == results[False]
    assert results[True][0] == plain
    assert results[True][2] < results[True][1]  # some proposals rejected: the chain fed real tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp4"])
def test_cuda_graph_steps_match_eager_steps(qwen2_vl_dir, kv):
    outs = {}
    for eager in (True, False):
        llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_dtype=kv, enforce_eager=eager,
                  kv_cache_memory_bytes=64 << 20)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(reqs(), SamplingParams(max_tokens=24,
                                                                                           ignore_eos=True))]
        if not eager:
            assert llm.runner.graphs.graphs and llm.runner.graphs.num_replays >= 23
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_fp4_gluon_decode_in_cuda_graphs_matches_eager_steps(qwen2_vl_hd128_dir):
    """head_dim 128 with bf16 compute and FP4 KV (no value slots, the default): decode steps run
    the Gluon kernel (kernels/fp4_gluon.py) with its own split count (plan_tiles' fp4_gluon, the
    graph keys'), warmed up at engine start; captured graphs give the eager steps' tokens."""
    from kernels import fp4_gluon

    calls = []
    real = fp4_gluon.launch
    fp4_gluon.launch = lambda *a, **k: (calls.append(a[4].num_splits), real(*a, **k))
    # four requests: a batch the graphs hold without padding rows, so that the bf16 GEMMs of the
    # eager and the captured steps have the same shapes (and sums)
    four = reqs() + [{"prompt": "<|im_start|>user\njumps over the lazy dog"}]
    try:
        outs = {}
        for eager in (True, False):
            llm = LLM(str(qwen2_vl_hd128_dir), device="cuda", dtype="bfloat16", kv_cache_dtype="fp4",
                      enforce_eager=eager, kv_cache_memory_bytes=64 << 20)
            info = llm.cache_info()
            assert llm.runner.backend.fp4_gluon and info["decode_attention"] == "gluon"
            calls.clear()
            outs[eager] = [o.outputs[0].token_ids for o in llm.generate(four, SamplingParams(max_tokens=24,
                                                                                             ignore_eos=True))]
            if eager:
                assert len(calls) >= 23 * 2  # every decode step, both layers
            else:
                assert llm.runner.graphs.graphs and llm.runner.graphs.num_replays >= 23
        assert outs[True] == outs[False], outs
    finally:
        fp4_gluon.launch = real


@pytest.mark.gpu
def test_cuda_graph_speculation_matches_eager_plain_decoding(qwen2_vl_dir):
    plain = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(reqs(), SamplingParams(max_tokens=24, ignore_eos=True))]
    del plain
    llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
              speculative_model=str(qwen2_vl_dir), num_speculative_tokens=3)
    got = [o.outputs[0].token_ids for o in llm.generate(reqs(), SamplingParams(max_tokens=24, ignore_eos=True))]
    assert got == want
    assert llm.runner.graphs.num_replays > 0 and llm.speculator.runner.graphs.num_replays > 0
    assert llm.spec_info()["acceptance_rate"] == 1.0


def overlap_run(folder, monkeypatch, overlap, params, eos=None, **kw):
    with monkeypatch.context() as m:
        llm = static_engine(m, folder, overlap_decode=overlap, **kw)
        if eos is not None:
            llm.eos_token_ids = eos
        outs = llm.generate(reqs(), params)
    return llm, outs


@cpu_only
@pytest.mark.slow
def test_overlapped_decode_gives_the_plain_tokens_and_stops(qwen2_vl_dir, monkeypatch):
    """Decode steps launched before the previous step's tokens are read (input ids from the
    device): the same tokens, stop reasons and texts as reading every step first, with greedy
    rows stopping at EOS part-way (their row of the step in flight is dropped), a row ending at
    its max_tokens before the others and seeded sampled rows; the prefix cache never keys a
    placeholder."""
    base = SamplingParams(max_tokens=10, ignore_eos=True)
    _, plain = overlap_run(qwen2_vl_dir, monkeypatch, False, base)
    toks = [o.outputs[0].token_ids for o in plain]
    # an EOS that the first request emits at its 3rd-5th token (first there) and the text-only
    # request does not emit
    at = next(i for i in range(2, 5) if toks[0][i] not in toks[1] and toks[0][i] not in toks[0][:i])
    eos = {toks[0][at]}
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=8),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7)]
    runs = {}
    for overlap in (False, True):
        llm, outs = overlap_run(qwen2_vl_dir, monkeypatch, overlap, params, eos=eos)
        runs[overlap] = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs],
                         set(llm.block_manager.hash_to_block), llm)
    (want, want_hashes, plain_llm), (got, got_hashes, llm) = runs[False], runs[True]
    assert got == want
    assert want[0][1] == "stop" and len(want[0][0]) == at + 1  # stopped at EOS while others decoded on
    assert want[1][1] == "length" and len(want[1][0]) == 8
    # every step after the first (the prompts' prefill) is launched ahead, also past a row that
    # stops (at EOS, or for sure at its max_tokens: it is left out of the step after)
    assert llm.num_overlapped_steps == llm.num_steps - 1 and plain_llm.num_overlapped_steps == 0
    assert llm.cache_info()["num_overlapped_steps"] == llm.num_overlapped_steps
    assert llm.cache_info()["overlap_decode"] and not plain_llm.cache_info()["overlap_decode"]
    assert got_hashes <= want_hashes  # every committed block keyed by real tokens only
    # the same steps and tokens counted (a stopped sequence's row in the step in flight is not)
    assert (llm.num_steps, llm.num_step_tokens) == (plain_llm.num_steps, plain_llm.num_step_tokens)
    assert llm.overlap.pending is None and llm.block_manager.num_free_blocks == plain_llm.block_manager.num_free_blocks


@cpu_only
@pytest.mark.slow
def test_overlapped_steps_admit_and_prefill_in_chunks_while_rows_decode(qwen2_vl_dir, monkeypatch):
    """Two places and a 48-token budget: requests wait, are admitted as rows finish and prefill in
    chunks (an image's pad tokens split across steps) beside decoding rows. Every step after the
    first is launched before the tokens of the one in flight are read, and the tokens, stops and
    prefix-cache keys are those of reading every step first."""
    prompts = reqs() + reqs()[:2]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 4, 12, 6, 1)]
    runs = {}
    for overlap in (False, True):
        with monkeypatch.context() as m:
            m.setattr(model_runner, "resolve_step_graphs", lambda config, device: "static")
            llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_seqs=2, max_num_batched_tokens=48,
                      overlap_decode=overlap)
            outs = llm.generate(prompts, params)
        runs[overlap] = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs],
                         set(llm.block_manager.hash_to_block), llm)
    (want, want_hashes, plain), (got, got_hashes, llm) = runs[False], runs[True]
    assert got == want
    assert [len(t) for t, _ in got] == [9, 4, 12, 6, 1]
    assert plain.num_overlapped_steps == 0 and llm.num_overlapped_steps == llm.num_steps - 1
    assert llm.num_steps - llm.num_decode_steps >= 4  # steps with prefill chunks (admissions) took part
    assert got_hashes <= want_hashes  # every committed block keyed by real tokens only
    assert (llm.num_steps, llm.num_step_tokens) == (plain.num_steps, plain.num_step_tokens)
    assert llm.overlap.pending is None and llm.block_manager.num_free_blocks == plain.block_manager.num_free_blocks
    assert llm.scheduler.num_random == 0 and not llm.scheduler.running


@cpu_only
def test_cancelling_a_request_whose_prefill_chunk_is_in_flight_stops_it_at_once(qwen2_vl_dir, monkeypatch):
    """An overlapped step in flight may hold a request's prefill chunk, which samples nothing: a
    cancel stops it at once (no more chunks computed), as with reading every step first. An
    unseeded sampled request that arrives while steps overlap ends the overlapping (a stopped
    row's wasted draw would shift its draws from the plain loop's)."""
    from docproc.engine.stream import RequestStream

    words = " ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 8)
    with monkeypatch.context() as m:
        llm = static_engine(m, qwen2_vl_dir, max_num_batched_tokens=32)
        stream = RequestStream(llm)
        stream.add(["<|im_start|>user\nhi"], [SamplingParams(max_tokens=12, ignore_eos=True)], ["a"])
        stream.step()
        b, = stream.add(["<|im_start|>user\n" + words], [SamplingParams(max_tokens=5, ignore_eos=True)], ["b"])
        stream.step()  # b's first chunk is in the step in flight
        seq = b.seqs[0]
        pending = llm.overlap.pending
        assert any(c.seq is seq for c in pending.scheduled) and 0 < len(seq) - 32
        stream.cancel(b)
        assert seq.is_finished and seq.finish_reason == "abort"
        stream.step()  # reads the step that held b's chunk
        tokens = llm.num_step_tokens
        stream.step()
        assert llm.num_step_tokens - tokens == 1  # a's row only: no chunk of b after the cancel
        r, = stream.add(["<|im_start|>user\nrandom"], [SamplingParams(max_tokens=6, temperature=1.0)], ["r"])
        steps = llm.num_overlapped_steps
        while stream.unfinished:
            stream.step()
        assert llm.num_overlapped_steps <= steps + 1  # (the step launched before it came)
        assert llm.scheduler.num_random == 0 and r.seqs[0].is_finished


@cpu_only
@pytest.mark.slow
def test_overlapped_decode_when_the_policy_bypasses_the_draft(qwen2_vl_dir, monkeypatch):
    """The adaptive policy with a draft priced as costly as the target bypasses it on most steps
    and probes now and then: the bypassed steps overlap (a probe's choice, made while the step
    before was in flight, stands), and the output is plain greedy decoding's."""
    _, plain = run(qwen2_vl_dir, False, monkeypatch)
    got = {}
    for overlap in (False, True):
        with monkeypatch.context() as m:
            llm = static_engine(m, qwen2_vl_dir, speculative_model=str(qwen2_vl_dir), num_speculative_tokens="auto",
                                overlap_decode=overlap)
            pol = llm.speculator.policy
            pol.cost_ratio = 2.0  # c prior: no K pays until the draft is timed
            pol.probe_every = pol._probe_interval = 3
            outs = llm.generate(reqs(), SamplingParams(max_tokens=16, ignore_eos=True))
        info = llm.spec_info()
        got[overlap] = [o.outputs[0].token_ids for o in outs]
        assert info["bypassed_steps"] > 0 and info["draft_proposed"] > 0  # bypassed, and probed
        assert (llm.num_overlapped_steps > 0) == overlap
    assert got[True] == got[False]
    assert [t[:10] for t in got[True]] == plain


@cpu_only
@pytest.mark.slow
def test_steps_whose_catch_up_no_sequence_would_pay_overlap_as_bypassed_steps(qwen2_vl_dir, monkeypatch):
    """The policy scores a K that pays at the sequences' acceptance, but no sequence's catch-up
    (the draft has not computed their pages) would pay for itself: such a step is a bypassed one
    and overlaps like any plain step, instead of a speculative step that drafts nothing (which
    cost 7% at batch 32 on an H100), and the answers are plain greedy decoding's."""
    _, plain = run(qwen2_vl_dir, False, monkeypatch)
    with monkeypatch.context() as m:
        llm = static_engine(m, qwen2_vl_dir, speculative_model=str(qwen2_vl_dir), num_speculative_tokens="auto")
        pol = llm.speculator.policy
        pol.cost_ratio = 0.01  # K pays at the prior acceptance
        m.setattr(pol, "worth_catching_up", lambda *a, **k: False)
        outs = llm.generate(reqs(), SamplingParams(max_tokens=10, ignore_eos=True))
    info = llm.spec_info()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert info["draft_proposed"] == 0 and info["catch_up_skips"] > 0
    assert llm.num_overlapped_steps > 0.7 * llm.num_steps, (llm.num_overlapped_steps, llm.num_steps)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp4"])
def test_cuda_overlapped_decode_matches_plain_steps(qwen2_vl_dir, kv):
    """With CUDA graphs the next decode step is queued before the host reads the tokens of the
    one in flight: the same tokens and stops as reading each step first, EOS part-way included."""
    runs = {}
    for overlap in (False, True):
        llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_dtype=kv, overlap_decode=overlap,
                  kv_cache_memory_bytes=64 << 20)
        first = llm.generate(reqs(), SamplingParams(max_tokens=24, ignore_eos=True))
        eos = first[0].outputs[0].token_ids[7]
        llm.eos_token_ids = {eos}
        outs = llm.generate(reqs(), [SamplingParams(max_tokens=24), SamplingParams(max_tokens=20),
                                     SamplingParams(max_tokens=24, temperature=0.9, seed=3)])
        runs[overlap] = ([o.outputs[0].token_ids for o in first],
                         [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert (llm.num_overlapped_steps > 20) == overlap
        assert llm.overlap.pending is None
    assert runs[True] == runs[False]
    assert runs[True][1][0][1] == "stop"
