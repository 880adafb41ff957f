"""Random-weight Qwen2-VL / Qwen2.5-VL checkpoint folders, built from config (no download).

Tests build tiny ones; the GPU smoke run and the benchmarks build Qwen2-VL-2B / -7B geometry.
Usage: python scripts/random_models.py OUT --geometry 2b --dtype bfloat16
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CORPUS = [
    "Invoice number INV-2024-0042 from Acme Corp, total 1,234.56 EUR due 2024-03-01.",
    "Receipt: coffee 3.50, bagel 2.25, total 5.75 USD. Thank you!",
    "What is the vendor? What is the total? Answer with JSON: {\"vendor\": \"Acme\"}",
    "the quick brown fox jumps over the lazy dog 0123456789 ,.;:!?-_/()[]{}",
]


def make_tokenizer(folder: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.save_pretrained(str(folder))


def special_ids() -> dict[str, int]:
    return {s: i for i, s in enumerate(SPECIALS)}


# Published geometries (from the models' config.json files) and a tiny one for tests.
GEOMETRIES = {
    # head_dim 32: the smallest the FP4 kernels take
    "tiny": dict(text=dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, mrope_section=[4, 6, 6], rope_theta=10000.0,
                           max_position_embeddings=4096),
                 vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2)),
    # a smaller language model for speculative-decoding tests (head_dim 32)
    "tiny-draft": dict(text=dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, mrope_section=[4, 6, 6],
                                 rope_theta=10000.0, max_position_embeddings=4096),
                       vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2)),  # tiny's trunk shape
    # head_dim 128 and GQA 2 at toy width: the shapes the Gluon FP4 decode kernel takes (GPU tests)
    "tiny-hd128": dict(text=dict(vocab_size=384, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, mrope_section=[16, 24, 24],
                                 rope_theta=10000.0, max_position_embeddings=4096),
                       vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2)),
    "2b": dict(text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, mrope_section=[16, 24, 24],
                         rope_theta=1000000.0, max_position_embeddings=32768),
               vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4)),
    "7b": dict(text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, mrope_section=[16, 24, 24],
                         rope_theta=1000000.0, max_position_embeddings=32768),
               vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4)),
}


def make_model(folder: Path, model_type: str = "qwen2_vl", *, tie: bool = False, naming: str = "new",
               shards: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0, geometry: str = "tiny",
               init_std: float | None = 0.08, device: str = "cpu", max_pixels: int = 28 * 28 * 16,
               vocab_size: int | None = None) -> Path:
    """Save a random model folder. naming: "new" (model.visual.*, model.language_model.*) or
    "published" (visual.*, model.layers.*, lm_head.*). init_std None keeps transformers' init;
    the tiny default scales weights up so that greedy decoding is far from ties."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    ids = special_ids()
    geo = GEOMETRIES[geometry]
    g = dict(geo["text"])
    g["vocab_size"] = vocab_size or g["vocab_size"]  # rows of the embedding (the tokenizer is the same)
    hidden = g["hidden_size"]
    text = dict(vocab_size=g["vocab_size"], hidden_size=hidden, intermediate_size=g["intermediate_size"],
                num_hidden_layers=g["num_hidden_layers"], num_attention_heads=g["num_attention_heads"],
                num_key_value_heads=g["num_key_value_heads"], max_position_embeddings=g["max_position_embeddings"],
                rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": g["rope_theta"],
                                 "mrope_section": g["mrope_section"]},
                eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"], tie_word_embeddings=tie)
    gv = geo["vision"]
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=tie)
    torch.manual_seed(seed)
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration as cls

        vision = dict(depth=gv["depth"], embed_dim=gv["embed_dim"], hidden_size=hidden, num_heads=gv["num_heads"],
                      mlp_ratio=gv["mlp_ratio"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      in_channels=3)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration as cls

        vision = dict(depth=gv["depth"], hidden_size=gv["embed_dim"], out_hidden_size=hidden,
                      intermediate_size=gv["embed_dim"] * gv["mlp_ratio"], num_heads=gv["num_heads"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], in_channels=3)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    if init_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 2:
                    p.normal_(0, init_std if "embed" not in name else 1.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    _rewrite_weights(folder, naming, shards)
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": max_pixels,
           "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return folder


def share_vision_trunk(src: Path, dst: Path) -> None:
    """Give dst the vision trunk weights of src (everything visual but the merger), as a draft
    built on the target's frozen trunk has them."""
    from safetensors.torch import load_file, save_file

    def trunk_keys(state):
        return {k for k in state if ("visual." in k) and ".merger." not in k}

    src_state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        src_state.update(load_file(str(f)))
    files = sorted(Path(dst).glob("*.safetensors"))
    for f in files:
        state = load_file(str(f))
        for k in trunk_keys(state):
            name = k.split("visual.", 1)[1]
            match = [sk for sk in trunk_keys(src_state) if sk.split("visual.", 1)[1] == name]
            state[k] = src_state[match[0]].clone()
        save_file(state, str(f), metadata={"format": "pt"})


def _rewrite_weights(folder: Path, naming: str, shards: int) -> None:
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
        f.unlink()
    for idx in folder.glob("*.index.json"):
        idx.unlink()
    # transformers' save_pretrained has written either naming depending on its version: normalise
    renamed = {}
    for k, v in state.items():
        if k.startswith("model.visual."):
            k = "visual." + k[len("model.visual."):]
        elif k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        if naming == "new":
            if k.startswith("visual."):
                k = "model." + k
            elif k.startswith("model."):
                k = "model.language_model." + k[len("model."):]
        renamed[k] = v
    state = renamed
    keys = sorted(state)
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--model-type", choices=["qwen2_vl", "qwen2_5_vl"], default="qwen2_vl")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--naming", choices=["new", "published"], default="published")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 1280)
    a = ap.parse_args()
    make_model(Path(a.out), a.model_type, tie=a.tie, naming=a.naming, dtype=getattr(torch, a.dtype), seed=a.seed,
               geometry=a.geometry, init_std=None if a.geometry != "tiny" else 0.08, device=a.device,
               max_pixels=a.max_pixels)
    print(a.out)
