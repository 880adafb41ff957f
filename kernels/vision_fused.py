"""Fused element-wise kernels for the vision tower (Qwen2-VL's ViT, run once per unique page).

Why: transformers' vision attention rotates q and k in float32 with ~14 separate torch kernels per
layer (two casts up, four multiplies, two negations and two concatenations for rotate_half, two
adds, two casts down), and its QuickGELU is three kernels. On the H200, over a page's ~4,800
patches x 32 layers, those took ~7 ms of device time per page in part b's profile (the rotation's
float32 multiplies alone 42.6 ms over 16 pages), against ~0.5 ms for one pass that reads q and k
once and writes them once. Each kernel here computes exactly what its torch reference computes,
in the same order and precision (the rotation's products and sum in float32, no fused
multiply-add, one rounding to the model dtype at the end), so its output equals the reference's.
"""
from __future__ import annotations

import torch
from kernels._triton import tl, triton


# ---- torch references -----------------------------------------------------------------------------
def vision_rotary_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: (N, 3 * heads * D), the fused projection's output; cos, sin: (N, D) float32.
    transformers' apply_rotary_pos_emb_vision on its q and k: x * cos + rotate_half(x) * sin in
    float32, cast back to qkv's dtype. Returns q, k as (N, heads, D)."""
    n = qkv.shape[0]
    q, k, _ = qkv.reshape(n, 3, num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

    def rot(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return ((xf * c) + (torch.cat((-x2, x1), dim=-1) * s)).to(x.dtype)

    return rot(q), rot(k)


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation, x * sigmoid(1.702 x), each op rounded to x's dtype."""
    return x * torch.sigmoid(1.702 * x)


# ---- Triton -----------------------------------------------------------------------------------------
# token and element counts change with every page: not specialized on (a value of 1 or a multiple
# of 16 would each be a kernel variant compiled inside some request; the engine warms up one)
@triton.jit(do_not_specialize=["n_tok"])
def _vision_rotary_kernel(
    # pointers
    qkv_ptr, cos_ptr, sin_ptr, out_ptr,
    # sizes
    n_tok,
    # strides
    s_qkv, s_cos, s_sin,
    # meta
    HD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (token t, which: 0 = q, 1 = k) rotates the token's HD = heads x D values of q or k
    (element e is head e // D, dim e % D; its rotate_half partner is e +- D/2) and writes them to
    out[which, t]."""
    t = tl.program_id(0)
    which = tl.program_id(1)
    e = tl.arange(0, BLOCK)
    mask = e < HD
    d = e % D
    first = d < D // 2
    src = qkv_ptr + t.to(tl.int64) * s_qkv + which * HD
    x = tl.load(src + e, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + tl.where(first, e + D // 2, e - D // 2), mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t.to(tl.int64) * s_cos + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t.to(tl.int64) * s_sin + d, mask=mask, other=0.0).to(tl.float32)
    a = x * c
    b = tl.where(first, -xp, xp) * s
    tl.store(out_ptr + (which * n_tok + t).to(tl.int64) * HD + e, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


def vision_rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As vision_rotary_qk_ref, in one kernel: q and k (N, heads, D), contiguous, in qkv's dtype."""
    n, width = qkv.shape
    hd = width // 3
    d = hd // num_heads
    assert width == 3 * num_heads * d and d % 2 == 0, (qkv.shape, num_heads)
    assert qkv.stride(1) == 1 and cos.shape == (n, d) == sin.shape and cos.stride(1) == 1 == sin.stride(1)
    out = torch.empty(2, n, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        # enable_fp_fusion=False: a separate multiply and add, rounded as torch's kernels round them
        _vision_rotary_kernel[(n, 2)](qkv, cos, sin, out, n, qkv.stride(0), cos.stride(0), sin.stride(0),
                                      HD=hd, D=d, BLOCK=triton.next_power_of_2(hd), enable_fp_fusion=False)
    return out[0], out[1]


@triton.jit(do_not_specialize=["n"])
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    t = (x.to(tl.float32) * 1.702).to(dt).to(tl.float32)  # 1.702 * x, rounded as torch rounds it
    sig = (1.0 / (1.0 + tl.exp(-t))).to(dt).to(tl.float32)
    tl.store(out_ptr + i, (x.to(tl.float32) * sig).to(dt), mask=mask)


def quick_gelu(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """As quick_gelu_ref, in one kernel over a contiguous x (out may be x itself). The sigmoid's
    exp is Triton's, which may differ from torch's in the last float32 bit: the result can then
    differ by one unit of x's dtype in rare elements."""
    assert x.is_contiguous()
    if out is None:
        out = torch.empty_like(x)
    n = x.numel()
    block = 2048
    if n:
        _quick_gelu_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block)
    return out
