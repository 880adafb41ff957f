"""Speculative decoding in the engine (CPU, float32): lossless against plain decoding."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from docproc import LLM, SamplingParams

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from fixtures.checkpoints import make_model

    return make_model(tmp_path_factory.mktemp("draft"), geometry="tiny-draft", seed=3)


def page(seed, w=120, h=90):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def reqs():
    shared = page(1)
    q = ["What is the vendor?", "What is the total?", "Invoice number?", "Due date?"]
    return ([{"prompt": "<|im_start|>user\n" + IMG + x, "multi_modal_data": {"image": [shared]}} for x in q]
            + [{"prompt": "<|im_start|>user\nthe quick brown fox"},
               {"prompt": "<|im_start|>user\n" + IMG + IMG + "both", "multi_modal_data": {"image": [page(2), page(3)]}}])


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(qwen2_vl_dir):
    return tokens(LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16).generate(reqs(), GREEDY))


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_random_draft_is_lossless_with_chunked_prefill_and_prefix_hits(qwen2_vl_dir, draft_dir, plain, k):
    llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(draft_dir),
              num_speculative_tokens=k)
    outs = llm.generate(reqs(), GREEDY)
    assert tokens(outs) == plain
    assert any(o.metrics.num_cached_tokens > 0 for o in outs)
    info = llm.spec_info()
    if k != "auto":
        assert info["draft_proposed"] > 0
    assert sum(o.metrics.draft_proposed for o in outs) == info["draft_proposed"]
    assert sum(o.metrics.draft_accepted for o in outs) == info["draft_accepted"]
    assert not any(llm.speculator.block_manager.ref_counts)
    for o in outs:  # per-request figures add up
        m = o.metrics
        assert sum(m.draft_accepted_length_histogram.values()) == m.draft_verifications
        assert sum(a * n for a, n in m.draft_accepted_length_histogram.items()) == m.draft_accepted
        assert sum(k * n for k, n in m.draft_k_histogram.items()) == m.draft_proposed
    assert sum(o.metrics.draft_verifications for o in outs) == info["verifications"]
    assert sum(o.metrics.draft_bypassed_steps for o in outs) == info["bypassed_steps"]
    # the four queries on one page: the draft's own prefix cache serves the page to all but the first
    assert llm.speculator.block_manager.stats.num_hit_tokens > 0


@pytest.mark.slow
def test_draft_with_a_differently_padded_vocabulary(qwen2_vl_dir, tmp_path, plain):
    """Qwen2-VL-7B and -2B share a tokenizer but not their embedding rows (152064 vs 151936): a
    draft with fewer or more rows than the target is still lossless, greedy and sampled."""
    from fixtures.checkpoints import make_model

    for rows in (352, 448):  # the target has 384
        d = make_model(tmp_path / f"d{rows}", geometry="tiny-draft", seed=3, vocab_size=rows)
        llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(d),
                  num_speculative_tokens=3)
        assert tokens(llm.generate(reqs(), GREEDY)) == plain
        sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
        a, b = tokens(llm.generate(reqs(), sampled)), tokens(llm.generate(reqs(), sampled))
        assert a == b and all(t < 384 for row in a for t in row)


def test_draft_equal_to_target_accepts_everything(qwen2_vl_dir, plain):
    llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(qwen2_vl_dir),
              num_speculative_tokens=4)
    outs = llm.generate(reqs(), GREEDY)
    assert tokens(outs) == plain
    info = llm.spec_info()
    assert info["acceptance_rate"] == 1.0 and info["draft_proposed"] > 0
    # 24 tokens at K=4 take ceil(24 / 5) verifications (the first token comes from the prefill)
    assert max(info["accepted_length_histogram"]) == 4


def test_draft_without_vision_is_lossless(qwen2_vl_dir, draft_dir, plain):
    llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(draft_dir),
              num_speculative_tokens=3, draft_vision="none")
    assert tokens(llm.generate(reqs(), GREEDY)) == plain
    assert llm.speculator.runner.encoder_cache.stats.num_encoded_images == 0


@pytest.mark.slow
def test_speculation_with_fp4_kv_is_lossless_relative_to_plain_fp4(qwen2_vl_dir, draft_dir):
    plain4 = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4").generate(reqs(), GREEDY)
    spec4 = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", speculative_model=str(qwen2_vl_dir),
                num_speculative_tokens=4).generate(reqs(), GREEDY)
    assert tokens(spec4) == tokens(plain4)
    spec4r = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4", speculative_model=str(draft_dir),
                 num_speculative_tokens=2).generate(reqs(), GREEDY)
    assert tokens(spec4r) == tokens(plain4)


@pytest.mark.slow
def test_stops_and_max_tokens_inside_an_accepted_run(qwen2_vl_dir):
    llm = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(qwen2_vl_dir), num_speculative_tokens=6)
    base = LLM(str(qwen2_vl_dir), device="cpu")
    for sp in (SamplingParams(max_tokens=7, ignore_eos=True), SamplingParams(max_tokens=30)):
        a, b = base.generate(reqs(), sp), llm.generate(reqs(), sp)
        assert tokens(a) == tokens(b)
        assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    full = base.generate(reqs()[4:5], GREEDY)[0].outputs[0]
    stop = full.text[4:7]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
    assert llm.generate(reqs()[4:5], sp)[0].outputs[0].text == base.generate(reqs()[4:5], sp)[0].outputs[0].text


@pytest.mark.slow
def test_seeded_sampling_with_a_draft_reproduces_itself(qwen2_vl_dir, draft_dir):
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=77)
    runs = [LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(draft_dir), num_speculative_tokens=3)
            .generate(reqs(), sp) for _ in range(2)]
    assert tokens(runs[0]) == tokens(runs[1])


def test_mismatched_tokenizers_fail_before_weights_load(qwen2_vl_dir, tmp_path, monkeypatch):
    from fixtures.checkpoints import make_tokenizer

    other = tmp_path / "other"
    other.mkdir()
    for f in qwen2_vl_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (other / f.name).write_bytes(f.read_bytes())
    make_tokenizer(other, vocab_size=320)

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the tokenizer check")

    monkeypatch.setattr("docproc.engine.model_runner.load_model", no_weights)
    with pytest.raises(ValueError, match=r"draft tokenizer differs from target \(vocab hash \w+ vs \w+\)"):
        LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(other))


@pytest.mark.slow
def test_draft_sharing_the_target_vision_trunk_encodes_each_page_once(qwen2_vl_dir, tmp_path, plain):
    from fixtures.checkpoints import make_model, share_vision_trunk

    draft = make_model(tmp_path / "draft_shared", geometry="tiny-draft", seed=5)
    share_vision_trunk(qwen2_vl_dir, draft)
    llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(draft),
              num_speculative_tokens=3)
    assert llm.runner.model.vision_trunk_fingerprint == llm.speculator.runner.model.vision_trunk_fingerprint
    assert tokens(llm.generate(reqs(), GREEDY)) == plain
    info = llm.spec_info()
    assert info["shared_vision_trunk"] and info["draft_images_encoded"] == 0
    assert info["draft_images_from_shared_trunk"] == 3  # three distinct pages, merged by the draft
    # the draft's merger over the target's trunk output is exactly the draft's own encoding
    import torch

    pv, grid = llm.processor.pixel_values([page(1)])
    _, trunk = llm.runner.model.vision.encode(pv, grid)
    own_merged, _ = llm.speculator.runner.model.vision.encode(pv, grid)
    assert torch.allclose(llm.speculator.runner.model.vision.merge(trunk[0]), own_merged[0], atol=1e-5)
    # with its own tower the draft would have encoded them again
    own = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(draft), num_speculative_tokens=3,
              draft_vision="own")
    own.generate(reqs(), GREEDY)
    assert own.spec_info()["draft_images_encoded"] == 3 and not own.spec_info()["shared_vision_trunk"]


def test_a_prompt_finishing_in_a_one_token_chunk_gets_window_slots(qwen2_vl_dir):
    """A prompt whose cached prefix leaves one token to compute is verified with a window at
    admission, before the scheduler's decode path ever reserved lookahead slots for it: with
    8-token blocks, 17 tokens (16 cached) plus a 15-token window need a fourth block."""
    prompt = [{"prompt_token_ids": [10 + i % 50 for i in range(17)]}]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = tokens(LLM(str(qwen2_vl_dir), device="cpu", block_size=8).generate(prompt, sp))
    llm = LLM(str(qwen2_vl_dir), device="cpu", block_size=8, speculative_model=str(qwen2_vl_dir),
              num_speculative_tokens=15)
    assert tokens(llm.generate(prompt, sp)) == want
    again = llm.generate(prompt, sp)  # 16 tokens from the prefix cache, 1 to compute
    assert again[0].metrics.num_cached_tokens == 16 and tokens(again) == want


def test_draft_with_other_image_settings_needs_text_only_mode(qwen2_vl_dir, tmp_path):
    import json

    other = tmp_path / "other_pixels"
    other.mkdir()
    for f in qwen2_vl_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    pre = json.loads((other / "preprocessor_config.json").read_text())
    pre["max_pixels"] = 28 * 28 * 64
    (other / "preprocessor_config.json").write_text(json.dumps(pre))
    with pytest.raises(ValueError, match="draft image processor differs"):
        LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(other))
    llm = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(other), draft_vision="none")
    assert len(llm.generate(reqs()[:1], GREEDY)[0].outputs[0].token_ids) == 24


def test_a_probe_drafts_for_one_sequence_only(qwen2_vl_dir, draft_dir, plain):
    """A probe step (the bypassing policy checking acceptance) drafts for the one decoding
    sequence whose draft has least to catch up, not for the whole batch: each drafting sequence
    would first cost the draft a prefill of what it skipped."""
    llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_batched_tokens=16, speculative_model=str(draft_dir),
              num_speculative_tokens="auto")
    pol, spec = llm.speculator.policy, llm.speculator

    def always_probe(seq_ids):
        pol.probing = bool(seq_ids)
        return 1 if seq_ids else 0

    pol.choose_step = always_probe
    sizes, propose = [], spec.propose

    def counting(work, rec):
        sizes.append(len([w for w in work if w[1] > 0]))
        return propose(work, rec)

    spec.propose = counting
    outs = llm.generate(reqs(), GREEDY)
    assert tokens(outs) == plain
    assert max(sizes) == 1 and sum(sizes) > 0
    assert llm.spec_info()["bypassed_steps"] > 0  # the other decoding sequences of each step


def test_a_qwen3_vl_draft_is_lossless_for_a_qwen3_vl_target(qwen3_vl_dir, tmp_path):
    """Qwen3-VL as target and as draft (other weights; each encodes the page with its own tower
    and DeepStack mergers), chunked prefill and prefix hits, FP4 KV too: the plain greedy tokens."""
    from fixtures.checkpoints import make_model

    draft = make_model(tmp_path / "q3draft", "qwen3_vl", geometry="tiny-qwen3", seed=4)
    for kv in ("auto", "fp4"):
        want = tokens(LLM(str(qwen3_vl_dir), device="cpu", max_num_batched_tokens=16, kv_cache_dtype=kv)
                      .generate(reqs(), GREEDY))
        llm = LLM(str(qwen3_vl_dir), device="cpu", max_num_batched_tokens=16, kv_cache_dtype=kv,
                  speculative_model=str(draft), num_speculative_tokens=4)
        outs = llm.generate(reqs(), GREEDY)
        assert tokens(outs) == want, kv
        assert llm.spec_info()["draft_proposed"] > 0 and any(o.metrics.num_cached_tokens > 0 for o in outs)


def test_a_draft_of_another_family_is_refused_before_weights_load(qwen2_vl_dir, qwen3_vl_dir, monkeypatch):
    """A Qwen2-VL draft for a Qwen3-VL target (and the reverse): one line naming both families,
    before any weights load (the tiny fixtures share a tokenizer, so the family is what refuses)."""
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the family check")

    monkeypatch.setattr("docproc.engine.model_runner.load_model", no_weights)
    for target, draft, want in ((qwen3_vl_dir, qwen2_vl_dir, "a Qwen2-VL model and the target a Qwen3-VL"),
                                (qwen2_vl_dir, qwen3_vl_dir, "a Qwen3-VL model and the target a Qwen2-VL")):
        with pytest.raises(ValueError, match=want):
            LLM(str(target), device="cpu", speculative_model=str(draft))
