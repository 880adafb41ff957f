"""The FP4 KV cache inside the engine (CPU: the torch reference path)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from docproc import LLM, SamplingParams
from docproc.engine.kv_cache import KVCache
from docproc.layers.attention import DenseAttention, FP4Attention
from kernels.fp4 import bytes_per_token_head

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def page(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))


def reqs():
    return [{"prompt": "<|im_start|>user\n" + IMG + "What is the total?", "multi_modal_data": {"image": [page(1)]}},
            {"prompt": "<|im_start|>user\nthe quick brown fox"},
            {"prompt": "<|im_start|>user\n" + IMG + "Invoice number?", "multi_modal_data": {"image": [page(1)]}}]


def test_fp4_pool_holds_3_2x_the_tokens_of_bf16_at_head_dim_128():
    budget = 64 << 20
    dense = KVCache(DenseAttention(28, 4, 128, 1.0, torch.device("cpu"), torch.bfloat16, torch.bfloat16), 2, 16, "bf16")
    fp4 = KVCache(FP4Attention(28, 4, 128, 1.0, torch.device("cpu"), torch.bfloat16), 2, 16, "fp4")
    for c in (dense, fp4):
        c.allocate(c.num_blocks_for_bytes(budget))
    per_layer = fp4.bytes_per_token / fp4.num_layers  # keys with 2 outlier slots, values without
    assert per_layer == 4 * (bytes_per_token_head(128) + bytes_per_token_head(128, 0)) == 4 * (78 + 72)
    for c in (fp4,):
        assert c.bytes_per_token / dense.bytes_per_token <= 0.30  # 0.293
        # measured from the allocated pools: bytes per token, and tokens admitted at one budget
        assert c.allocated_bytes / (c.num_blocks * 16) == c.bytes_per_token
        assert dense.allocated_bytes <= budget and c.allocated_bytes <= budget
        assert c.num_blocks / dense.num_blocks >= 3.2


def test_fp4_engine_generates_and_reports_its_format(qwen2_vl_dir):
    llm = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4")
    info = llm.cache_info()
    cfg = llm.runner.text_config
    assert info["kv_cache_dtype"] == "fp4" and info["decode_attention"] == "torch"  # the reference on CPU
    assert info["bytes_per_token"] == cfg.num_hidden_layers * cfg.num_key_value_heads * (
        bytes_per_token_head(cfg.head_dim) + bytes_per_token_head(cfg.head_dim, 0))  # no value slots (default)
    outs = llm.generate(reqs(), SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert outs[2].metrics.num_cached_tokens > 0  # prefix caching works over FP4 pages too


def first_logits(folder, kv):
    llm = LLM(str(folder), device="cpu", kv_cache_dtype=kv)
    got = []
    llm.runner.logits_hook = lambda seqs, logits: got.append(logits.clone())
    llm.generate(reqs(), SamplingParams(max_tokens=1))
    return torch.cat(got)


@pytest.mark.slow
def test_fp4_logits_stay_close_to_fp32_kv(qwen2_vl_dir):
    """Lossy but close: relative logit error at the first generated token (after a whole prefill
    through the FP4 cache) on a random model whose weights are scaled up to be chaotic. bf16 KV
    is the yardstick. The quality tables are in BENCHMARKS.md."""
    ref = first_logits(qwen2_vl_dir, "fp32")
    rel = {kv: ((first_logits(qwen2_vl_dir, kv) - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
           for kv in ("bf16", "fp4")}
    assert rel["bf16"] < 0.005
    assert rel["fp4"] < 0.1


def test_fp4_reads_are_the_same_in_chunked_prefill_and_decode(qwen2_vl_dir):
    """Every token reads stored (quantized) K/V, its own chunk's included, so chunking the prefill
    -- like verifying a speculative window -- changes nothing."""
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    whole = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", enable_prefix_caching=False)
    chunked = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    a = whole.generate(reqs(), sp)
    b = chunked.generate(reqs(), sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_fp4_values_have_no_outlier_slots_and_the_pool_is_sized_from_that(qwen2_vl_dir):
    """The value vectors keep no outlier slots (3 bytes a slot), the keys keep theirs; the engine
    sizes its pool from those pages and decodes alike in chunked and whole prefills."""
    llm = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", enable_prefix_caching=False)
    info = llm.cache_info()
    cfg = llm.runner.text_config
    per_head = bytes_per_token_head(cfg.head_dim)
    assert info["bytes_per_token"] == cfg.num_hidden_layers * cfg.num_key_value_heads * (2 * per_head - 6)
    assert llm.runner.kv_cache.layers[0].v["oval"].shape[-1] == 0
    assert llm.runner.kv_cache.layers[0].k["oval"].shape[-1] == 2
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    chunked = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(reqs(), sp)] == \
        [o.outputs[0].token_ids for o in chunked.generate(reqs(), sp)]


def test_fp4_rejects_small_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        FP4Attention(4, 2, 16, 1.0, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kv", ["auto", "fp4"])
def test_a_greedy_answer_does_not_depend_on_its_batch(qwen2_vl_dir, kv):
    """One request's greedy tokens alone, and inside batches of 2, 4 and 7 requests (other pages,
    other lengths, a text-only one) at different places, with its page's prefix cached or not:
    identical, with the bf16-class KV and with FP4 KV (CPU)."""
    def req(i):
        if i == 2:
            return {"prompt": "<|im_start|>user\nthe quick brown fox"}
        return {"prompt": "<|im_start|>user\n" + IMG + ("Invoice number?" if i % 2 else "What is the total, in words?"),
                "multi_modal_data": {"image": [page(10 + i)]}}

    mine = {"prompt": "<|im_start|>user\n" + IMG + "What is the total?", "multi_modal_data": {"image": [page(1)]}}
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype=kv)
    alone = llm.generate([mine], sp)[0].outputs[0].token_ids
    fresh = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype=kv, enable_prefix_caching=False)
    for engine, size, at in ((llm, 2, 1), (llm, 4, 0), (llm, 7, 5), (fresh, 7, 3), (fresh, 4, 2)):
        batch = [req(i) for i in range(size - 1)]
        batch.insert(at, mine)
        outs = engine.generate(batch, sp)
        assert outs[at].outputs[0].token_ids == alone, (kv, size, at)
