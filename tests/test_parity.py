"""Model parity against transformers' own Qwen2-VL / Qwen2.5-VL / Qwen3-VL (CPU, float32).

Our engine's logits at every sampled position must match transformers' forward over the same
tokens within 1e-4, and greedy tokens must be identical, for 0/1/2 images, a mixed batch, chunked
prefill (16-token chunks) and prefix-cache hits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from docproc import LLM, SamplingParams

N_TOKENS = 24
IMG_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"


def image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def chat(question: str, n_images: int) -> str:
    return ("<|im_start|>user\n" + IMG_PROMPT * n_images + question + "<|im_end|>\n<|im_start|>assistant\n")


def requests() -> list[dict]:
    a, b, c = image(120, 90, 1), image(60, 200, 2), image(150, 150, 3)
    return [
        {"prompt": chat("What is the total?", 0)},
        {"prompt": chat("What is the vendor?", 1), "multi_modal_data": {"image": [a]}},
        {"prompt": chat("Compare both pages.", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": chat("Invoice number?", 1), "multi_modal_data": {"image": [c]}},
        {"prompt": chat("the quick brown fox", 0)},
        {"prompt": chat("Due date and currency?", 2), "multi_modal_data": {"image": [a, b]}},
    ]


def hf_model(folder):
    from transformers import (AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                              Qwen3VLForConditionalGeneration)

    cls = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": Qwen3VLForConditionalGeneration}[AutoConfig.from_pretrained(folder).model_type]
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def hf_inputs(llm: LLM, token_ids: list[int], images: list) -> dict:
    ids = torch.tensor([token_ids])
    kw = {"input_ids": ids, "mm_token_type_ids": (ids == llm.processor.image_token_id).int()}
    if images:
        pv, grid = llm.processor.pixel_values(images)
        kw.update(pixel_values=pv, image_grid_thw=grid)
    return kw


def run_engine(llm: LLM, reqs: list[dict]):
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(seqs, rows):
        for seq, row in zip(seqs, rows):
            logits.setdefault(seq.request_id, []).append(row.clone())

    llm.runner.logits_hook = hook
    try:
        outs = llm.generate(reqs, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))
    finally:
        llm.runner.logits_hook = None
    return outs, logits


def hf_teacher_forced_logits(llm: LLM, hf, prompt_ids: list[int], gen: list[int], images: list) -> torch.Tensor:
    """transformers' logits over prompt + generated tokens, in one forward without a cache.

    Embeddings and M-RoPE positions are built with transformers' own functions, marking image
    tokens in the prompt only: a random model may generate the image-pad id as a text token, which
    transformers' placeholder check would otherwise count as an image."""
    ids = torch.tensor([prompt_ids + gen])
    types = torch.zeros_like(ids, dtype=torch.int)
    types[0, : len(prompt_ids)] = (ids[0, : len(prompt_ids)] == llm.processor.image_token_id).int()
    emb = hf.model.get_input_embeddings()(ids)
    grid = deep = None
    if images:
        pv, grid = llm.processor.pixel_values(images)
        out = hf.model.get_image_features(pv, grid, return_dict=True)
        emb[0, types[0].bool()] = torch.cat(out.pooler_output)
        if getattr(out, "deepstack_features", None):  # Qwen3-VL: added after the first decoder layers
            deep = [torch.cat(f) for f in out.deepstack_features]
    if grid is not None:
        pos, _ = hf.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
    else:
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    if deep is not None:
        hidden = hf.model.language_model(inputs_embeds=emb, position_ids=pos, visual_pos_masks=types.bool(),
                                         deepstack_visual_embeds=deep).last_hidden_state
        return hf.lm_head(hidden)[0].float()
    return hf(inputs_embeds=emb, position_ids=pos).logits[0].float()


def check_against_hf(llm: LLM, hf, reqs: list[dict], outs, logits) -> None:
    for i, (req, out) in enumerate(zip(reqs, outs)):
        gen = out.outputs[0].token_ids
        assert len(gen) == N_TOKENS
        images = (req.get("multi_modal_data") or {}).get("image", [])
        with torch.no_grad():
            ref = hf_teacher_forced_logits(llm, hf, out.prompt_token_ids, gen, images)  # (L, V)
        p = len(out.prompt_token_ids)
        ref_rows = ref[p - 1: p - 1 + N_TOKENS]
        ours = torch.stack(logits[out.request_id])
        assert ours.shape == ref_rows.shape
        err = (ours - ref_rows).abs().max().item()
        assert err < 1e-4, f"request {i}: max |logit diff| {err}"
        assert ref_rows.argmax(-1).tolist() == gen, f"request {i}: greedy tokens differ"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def pair(request, qwen2_vl_dir, qwen2_5_vl_dir, qwen3_vl_dir):
    folder = {"qwen2_vl": qwen2_vl_dir, "qwen2_5_vl": qwen2_5_vl_dir, "qwen3_vl": qwen3_vl_dir}[request.param]
    return folder, hf_model(folder)


def test_qwen3_vl_tied_published_shards_match_transformers(tmp_path):
    """A Qwen3-VL checkpoint with tied embeddings, in two shards: the mixed batch and its greedy
    tokens as transformers' (the fixture's is untied, one file)."""
    from fixtures.checkpoints import make_model

    folder = make_model(tmp_path / "q3t", "qwen3_vl", geometry="tiny-qwen3", tie=True, shards=2, seed=3)
    hf = hf_model(folder)
    llm = LLM(str(folder), device="cpu")
    reqs = requests()[1:4]
    outs, logits = run_engine(llm, reqs)
    check_against_hf(llm, hf, reqs, outs, logits)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_single_request(pair, n_images):
    folder, hf = pair
    llm = LLM(str(folder), device="cpu")
    req = [r for r in requests() if len((r.get("multi_modal_data") or {}).get("image", [])) == n_images][:1]
    outs, logits = run_engine(llm, req)
    check_against_hf(llm, hf, req, outs, logits)


def test_mixed_batch_of_six(pair):
    folder, hf = pair
    llm = LLM(str(folder), device="cpu")
    reqs = requests()
    outs, logits = run_engine(llm, reqs)
    assert [o.request_id for o in outs] == [str(i) for i in range(6)]  # input order kept
    check_against_hf(llm, hf, reqs, outs, logits)


def test_chunked_prefill_16(pair):
    folder, hf = pair
    llm = LLM(str(folder), device="cpu", max_num_batched_tokens=16)
    reqs = requests()
    outs, logits = run_engine(llm, reqs)
    check_against_hf(llm, hf, reqs, outs, logits)
    assert llm.num_steps > sum(len(o.prompt_token_ids) for o in outs) // 16  # it really chunked


def test_shared_image_prefix_hits(pair):
    folder, hf = pair
    llm = LLM(str(folder), device="cpu")
    page = image(140, 112, 7)
    reqs = [{"prompt": chat(q, 1), "multi_modal_data": {"image": [page]}}
            for q in ("What is the vendor?", "What is the total?", "Invoice number?", "Due date?")]
    outs, logits = run_engine(llm, reqs)
    check_against_hf(llm, hf, reqs, outs, logits)
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert llm.cache_info()["num_encoded_images"] == 1  # the page went through the vision tower once
    # a second round hits the cache for every request, and still matches
    outs2, logits2 = run_engine(llm, reqs)
    assert all(o.metrics.num_cached_tokens > 0 for o in outs2)
    check_against_hf(llm, hf, reqs, outs2, logits2)


def test_hf_generate_agrees(pair):
    """transformers' own generate (with mm_token_type_ids, without which it silently uses 1-D
    positions) gives the same 24 greedy tokens."""
    folder, hf = pair
    llm = LLM(str(folder), device="cpu")
    req = requests()[2]
    out = llm.generate([req], SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))[0]
    kw = hf_inputs(llm, out.prompt_token_ids, req["multi_modal_data"]["image"])
    with torch.no_grad():
        gen = hf.generate(**kw, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert gen[0, len(out.prompt_token_ids):].tolist() == out.outputs[0].token_ids


def test_vision_tower_in_place_activation_gives_transformers_floats(qwen2_vl_dir):
    """The engine's vision tower swaps transformers' QuickGELU for an in-place one (CPU speed):
    the trunk and merged outputs must be transformers' own, bit for bit."""
    from transformers.activations import QuickGELUActivation

    llm = LLM(qwen2_vl_dir, device="cpu")
    enc = llm.runner.model.vision
    assert not any(isinstance(m, QuickGELUActivation) for m in enc.modules())
    assert any(type(m).__name__ == "QuickGELUInPlace" for m in enc.modules())
    hf = hf_model(qwen2_vl_dir)
    pv, grid = llm.processor.pixel_values([image(120, 90, 1), image(150, 150, 3)])
    merged, trunk = enc.encode(pv, grid)
    with torch.no_grad():
        out = hf.model.visual(pv, grid_thw=grid)
    assert torch.equal(torch.cat(merged), out.pooler_output)
    assert torch.equal(torch.cat(trunk), out.last_hidden_state)


@pytest.mark.parametrize("config", [
    None,  # the bundled target's (size: shortest_edge / longest_edge)
    {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
     "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.25]},  # published checkpoints' keys
    {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
     "image_std": [0.5, 0.5, 0.5], "size": {"longest_edge": 16777216, "shortest_edge": 65536}},  # Qwen3-VL's
])
def test_image_processor_gives_transformers_patches(config, tmp_path):
    """Our preprocessing (resize, rescale, normalise, patch order) equals transformers'
    Qwen2VLImageProcessorPil value for value: large pages shrunk, small ones grown, thin strips."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from docproc.pipeline.settings import bundled_model
    from docproc.models.image_processor import ImageProcessor

    folder = bundled_model("target")
    if config is not None:
        folder = tmp_path
        (folder / "preprocessor_config.json").write_text(json.dumps(config))
    hf, ours = Qwen2VLImageProcessorPil.from_pretrained(str(folder)), ImageProcessor.from_folder(folder)
    for w, h in ((620, 877), (2000, 3000), (28, 28), (2000, 30), (113, 57)):
        img = image(w, h, w + h)
        want = hf(images=[img], return_tensors="pt")
        patches, grid = ours.patches(img)
        assert [list(grid)] == want["image_grid_thw"].tolist()
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(patches)), want["pixel_values"]), (w, h)


PUBLISHED_QWEN2_VL_2B = {  # the flat layout published Qwen2-VL checkpoints use (Qwen2-VL-2B-Instruct's fields)
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}


def reads_as_transformers(raw: dict, folder, ours_reader, theirs_class, vision_keys) -> None:
    """raw written as folder/config.json: our reader's language-model config, the vision fields
    named and the top-level fields equal transformers' parse of the same file."""
    import json

    from docproc.models.loader import text_config

    (folder / "config.json").write_text(json.dumps(raw))
    theirs = theirs_class.from_pretrained(str(folder))
    ours = ours_reader(json.loads(json.dumps(raw)))
    assert text_config(ours) == text_config(theirs)
    for k in vision_keys:
        assert getattr(ours.vision_config, k) == getattr(theirs.vision_config, k), k
    for k in ("model_type", "image_token_id", "tie_word_embeddings"):
        assert getattr(ours, k) == getattr(theirs, k), k

    def eos(c):
        return getattr(c, "eos_token_id", None) or getattr(c.text_config, "eos_token_id", None)
    assert eos(ours) == eos(theirs)


@pytest.mark.parametrize("which", ["bundled_target", "bundled_draft", "fixture", "published_flat", "minimal",
                                   "null_kv_heads"])
def test_config_reader_reads_what_transformers_reads(which, qwen2_vl_dir, tmp_path):
    """docproc's config.json reader (no transformers import) against transformers' Qwen2VLConfig:
    the language model's geometry and rope, the vision tower's fields, the image token, tied
    embeddings and the eos fallback, for both layouts and for a config that leans on the defaults."""
    import json

    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig

    from docproc.pipeline.settings import bundled_model
    from docproc.models.hf_config import VISION_DEFAULTS, qwen2_vl_config

    folders = {"bundled_target": bundled_model("target"), "bundled_draft": bundled_model("draft"),
               "fixture": qwen2_vl_dir}
    if which in folders:
        raw = json.loads((folders[which] / "config.json").read_text())
    elif which == "published_flat":
        raw = PUBLISHED_QWEN2_VL_2B
    else:
        raw = {"model_type": "qwen2_vl", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2}}
        if which == "null_kv_heads":
            raw["num_key_value_heads"] = None
    reads_as_transformers(raw, tmp_path, qwen2_vl_config, Qwen2VLConfig, VISION_DEFAULTS)


@pytest.mark.slow
def test_engine_start_imports_no_transformers_modeling_code(qwen2_5_vl_dir, qwen3_vl_dir):
    """The engine's start imports transformers' tokenizer backend only: its modeling, image
    processing and auto-class code pulls in torch._dynamo, torch.distributed's FSDP and more,
    seconds of every start. The bundled pair, a Qwen2.5-VL and a Qwen3-VL model."""
    import subprocess
    import sys

    code = ("import sys; from docproc import LLM; from docproc.pipeline.settings import bundled_model; "
            "LLM(str(bundled_model('target')), device='cpu', speculative_model=str(bundled_model('draft'))); "
            f"LLM({str(qwen2_5_vl_dir)!r}, device='cpu'); LLM({str(qwen3_vl_dir)!r}, device='cpu'); "
            "print(sorted(m for m in ('transformers.modeling_utils', 'torch._dynamo', "
            "'transformers.models.qwen2_vl.modeling_qwen2_vl', 'transformers.image_processing_utils', "
            "'transformers.models.auto.auto_factory', 'torch.distributed.fsdp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_transformers_logits(pair):
    """The language model split over 2 ranks (gloo): the mixed batch, prefilled in chunks, matches
    transformers' logits and greedy tokens as one rank does (Qwen2-VL, and Qwen3-VL: per-head q/k
    norms on each rank's heads, DeepStack features sent with the image embeddings; Qwen2.5-VL's
    language model is Qwen2-VL's code)."""
    folder, hf = pair
    if hf.config.model_type == "qwen2_5_vl":
        pytest.skip("its language model is Qwen2-VL's: the split is the language model's")
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        reqs = requests()
        outs, logits = run_engine(llm, reqs)
        check_against_hf(llm, hf, reqs, outs, logits)
    finally:
        llm.close()


@pytest.mark.parametrize("which", ["fixture", "minimal", "tied_flat_rope"])
def test_qwen3_vl_config_reader_reads_what_transformers_reads(which, qwen3_vl_dir, tmp_path):
    """docproc's reader of a Qwen3-VL config.json against transformers' Qwen3VLConfig: the
    language model's geometry (its own head size, no q/k/v bias, interleaved M-RoPE sections and
    theta, DeepStack's layer count), the tower's fields, the image token and tied embeddings."""
    import json

    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

    from docproc.models.hf_config import QWEN3_VISION_DEFAULTS, qwen3_vl_config

    if which == "fixture":
        raw = json.loads((qwen3_vl_dir / "config.json").read_text())
    else:
        raw = {"model_type": "qwen3_vl", "text_config": {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
                                                         "num_attention_heads": 4, "num_key_value_heads": 2},
               "vision_config": {"depth": 3, "hidden_size": 32, "num_heads": 2, "deepstack_visual_indexes": [0, 2],
                                 "out_hidden_size": 64}}
        if which == "tied_flat_rope":  # the older rope_scaling / rope_theta keys, tied at the top
            raw["tie_word_embeddings"] = True
            raw["text_config"].update(rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12],
                                                    "mrope_interleaved": True}, rope_theta=5000000.0, head_dim=64)
    reads_as_transformers(raw, tmp_path, qwen3_vl_config, Qwen3VLConfig, QWEN3_VISION_DEFAULTS)


@pytest.mark.parametrize("which", ["fixture", "flat"])
def test_qwen2_5_vl_config_reader_reads_what_transformers_reads(which, qwen2_5_vl_dir, tmp_path):
    """docproc's reader of a Qwen2.5-VL config.json against transformers' Qwen2_5_VLConfig: the
    language model, the tower's fields (window size, full-attention blocks, widths) and the top."""
    import json

    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig

    from docproc.models.hf_config import QWEN2_5_VISION_DEFAULTS, qwen2_5_vl_config

    if which == "fixture":
        raw = json.loads((qwen2_5_vl_dir / "config.json").read_text())
    else:  # published checkpoints' flat layout, leaning on the tower's defaults
        raw = {k: v for k, v in PUBLISHED_QWEN2_VL_2B.items() if k != "vision_config"}
        raw.update(model_type="qwen2_5_vl", vision_config={"depth": 4, "hidden_size": 64, "out_hidden_size": 1536,
                                                           "fullatt_block_indexes": [1, 3]})
    reads_as_transformers(raw, tmp_path, qwen2_5_vl_config, Qwen2_5_VLConfig, QWEN2_5_VISION_DEFAULTS)


@pytest.mark.parametrize("change,message", [
    ({"vision_config": {"out_hidden_size": 256}}, "out_hidden_size 256 differs from the language model's hidden_size"),
    ({"text_config": {"rope_parameters": {"mrope_section": [8, 8]}}}, "mrope_section must be three positive integers"),
    ({"text_config": {"rope_parameters": {"mrope_section": ["6", "5", "5"]}}}, "three positive integers"),
    ({"vision_config": {"deepstack_visual_indexes": 1}}, "must be a list of tower layers"),
    ({"vision_config": {"num_heads": 3}}, "must split into 3 heads"),
    ({"text_config": {"attention_bias": True}}, "attention_bias true"),
])
def test_a_qwen3_vl_config_the_model_cannot_run_is_one_clear_error(qwen3_vl_dir, tmp_path, change, message):
    """Fields whose values would give wrong answers or fail every document are refused as the
    config is read, naming the field."""
    import json
    import shutil

    from docproc.models.loader import CheckpointError, read_config

    raw = json.loads((qwen3_vl_dir / "config.json").read_text())
    for part, fields in change.items():
        for k, v in fields.items():
            if isinstance(v, dict):
                raw[part].setdefault(k, {}).update(v)
            else:
                raw[part][k] = v
    folder = tmp_path / "m"
    shutil.copytree(qwen3_vl_dir, folder)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        read_config(folder)
