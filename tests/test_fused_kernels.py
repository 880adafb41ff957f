"""kernels/fused.py: each Triton kernel against its torch reference, on irregular shapes (compiled
on a GPU, the interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.fused import add_rms_norm, add_rms_norm_ref, rotary_, rotary_ref, silu_mul, silu_mul_ref

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 1500, generator=g) * 2).to(DEV, dtype)  # two column blocks, the last partial
    out = silu_mul(x)
    ref = silu_mul_ref(x)
    t = tol(dtype)
    assert out.shape == (3, 1500) and torch.allclose(out.float(), ref.float(), rtol=t, atol=t)
