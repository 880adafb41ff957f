"""kernels/fused.py: each Triton kernel against its torch reference, on irregular shapes (compiled
on a GPU, the interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.fused import (add_rms_norm, add_rms_norm_ref, rotary_, rotary_ref, rotary_store_, rotary_store_ref, silu_mul,
                           silu_mul_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tol(dtype):
    # one rounding step of the dtype, relative
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(DEV, dtype)
    res = torch.randn(5, 96, generator=g).to(DEV, dtype) if with_residual else None
    w = (1 + torch.randn(96, generator=g) * 0.1).to(DEV, dtype)
    out, r = add_rms_norm(x, res, w, 1e-6)
    ref, r_ref = add_rms_norm_ref(x, res, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    t = tol(dtype)
    if DEV == "cuda" or dtype != torch.bfloat16:  # (the interpreter's bf16 cast truncates)
        assert torch.equal(r, r_ref)  # the residual sum is rounded exactly as torch rounds it
    assert torch.allclose(r.float(), r_ref.float(), rtol=t, atol=t)
    assert torch.allclose(out.float(), ref.float(), rtol=t, atol=t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    n, h, hkv, d = 7, 5, 2, 64
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g).to(DEV, dtype)  # (N, q + k + v heads, D)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([pos, pos], dim=-1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    before = qkv.clone()
    ref = rotary_ref(before[:, : h + hkv], cos, sin)
    out = rotary_(qkv[:, : h + hkv], cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    t = tol(dtype)
    assert torch.allclose(qkv[:, : h + hkv].float(), ref.float(), rtol=t, atol=t)
    assert torch.equal(qkv[:, h + hkv:], before[:, h + hkv:])  # the v heads are untouched


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])
@pytest.mark.parametrize("hkv", [1, 2])
def test_rotary_store_rotates_in_place_and_fills_the_cache_slots(dtype, cache_dtype, hkv):
    g = torch.Generator().manual_seed(3)
    n, h, d, num_slots = 7, 6, 64, 40
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g).to(DEV, dtype)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([pos, pos], dim=-1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    slots = torch.randperm(num_slots, generator=g)[:n].to(DEV)
    caches = [torch.zeros(2, num_slots, hkv, d, dtype=cache_dtype, device=DEV) for _ in range(2)]
    ref_qkv = qkv.clone()
    ref_q = rotary_store_ref(ref_qkv, cos, sin, caches[0][0], caches[0][1], slots, h)
    q = rotary_store_(qkv, cos, sin, caches[1][0], caches[1][1], slots, h)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (n, h, d)
    t = tol(dtype)
    assert torch.allclose(q.float(), ref_q.float(), rtol=t, atol=t)
    assert torch.allclose(qkv.float(), ref_qkv.float(), rtol=t, atol=t)  # q, k rotated; v as it was
    assert torch.equal(qkv[:, h + hkv:], ref_qkv[:, h + hkv:])
    assert torch.allclose(caches[1].float(), caches[0].float(), rtol=t, atol=t)
    assert torch.equal(caches[1][1], caches[0][1])  # v copied exactly
    unused = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    unused[slots] = False
    assert caches[1][:, unused].abs().sum() == 0 and caches[1][:, slots].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_qk_norm_inside_the_rotary_kernels_matches_reference(dtype):
    """Qwen3's per-head q and k RMSNorm done inside the rotation (rotary_ and rotary_store_, norm=):
    the q heads with q's weight, the k heads with k's, then rotated; v heads untouched, the cache
    filled with the normalised, rotated k."""
    from kernels.fused import qk_norm_ref

    g = torch.Generator().manual_seed(5)
    n, h, hkv, d, num_slots = 7, 4, 2, 64, 20
    qkv = (torch.randn(n, h + 2 * hkv, d, generator=g) * 3).to(DEV, dtype)
    qw, kw = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, dtype), (1 + 0.3 * torch.randn(d, generator=g)).to(DEV, dtype)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([pos, pos], dim=-1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    # (the interpreter's bf16 cast truncates, and the norm adds two roundings to the rotation's)
    t = tol(dtype) * (4 if DEV != "cuda" and dtype == torch.bfloat16 else 1)
    ref = rotary_ref(qk_norm_ref(qkv[:, : h + hkv].clone(), qw, kw, 1e-6, h), cos, sin)
    x = qkv.clone()
    rotary_(x[:, : h + hkv], cos, sin, norm=(qw, kw, 1e-6, h))
    assert torch.allclose(x[:, : h + hkv].float(), ref.float(), rtol=t, atol=t)
    assert torch.equal(x[:, h + hkv:], qkv[:, h + hkv:])
    slots = torch.randperm(num_slots, generator=g)[:n].to(DEV)
    caches = [torch.zeros(2, num_slots, hkv, d, dtype=dtype, device=DEV) for _ in range(2)]
    ref_qkv, x = qkv.clone(), qkv.clone()
    ref_q = rotary_store_ref(ref_qkv, cos, sin, caches[0][0], caches[0][1], slots, h, norm=(qw, kw, 1e-6))
    q = rotary_store_(x, cos, sin, caches[1][0], caches[1][1], slots, h, norm=(qw, kw, 1e-6))
    assert torch.allclose(q.float(), ref_q.float(), rtol=t, atol=t)
    assert torch.allclose(caches[1].float(), caches[0].float(), rtol=t, atol=t)
    assert torch.allclose(ref_q.float(), ref[:, :h].float(), rtol=t, atol=t)  # the two references agree


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 1500, generator=g) * 2).to(DEV, dtype)  # two column blocks, the last partial
    out = silu_mul(x)
    ref = silu_mul_ref(x)
    t = tol(dtype)
    assert out.shape == (3, 1500) and torch.allclose(out.float(), ref.float(), rtol=t, atol=t)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fmt", ["dense", "fp4"])
def test_backend_rotary_store_equals_rotate_then_store(fmt, qk_norm):
    """The CUDA model path hands the fused projection output to backend.rotary_store (one kernel
    for a dense cache; with Qwen3's q and k norms inside it); it must leave the cache, and give
    the attention, that normalising, rotating then storing gives (the CPU path)."""
    from kernels.fused import qk_norm_ref
    from docproc.layers.attention import AttentionMetadata, DenseAttention, FP4Attention

    h, hkv, d, bs, n = 4, 2, 32, 4, 9
    dev = torch.device(DEV)
    if fmt == "dense":
        backend = DenseAttention(h, hkv, d, d ** -0.5, dev, torch.float32, torch.float32)
    else:
        backend = FP4Attention(h, hkv, d, d ** -0.5, dev, torch.float32)
    table = [3, 0, 5]
    meta = AttentionMetadata(torch.tensor([table[i // bs] * bs + i % bs for i in range(n)], device=dev),
                             [0, n], [n], [table], bs)
    backend.prepare(meta)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g).to(dev)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = torch.cat([pos, pos], -1).cos().to(dev), torch.cat([pos, pos], -1).sin().to(dev)
    fused_layer, plain_layer = backend.allocate(6, bs), backend.allocate(6, bs)
    norm = (1 + 0.2 * torch.randn(d, generator=g), 1 + 0.2 * torch.randn(d, generator=g), 1e-6) if qk_norm else None
    norm = None if norm is None else (norm[0].to(dev), norm[1].to(dev), norm[2])
    q = backend.rotary_store(fused_layer, qkv.clone(), cos, sin, meta, norm)
    qk = qkv[:, : h + hkv] if norm is None else qk_norm_ref(qkv[:, : h + hkv].clone(), *norm, h)
    qk = rotary_ref(qk, cos, sin)
    backend.store(plain_layer, qk[:, h:], qkv[:, h + hkv:], meta)
    assert torch.allclose(q, qk[:, :h], atol=1e-6)
    if fmt == "dense":
        assert torch.allclose(fused_layer, plain_layer, atol=1e-6)
    else:
        assert torch.equal(fused_layer.pages, plain_layer.pages)
    assert torch.allclose(backend.attend(q, fused_layer, meta), backend.attend(qk[:, :h], plain_layer, meta), atol=1e-5)
