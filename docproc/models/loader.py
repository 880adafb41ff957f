"""Loading local Hugging Face checkpoint folders of Qwen2-VL and Qwen2.5-VL.

Accepts both key namings: published checkpoints (`visual.*`, `model.layers.*`, `lm_head.*`) and
what today's save_pretrained writes (`model.visual.*`, `model.language_model.*`); single or sharded
safetensors; tied embeddings; bf16/fp16/fp32 weights. Never pickle, never remote code.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from docproc.errors import ModelUnavailable
from docproc.models.qwen2_vl import Qwen2VLTextModel, TextConfig
from docproc.models.rope import MRotaryEmbedding
from docproc.models.vision import VisionEncoder

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class CheckpointError(ModelUnavailable, ValueError):
    """The folder is not a checkpoint docproc can load; the message says what is missing."""


def check_folder(folder: str | Path) -> Path:
    """The folder, if it exists and holds a config.json; else CheckpointError saying which."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"model folder {folder} {what}: pass a local checkpoint folder "
                              f"(docproc never downloads models)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face checkpoint: config.json is missing")
    return folder


def read_config(folder: str | Path):
    folder = check_folder(folder)
    cfg_path = folder / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{folder}: model_type {model_type!r} is not supported; docproc loads "
            f"{' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def text_config(hf_config) -> TextConfig:
    tc = getattr(hf_config, "text_config", None) or hf_config
    rope = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (only plain M-RoPE)")
    if getattr(tc, "use_sliding_window", False):
        raise CheckpointError("sliding-window attention checkpoints are not supported")
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 1000000.0))
    tie = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False))
    return TextConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads or tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(theta),
        mrope_section=list(rope.get("mrope_section", [16, 24, 24])),
        tie_word_embeddings=tie,
        max_position_embeddings=tc.max_position_embeddings,
    )


def weight_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds only pickle weights (.bin/.pt), which docproc never loads: convert them to safetensors"
        )
    raise CheckpointError(f"{folder}: no weights found (model.safetensors or a sharded index)")


def canonical_name(name: str) -> tuple[str, str] | None:
    """Map a checkpoint key to (component, parameter name) for either naming."""
    for prefix in ("model.visual.", "visual."):
        if name.startswith(prefix):
            return "vision", name[len(prefix):]
    if name.startswith("model.language_model."):
        return "text", name[len("model.language_model."):]
    if name.startswith("lm_head."):
        return "text", name
    if name.startswith("model."):
        return "text", name[len("model."):]
    return None


@dataclass
class LoadedModel:
    hf_config: object
    text: Qwen2VLTextModel
    vision: VisionEncoder
    vision_fingerprint: str  # trunk + merger weights; keys the encoder cache
    vision_trunk_fingerprint: str  # trunk only (a draft with the same trunk can share its output)
    text_fingerprint: str


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def load_model(folder: str | Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    hf_config = read_config(folder)
    files = weight_files(folder)
    cfg = text_config(hf_config)

    with torch.device("meta"):
        text = Qwen2VLTextModel(cfg)
    text = text.to_empty(device=device).to(dtype)
    text.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section).to(device)
    with torch.device(device):
        vision = VisionEncoder(hf_config)
    vision = vision.to(dtype)

    text_params = dict(text.named_parameters())
    vision_params = dict(vision.visual.named_parameters())
    loaded: set[tuple[str, str]] = set()
    digests: dict[str, dict[str, str]] = {"text": {}, "trunk": {}, "merger": {}}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                mapped = canonical_name(key)
                if mapped is None:
                    if key.endswith("rotary_emb.inv_freq"):
                        continue
                    raise CheckpointError(f"{folder}: unexpected weight {key!r} (not a Qwen2-VL parameter)")
                comp, name = mapped
                params = text_params if comp == "text" else vision_params
                if name not in params:
                    if name.endswith("inv_freq"):
                        continue
                    raise CheckpointError(
                        f"{folder}: unexpected weight {key!r} (no parameter {name} in the {comp} model)")
                t = sf.get_tensor(key)
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"{folder}: weight {key!r} has shape {tuple(t.shape)} but the config implies {tuple(p.shape)}"
                    )
                which = "text" if comp == "text" else ("merger" if name.startswith("merger.") else "trunk")
                # per-tensor digests, combined in name order: the fingerprint ignores sharding
                digests[which][name] = hashlib.sha256(_tensor_bytes(t)).hexdigest()
                with torch.no_grad():
                    p.copy_(t.to(p.dtype))
                loaded.add((comp, name))

    if ("text", "lm_head.weight") not in loaded and cfg.tie_word_embeddings:
        text.lm_head.weight = text.embed_tokens.weight
        loaded.add(("text", "lm_head.weight"))
    missing = [f"{c}:{n}" for c, ps in (("text", text_params), ("vision", vision_params)) for n in ps
               if (c, n) not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{folder}: weights missing from the checkpoint: {', '.join(missing[:5])}{more}")
    text.fuse_projections()
    text.eval()
    vision.eval()
    fp = {k: _combine(d) for k, d in digests.items()}
    vision_fp = _combine({"trunk": fp["trunk"], "merger": fp["merger"]})
    return LoadedModel(hf_config, text, vision, vision_fp, fp["trunk"], fp["text"])


def _combine(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()[:16]
