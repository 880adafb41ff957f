"""A draft next to a target: its runner (same engine options, its own seed and cache), the KV
budget split between the two pools, the image-processor check and the shared vision trunk."""
from __future__ import annotations

from dataclasses import replace

from docproc.config import EngineConfig, SpecConfig
from docproc.engine.encoder_cache import EncoderCache
from docproc.engine.model_runner import ModelRunner
from docproc.engine.spec.draft import check_tokenizers
from docproc.engine.spec.proposer import Proposer


def draft_runner(config: EngineConfig, spec: SpecConfig) -> ModelRunner:
    """The draft's runner, its KV pool not allocated yet (attach sizes it from the target's)."""
    check_tokenizers(config.model, spec.model)  # before any weights load
    # the draft's weights are its checkpoint's (float, or FP8 in a layout it ships): quantizing
    # the target at load leaves the draft as it is
    cfg = replace(config, model=str(spec.model), seed=config.seed + 1, quantization=None,
                  cache=replace(config.cache, num_kv_blocks=None),
                  tensor_parallel_size=1)  # the draft runs whole on rank 0
    return ModelRunner(cfg, allocate=False)


def attach(target: ModelRunner, draft: ModelRunner, spec: SpecConfig) -> Proposer:
    """Allocate both KV pools (the budget split by bytes per token, so that both hold the same
    number of tokens) and build the proposer over the draft."""
    t_bpt, d_bpt = target.kv_cache.bytes_per_token, draft.kv_cache.bytes_per_token
    target.allocate_kv(share=t_bpt / (t_bpt + d_bpt))
    draft.allocate_kv(num_blocks=target.num_usable_blocks)
    if spec.draft_vision != "none":
        t_ip, d_ip = target.processor.image_processor, draft.processor.image_processor
        if t_ip.signature != d_ip.signature:
            raise ValueError(
                f"draft image processor differs from target (min/max pixels, patch, temporal patch, merge "
                f"{d_ip.signature} vs {t_ip.signature}): the draft must see the same image tokens; use "
                f"draft_vision='none' or a matching draft")
    cache = target.config.cache
    proposer = Proposer(draft, spec.k_max, spec.adaptive, spec.draft_vision, target.hf_config.image_token_id,
                        cache.enable_prefix_caching, target_vocab=target.text_config.vocab_size)
    t_model, d_model = target.model, draft.model
    if (spec.draft_vision == "auto" and t_model.vision_trunk_fingerprint == d_model.vision_trunk_fingerprint
            and t_model.vision.shares_trunk and d_model.vision.shares_trunk):
        # the page goes through the trunk once; each model applies its own merger
        target.trunk_cache = EncoderCache(cache.encoder_cache_entries, cache.encoder_cache_bytes)
        draft.trunk_source = target.trunk_cache
    return proposer
