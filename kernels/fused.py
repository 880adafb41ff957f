"""Fused element-wise kernels for the decoder layer: residual add + RMSNorm, M-RoPE rotation of q
and k in place (optionally also writing the rotated k and the v of each token into its paged
cache slot), and SiLU(gate) * up.

Why: a decode step is memory-bound on the weight matmuls, but each torch element-wise op is its
own kernel (~2-4 us even inside a CUDA graph); the layer had ~25 of them (7 per RMSNorm, 5 for
the rotation, 3 for the MLP gate, 2 residual adds). Each kernel here reads its inputs once and
rounds to the model dtype exactly where the torch reference does (so bf16 results match it to
the reduction order of the norm's mean).
"""
from __future__ import annotations

import torch
from kernels._triton import tl, triton

from kernels import pdl


# ---- torch references -----------------------------------------------------------------------------
def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual (in x's dtype; r = x without a residual); returns (weight * norm(r), r),
    transformers' Qwen2RMSNorm: the norm in float32, cast back before the weight."""
    r = x if residual is None else x + residual
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, D); cos, sin: (N, D). x * cos + rotate_half(x) * sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_ref(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                num_q: int) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of q and k heads (N, heads, D): the first num_q heads with
    q_weight, the others with k_weight (add_rms_norm_ref's arithmetic, head by head)."""
    q = add_rms_norm_ref(qk[:, :num_q], None, q_weight, eps)[0]
    k = add_rms_norm_ref(qk[:, num_q:], None, k_weight, eps)[0]
    return torch.cat([q, k], dim=1).to(qk.dtype)


def rotary_store_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                     norm: tuple | None = None) -> torch.Tensor:
    """qkv: (N, H + 2 Hkv, D), the fused projection's output; k_cache, v_cache: (num_slots, Hkv, D).
    Rotates q and k in place (rotary_ref; with norm (q_weight, k_weight, eps), qk_norm_ref first),
    writes row i's k and v heads to slot slots[i] of the caches (in their dtype) and returns q,
    (N, H, D)."""
    hkv = (qkv.shape[1] - num_heads) // 2
    if norm is not None:
        qkv[:, : num_heads + hkv] = qk_norm_ref(qkv[:, : num_heads + hkv], *norm, num_heads)
    qkv[:, : num_heads + hkv] = rotary_ref(qkv[:, : num_heads + hkv], cos, sin)
    k_cache.index_copy_(0, slots, qkv[:, num_heads: num_heads + hkv].to(k_cache.dtype))
    v_cache.index_copy_(0, slots, qkv[:, num_heads + hkv:].to(v_cache.dtype))
    return qkv[:, :num_heads]


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (N, 2I) -> silu(gate) * up, (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- Triton -----------------------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    # sizes
    n_cols, eps,
    # strides
    sx, sr, so, sro,
    # meta
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait (kernels/pdl.py)
    pdl.start(PDL)
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # rounded as torch's add
        tl.store(res_out_ptr + row * sro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    pdl.end(PDL)
    h = (xf * rstd).to(dt).to(tl.float32)
    tl.store(out_ptr + row * so + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, pdl_on: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """As add_rms_norm_ref, in one kernel. x, residual: (N, hidden). pdl_on: launched with PDL
    where the device has it (kernels/pdl.py)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: (num_tokens, hidden), contiguous rows"
    n, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous()
    out = torch.empty(n, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_out, res = x, x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        res_out, res = torch.empty_like(x), residual
    if n:
        _add_rms_norm_kernel[(n,)](
            x, res, weight, out, res_out,
            hidden, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=4 if hidden <= 4096 else 8, **pdl.launch(x, on=pdl_on),
        )
    return out, res_out


@triton.jit
def _rotate_token_(x_ptr, cos_ptr, sin_ptr, t, num_heads, sx_t, sx_h, sc_t, ss_t,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, qw_ptr, kw_ptr, num_q, eps, NORM: tl.constexpr):
    """Token t's first num_heads heads rotated in place; returns them (model dtype) as the two
    halves (BLOCK_H, HALF), with the head index and mask. NORM: each head RMS-normalised first
    (Qwen3's q and k norms: heads below num_q take qw, the others kw), rounded as
    add_rms_norm_ref rounds (the norm in float32, cast, times the weight, cast)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = (h < num_heads)[:, None]
    dt = x_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + t * sc_t + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * sc_t + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * ss_t + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * ss_t + HALF + d).to(tl.float32)[None, :]
    base = x_ptr + t * sx_t + h[:, None] * sx_h + d[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        is_q = (h < num_q)[:, None]
        w1 = tl.where(is_q, tl.load(qw_ptr + d).to(tl.float32)[None, :], tl.load(kw_ptr + d).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d).to(tl.float32)[None, :],
                      tl.load(kw_ptr + HALF + d).to(tl.float32)[None, :])
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # the reference rounds x * cos, rotate_half(x) * sin and their sum, each to the model dtype
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base, o1, mask=hmask)
    tl.store(base + HALF, o2, mask=hmask)
    return o1, o2, h, d, hmask


@triton.jit
def _rotary_kernel(
    # pointers
    x_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    # sizes
    num_heads, num_q, eps,
    # strides
    sx_t, sx_h, sc_t, ss_t,
    # meta
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
):
    _rotate_token_(x_ptr, cos_ptr, sin_ptr, tl.program_id(0), num_heads, sx_t, sx_h, sc_t, ss_t, HALF, BLOCK_H,
                   qw_ptr, kw_ptr, num_q, eps, NORM)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: tuple | None = None) -> torch.Tensor:
    """As rotary_ref, in place on x (N, heads, D) (a strided view, e.g. the q and k heads of a
    fused qkv output); returns x. norm (q_weight, k_weight, eps, num_q): each head RMS-normalised
    first (qk_norm_ref), the first num_q with q_weight."""
    n, heads, d = x.shape
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, f"head_dim/2 must be a power of two, got {d}"
    assert x.stride(2) == 1, "x must be contiguous in head_dim"
    assert cos.shape == (n, d) == sin.shape and cos.stride(1) == 1 and sin.stride(1) == 1
    qw, kw, eps, num_q = norm if norm is not None else (x, x, 0.0, 0)
    if n:
        _rotary_kernel[(n,)](
            x, cos, sin, qw, kw,
            heads, num_q, eps,
            x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads), NORM=norm is not None,
        )
    return x


@triton.jit
def _rotary_store_kernel(
    # pointers
    x_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
    # sizes
    num_heads, num_kv_heads, eps,
    # strides
    sx_t, sx_h, sc_t, ss_t, sk_s, sk_h, sv_s, sv_h,
    # meta
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
):
    """One token: its q and k heads rotated in place (as _rotary_kernel), its rotated k heads and
    its v heads written to its cache slot. Saves the two index_copy_ launches per layer of the
    separate store (each ~2 us inside a CUDA graph: ~0.1 ms of a 7B decode step)."""
    t = tl.program_id(0)
    pdl.start(PDL)
    pdl.wait(PDL)
    o1, o2, h, d, hmask = _rotate_token_(x_ptr, cos_ptr, sin_ptr, t, num_heads + num_kv_heads, sx_t, sx_h, sc_t,
                                         ss_t, HALF, BLOCK_H, qw_ptr, kw_ptr, num_heads, eps, NORM)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl.end(PDL)
    kmask = hmask & (h >= num_heads)[:, None]
    kbase = kc_ptr + slot * sk_s + (h - num_heads)[:, None] * sk_h + d[None, :]
    tl.store(kbase, o1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kbase + HALF, o2.to(kc_ptr.dtype.element_ty), mask=kmask)
    j = tl.arange(0, BLOCK_KV)
    jmask = (j < num_kv_heads)[:, None]
    dd = tl.arange(0, 2 * HALF)
    v = tl.load(x_ptr + t * sx_t + (num_heads + num_kv_heads + j)[:, None] * sx_h + dd[None, :], mask=jmask,
                other=0.0)
    tl.store(vc_ptr + slot * sv_s + j[:, None] * sv_h + dd[None, :], v.to(vc_ptr.dtype.element_ty), mask=jmask)


def rotary_store_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, pdl_on: bool = True,
                  norm: tuple | None = None) -> torch.Tensor:
    """As rotary_store_ref, in one kernel launch: qkv (N, H + 2 Hkv, D) contiguous in D, caches
    (num_slots, Hkv, D) views contiguous in D, slots (N,) int64. Returns q, (N, H, D), a view.
    pdl_on: as add_rms_norm's. norm (q_weight, k_weight, eps): the q and k heads RMS-normalised
    before the rotation (Qwen3; qk_norm_ref)."""
    n, heads, d = qkv.shape
    hkv = (heads - num_heads) // 2
    assert num_heads + 2 * hkv == heads, f"{heads} heads are not {num_heads} q heads plus k and v heads"
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, f"head_dim/2 must be a power of two, got {d}"
    assert qkv.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert k_cache.shape[1:] == (hkv, d) == v_cache.shape[1:] and slots.shape == (n,)
    assert cos.shape == (n, d) == sin.shape and cos.stride(1) == 1 and sin.stride(1) == 1
    qw, kw, eps = norm if norm is not None else (qkv, qkv, 0.0)
    if n:
        _rotary_store_kernel[(n,)](
            qkv, cos, sin, k_cache, v_cache, slots, qw, kw,
            num_heads, hkv, eps,
            qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HALF=d // 2, BLOCK_H=triton.next_power_of_2(num_heads + hkv), BLOCK_KV=max(2, triton.next_power_of_2(hkv)),
            NORM=norm is not None, **pdl.launch(qkv, on=pdl_on),
        )
    return qkv[:, :num_heads]


@triton.jit
def silu_times(g, u, dt: tl.constexpr):
    """SiLU(g) x u from float32 gate and up, rounded as silu_mul_ref does in dtype dt: SiLU rounded
    to dt, then the product (kernels/gemv.py computes its input with it too)."""
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit
def _silu_mul_kernel(
    # pointers
    x_ptr, out_ptr,
    # sizes
    n_cols,
    # strides
    sx, so,
    # meta
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sx + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, silu_times(g, u, dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As silu_mul_ref, in one kernel: (N, 2I) -> (N, I)."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                        BLOCK=block)
    return out
