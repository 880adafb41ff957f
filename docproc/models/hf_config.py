"""A Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint's config.json as the engine reads it: the fields
it uses, with transformers' Qwen2VLConfig / Qwen2_5_VLConfig / Qwen3VLConfig defaults, from either
Qwen2 layout (transformers 5's `text_config` / `vision_config`, or the flat layout published
checkpoints use, text fields at the top; Qwen3-VL's is always nested). Our own reader because
transformers' config classes import its auto-model machinery (torch.distributed's FSDP among it)
as they are defined: 6 s of an engine's start with transformers 5.17 on the H200 machine. A test
compares every field against transformers' own parse of each layout.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

TEXT_DEFAULTS = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 32768, "use_sliding_window": False, "tie_word_embeddings": False,
    "eos_token_id": 151645, "rope_parameters": None,
}
VISION_DEFAULTS = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4,
    "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}
QWEN2_5_VISION_DEFAULTS = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 4,
    "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}
TOP_DEFAULTS = {
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False, "eos_token_id": None,
}
TEXT_ROPE_THETA = 1000000.0


def _fill(defaults: dict, given: dict) -> dict:
    out = copy.deepcopy(defaults)
    out.update({k: v for k, v in given.items() if k in defaults and v is not None})
    return out


def qwen2_5_vl_config(raw: dict) -> SimpleNamespace:
    """Qwen2.5-VL's config.json: Qwen2-VL's language model and layouts, its own tower's fields."""
    return qwen2_vl_config(raw, "qwen2_5_vl")


def qwen2_vl_config(raw: dict, model_type: str = "qwen2_vl") -> SimpleNamespace:
    """model_type, image_token_id, tie_word_embeddings, eos_token_id, text_config and
    vision_config (namespaces), as transformers' Qwen2VLConfig (Qwen2_5_VLConfig) would hold them."""
    if isinstance(raw.get("text_config"), dict):
        text_raw, top_raw = raw["text_config"], raw
    else:  # the flat layout: the text fields (eos_token_id with them) at the top
        text_raw = raw
        top_raw = {k: v for k, v in raw.items() if k not in TEXT_DEFAULTS or k == "tie_word_embeddings"}
    text = _fill(TEXT_DEFAULTS, text_raw)
    if "num_key_value_heads" in text_raw and text_raw["num_key_value_heads"] is None:  # given as null
        text["num_key_value_heads"] = text["num_attention_heads"]
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", text_raw.get("rope_theta") or TEXT_ROPE_THETA)
    if rope.get("rope_type", rope.get("type")) == "mrope":  # M-RoPE is the model's, not a rope type
        rope.pop("type", None)
        rope["rope_type"] = "default"
    rope.setdefault("rope_type", "default")
    text["rope_parameters"] = rope
    vision_raw = raw.get("vision_config") or {}
    if not isinstance(vision_raw, dict):
        raise ValueError(f"config.json: vision_config must be an object, got {type(vision_raw).__name__}")
    vision = _fill(VISION_DEFAULTS if model_type == "qwen2_vl" else QWEN2_5_VISION_DEFAULTS, vision_raw)
    if model_type == "qwen2_5_vl":
        vision["fullatt_block_indexes"] = list(vision["fullatt_block_indexes"])
        if vision["hidden_act"] != "silu":
            raise ValueError(f"config.json: vision_config.hidden_act {vision['hidden_act']!r} is not supported (silu)")
        if vision["window_size"] % (vision["patch_size"] * vision["spatial_merge_size"]):
            raise ValueError(f"config.json: vision_config.window_size {vision['window_size']} must be a multiple of "
                             f"patch_size x spatial_merge_size")
    width = vision["embed_dim"] if model_type == "qwen2_vl" else vision["hidden_size"]
    heads = vision["num_heads"]
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and (width % heads or (width // heads) % 4):
        raise ValueError(f"config.json: the vision tower's width {width} must split into {heads} heads of a "
                         f"multiple of 4 values")
    if model_type == "qwen2_5_vl" and vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(f"config.json: vision_config.out_hidden_size {vision['out_hidden_size']} differs from the "
                         f"language model's hidden_size {text['hidden_size']}")
    top = _fill(TOP_DEFAULTS, top_raw)
    # transformers 4 saved tie_word_embeddings inside text_config; the outer flag wins only if set
    top["tie_word_embeddings"] = bool(top["tie_word_embeddings"] or text["tie_word_embeddings"])
    for where, fields in (("", text), ("vision_config.", vision)):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "depth", "embed_dim", "num_heads",
                  "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "window_size"):
            v = fields.get(k)
            if k in fields and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"config.json: {where}{k} must be a positive integer, got {v!r}")
    return SimpleNamespace(model_type=model_type, text_config=SimpleNamespace(**text),
                           vision_config=SimpleNamespace(**vision), **top)


QWEN3_TEXT_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 128000, "attention_bias": False, "tie_word_embeddings": False,
    "eos_token_id": None, "hidden_act": "silu",
}
QWEN3_VISION_DEFAULTS = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "out_hidden_size": 3584, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}
QWEN3_TEXT_ROPE_THETA = 500000.0
QWEN3_MROPE_SECTION = [24, 20, 20]


def qwen3_vl_config(raw: dict) -> SimpleNamespace:
    """Qwen3-VL's config.json (text_config and vision_config nested), as transformers'
    Qwen3VLConfig would hold it. M-RoPE is interleaved over T/H/W (transformers' Qwen3-VL always
    interleaves, whatever `mrope_interleaved` says)."""
    text_raw = raw.get("text_config")
    vision_raw = raw.get("vision_config") or {}
    if not isinstance(text_raw, dict) or not isinstance(vision_raw, dict):
        raise ValueError("config.json: a Qwen3-VL config needs text_config and vision_config objects")
    text = _fill(QWEN3_TEXT_DEFAULTS, text_raw)
    if text_raw.get("num_key_value_heads", 0) is None:
        text["num_key_value_heads"] = text["num_attention_heads"]
    if text["hidden_act"] != "silu":
        raise ValueError(f"config.json: text_config.hidden_act {text['hidden_act']!r} is not supported (silu)")
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", text_raw.get("rope_theta") or QWEN3_TEXT_ROPE_THETA)
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = "default" if rope_type == "mrope" else rope_type
    rope.setdefault("mrope_section", list(QWEN3_MROPE_SECTION))
    rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    if text["attention_bias"]:
        raise ValueError("config.json: text_config.attention_bias true (q/k/v/o biases) is not supported")
    sections = rope["mrope_section"]
    if not (isinstance(sections, list) and len(sections) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sections)):
        raise ValueError(f"config.json: text_config's mrope_section must be three positive integers, got {sections!r}")
    vision = _fill(QWEN3_VISION_DEFAULTS, vision_raw)
    deep = vision["deepstack_visual_indexes"]
    if not isinstance(deep, (list, tuple)):
        raise ValueError(f"config.json: vision_config.deepstack_visual_indexes must be a list of tower layers, "
                         f"got {deep!r}")
    vision["deepstack_visual_indexes"] = list(deep)
    top = _fill(TOP_DEFAULTS, raw)
    top["tie_word_embeddings"] = bool(top["tie_word_embeddings"] or text["tie_word_embeddings"])
    for where, fields in (("text_config.", text), ("vision_config.", vision)):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "depth", "num_heads", "patch_size",
                  "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            v = fields.get(k)
            if k in fields and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"config.json: {where}{k} must be a positive integer, got {v!r}")
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(f"config.json: vision_config.out_hidden_size {vision['out_hidden_size']} differs from the "
                         f"language model's hidden_size {text['hidden_size']}")
    if vision["hidden_size"] % vision["num_heads"] or (vision["hidden_size"] // vision["num_heads"]) % 4:
        raise ValueError(f"config.json: vision_config.hidden_size {vision['hidden_size']} must split into "
                         f"{vision['num_heads']} heads of a multiple of 4 values")
    side = int(vision["num_position_embeddings"] ** 0.5)
    if side * side != vision["num_position_embeddings"]:
        raise ValueError(f"config.json: vision_config.num_position_embeddings {vision['num_position_embeddings']} "
                         f"is not a square grid")
    bad = [i for i in vision["deepstack_visual_indexes"] if not (isinstance(i, int) and 0 <= i < vision["depth"])]
    if bad or len(vision["deepstack_visual_indexes"]) > text["num_hidden_layers"]:
        raise ValueError(f"config.json: vision_config.deepstack_visual_indexes {vision['deepstack_visual_indexes']} "
                         f"must name tower layers (0-{vision['depth'] - 1}), at most one per decoder layer")
    return SimpleNamespace(model_type="qwen3_vl", text_config=SimpleNamespace(**text),
                           vision_config=SimpleNamespace(**vision), **top)
