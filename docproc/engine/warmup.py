"""Kernel warm-up beyond attention: the model's fused and one-row kernels compiled (or loaded from
Triton's disk cache) at the model's sizes when the engine starts, so that no step pays for it."""
from __future__ import annotations

import time

import torch


def warm_fused(runner) -> float:
    """CUDA: compile the model's fused kernels (kernels/fused.py: the norm with and without a
    residual, SiLU x up; kernels/gemv.py and kernels/fp8.py: the one-row products;
    kernels/vision_fused.py: the vision tower's rotation and QuickGELU; kernels/token_mask.py: the
    grammar's mask) at this model's sizes.
    Returns seconds."""
    if runner.device.type != "cuda":
        return 0.0
    from kernels.fused import add_rms_norm, silu_mul

    t0 = time.perf_counter()
    tc = runner.text_config
    opts = runner.kernel_options  # the launches the engine's steps make (PDL is a compile-time argument)
    x = torch.zeros(2, tc.hidden_size, dtype=runner.dtype, device=runner.device)
    w = torch.ones(tc.hidden_size, dtype=runner.dtype, device=runner.device)
    add_rms_norm(x, None, w, tc.rms_norm_eps, pdl_on=opts.pdl)
    add_rms_norm(x, x, w, tc.rms_norm_eps, pdl_on=opts.pdl)
    silu_mul(torch.zeros(2, 2 * tc.intermediate, dtype=runner.dtype, device=runner.device))
    from docproc.models.qwen2_vl import project
    from docproc.models.quant import Fp8Weight, fp8_linear
    from kernels.fp8 import ROWS_MAX, TC_ROWS_MAX, tc_warm_rows
    from kernels.gemv import gemv, use_gemv

    x1 = torch.zeros(1, tc.hidden_size, dtype=runner.dtype, device=runner.device)
    text = runner.model.text
    att, mlp = text.layers[0].self_attn, text.layers[0].mlp
    if use_gemv(x1, opts):  # the one-row products of batch-1 decode (kernels/gemv.py, kernels/fp8.py), each shape's
        project(x1, att.qkv_weight, att.qkv_bias, opts)
        project(torch.zeros(1, att.o_proj.in_features, dtype=runner.dtype, device=runner.device), att.o_weight,
                opts=opts)
        project(x1, mlp.gate_up_weight, opts=opts)
        gate_up = torch.zeros(1, 2 * tc.intermediate, dtype=runner.dtype, device=runner.device)
        if isinstance(mlp.down_weight, Fp8Weight):
            fp8_linear(gate_up, mlp.down_weight, gated=True, opts=opts)
        else:
            gemv(gate_up, mlp.down_weight, gated=True, pdl_on=opts.pdl)
        gemv(x1, text.lm_head.weight, pdl_on=opts.pdl)
    if opts.batch_invariant:
        # every product through kernels/matmul.py: one variant per shape, weight kind (an FP8
        # checkpoint may keep some layers' products in float) and bias, over all layers
        seen = set()
        for layer in text.layers:
            a, m = layer.self_attn, layer.mlp
            for w, b, k in ((a.qkv_weight, a.qkv_bias, tc.hidden_size), (a.o_weight, None, a.o_proj.in_features),
                            (m.gate_up_weight, None, tc.hidden_size), (m.down_weight, None, tc.intermediate)):
                kind = (tuple(w.shape), isinstance(w, Fp8Weight), getattr(w, "group", None), b is not None)
                if kind not in seen:
                    seen.add(kind)
                    project(torch.zeros(2, k, dtype=runner.dtype, device=runner.device), w, b, opts)
        text.compute_logits(torch.zeros(2, tc.hidden_size, dtype=runner.dtype, device=runner.device))
    elif isinstance(mlp.down_weight, Fp8Weight):
        # the few-row FP8 kernel of verification windows and small batches (2-15 rows, and 16: a
        # row count Triton specialises as a multiple of 16), past ROWS_MAX each tile shape of the
        # Triton tensor-core product and its activation quantizers, and past TC_ROWS_MAX the
        # quantizer of cuBLAS's
        few = (2, ROWS_MAX) if use_gemv(x1, opts) else (ROWS_MAX,)  # (without: the Triton product's 16-row tile)
        for rows in sorted({*few, *tc_warm_rows(), TC_ROWS_MAX + 1}):
            x2 = torch.zeros(rows, tc.hidden_size, dtype=runner.dtype, device=runner.device)
            project(x2, att.qkv_weight, att.qkv_bias, opts)
            project(torch.zeros(rows, att.o_proj.in_features, dtype=runner.dtype, device=runner.device),
                    att.o_weight, opts=opts)
            project(x2, mlp.gate_up_weight, opts=opts)
            fp8_linear(torch.zeros(rows, 2 * tc.intermediate, dtype=runner.dtype, device=runner.device),
                       mlp.down_weight, gated=True, opts=opts)
    if getattr(runner.model.vision, "fast_attention", False):  # the vision tower's (kernels/vision_fused.py)
        from kernels.vision_fused import quick_gelu, vision_rotary_qk

        vc = runner.model.hf_config.vision_config
        width = vc.embed_dim if runner.model.hf_config.model_type == "qwen2_vl" else vc.hidden_size  # (Qwen3-VL's)
        d = width // vc.num_heads
        cs = torch.zeros(2, d, dtype=torch.float32, device=runner.device)  # transformers' float32 angles
        vision_rotary_qk(torch.zeros(2, 3 * width, dtype=runner.dtype, device=runner.device), cs, cs,
                         vc.num_heads)
        quick_gelu(torch.zeros(2, 16, dtype=runner.dtype, device=runner.device))
    # the grammar's mask on the logits (kernels/token_mask.py), at this vocabulary's widths, for
    # float32 logits and the model's dtype
    from docproc.engine.structured import tokenizer_size
    from kernels.token_mask import apply_token_mask

    width = tc.vocab_size
    known = min(width, tokenizer_size(runner.processor.tokenizer))
    for dtype in {torch.float32, runner.dtype}:
        apply_token_mask(torch.zeros(2, width, dtype=dtype, device=runner.device),
                         torch.zeros(2, (known + 31) // 32, dtype=torch.int32, device=runner.device),
                         torch.zeros(2, dtype=torch.int32, device=runner.device), known)
    torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0
