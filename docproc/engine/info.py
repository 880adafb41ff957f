"""What LLM.cache_info() and LLM.spec_info() report: plain data for manifests and benchmarks."""
from __future__ import annotations

import kernels.pdl as kernels_pdl
from docproc.engine.jit_watch import WATCH

# (the functions take the engine, an LLM, as `llm`: this module sits below llm.py, which imports it)


def cache_info(llm) -> dict:
    """The engine's caches, kernels and step figures (LLM.cache_info)."""
    kv = llm.runner.kv_cache
    bm = llm.block_manager
    enc = llm.runner.encoder_cache.stats
    g = llm.runner.graphs
    return {
        "kv_cache_dtype": kv.dtype_name,
        # what runs decode attention: "gluon" (kernels/fp4_gluon.py: FP4 on CUDA where it can),
        # "triton" (kernels/paged_attention.py) or "torch" (the reference, on CPU)
        "decode_attention": ("gluon" if getattr(llm.runner.backend, "fp4_gluon", False) else "triton")
                            if llm.runner.backend.use_triton else "torch",
        "block_size": kv.block_size,
        "num_blocks": llm.runner.num_usable_blocks,
        "num_reserved_blocks": llm.runner.num_reserved_blocks,
        "bytes_per_token": kv.bytes_per_token,
        "bytes_per_token_bf16": 2 * llm.runner.text_config.num_hidden_layers * 2
                                * llm.runner.text_config.num_key_value_heads * llm.runner.text_config.head_dim,
        # start-up, each part on its own: reading the weights onto the device (the draft's too),
        # compiling or loading the kernels (Triton's disk cache makes a second start cheap), and
        # capturing CUDA graphs (lazily, inside the first steps of each batch size)
        "load_seconds": round(llm.runner.load_seconds
                              + (llm.speculator.runner.load_seconds if llm.speculator else 0.0), 3),
        "kernel_warmup_seconds": round(llm.runner.warmup_seconds, 3),
        "kernel_warmup_compiles": llm.runner.warmup_compiles
                                  + (llm.speculator.runner.warmup_compiles if llm.speculator else 0),
        # Triton kernel variants compiled (or loaded from Triton's disk cache) since the engine
        # started: each was paid inside some step; 0 where warm-up covered every launch (and on CPU)
        "kernel_compiles_after_warmup": len(late := WATCH.since(llm.compile_mark)),
        "kernel_compile_seconds_after_warmup": round(sum(r.seconds for r in late), 3),
        "kernels_compiled_after_warmup": sorted({r.kernel for r in late}),
        # which launches they were (Triton's repr: options and each argument's specialization),
        # the first few: what a warm-up missed
        "kernel_variants_compiled_after_warmup": [r.variant for r in late if r.variant][:4],
        "allocated_bytes": kv.allocated_bytes,
        "num_free_blocks": bm.num_free_blocks,
        "prefix_cache_query_tokens": bm.stats.num_query_tokens,
        "prefix_cache_hit_tokens": bm.stats.num_hit_tokens,
        "prefix_cache_evicted_blocks": bm.stats.num_evicted_blocks,
        "encoder_cache_lookups": enc.num_lookups,
        "encoder_cache_hits": enc.num_hits,
        "num_encoded_images": enc.num_encoded_images,
        "num_preemptions": llm.scheduler.num_preemptions,
        "max_model_len": llm.max_model_len,
        "step_graphs": llm.runner.step_graphs,  # "capture" (CUDA graphs), "static" (tests) or None
        "num_cuda_graphs": len(g.graphs) if g else 0,
        "cuda_graph_capture_seconds": round(g.capture_seconds, 3) if g else 0.0,
        "num_graph_steps": g.num_replays if g else 0,
        # decode steps launched before the tokens of the step in flight were read (overlap_decode)
        "overlap_decode": llm.overlap.enabled,
        "num_overlapped_steps": llm.overlap.num_steps,
        # engine steps (a step: its forward, sampling and the host's work on its tokens) and the
        # seconds spent in them; decode: the steps with no prefill chunk in them
        "num_steps": llm.num_steps,
        "num_step_tokens": llm.num_step_tokens,
        "mean_running_per_step": round(llm.num_step_running / llm.num_steps, 1) if llm.num_steps else 0.0,
        "step_seconds": round(llm.step_seconds, 3),
        "num_decode_steps": llm.num_decode_steps,
        "decode_step_seconds": round(llm.decode_step_seconds, 3),
        # pages' pixel values: prepared ahead on the prefetch threads, or inline in a step, and the
        # seconds steps waited for them (the accelerator idles meanwhile)
        "images_prefetched": llm.runner.prefetcher.num_prefetched,
        "images_preprocessed_inline": llm.runner.prefetcher.num_inline,
        "pixel_wait_seconds": round(llm.runner.prefetcher.take_seconds, 3),
        "one_row_kernels": (llm.runner.kernel_options.one_row and not llm.runner.kernel_options.batch_invariant
                            and llm.runner.device.type == "cuda"),  # kernels/gemv.py
        # answers independent of the batch (kernels/options.py): the invariant products and plans
        "batch_invariant": llm.runner.kernel_options.batch_invariant,
        # programmatic dependent launch, kernels/pdl.py
        "pdl": kernels_pdl.enabled_on(llm.runner.device, llm.runner.kernel_options.pdl),
        # FP8 language-model weights: how they came (None: the model dtype)
        "weights_fp8": llm.runner.model.quant_method,
        "weight_bytes": llm.runner.weight_bytes,
        "device": str(llm.runner.device),
        "dtype": str(llm.runner.dtype).removeprefix("torch."),
    }

def spec_info(llm) -> dict | None:
    """Speculative decoding figures so far (None without a draft)."""
    if llm.speculator is None:
        return None
    sp = llm.speculator
    return {**sp.stats.as_dict(), "k_max": sp.k_max, "adaptive": not sp.policy.fixed,
            "cost_ratio": round(sp.policy.cost_ratio, 4), "overlap_ratio": round(sp.policy.overlap_ratio, 4),
            "draft_vision": sp.vision,
            "catch_up_skips": sp.num_catch_up_skips, "policy": sp.policy.state(),
            "draft_chained_rounds": sp.num_chained_rounds,
            "shared_vision_trunk": sp.runner.trunk_source is not None,
            "draft_images_from_shared_trunk": sp.runner.num_shared_trunk_images,
            "draft_images_encoded": sp.runner.encoder_cache.stats.num_encoded_images
                                    - sp.runner.num_shared_trunk_images,
            "draft_model": sp.runner.config.model,
            "draft_fingerprint": {"text": sp.runner.model.text_fingerprint,
                                  "vision": sp.runner.model.vision_fingerprint}}
