"""A weight product whose every output row is computed the same way whatever the number of rows:
y = x W^T (+ bias), for a weight in the compute dtype or an FP8 one (codes x scales, dequantized
in registers: the weight-only product).

Why: cuBLAS picks its kernel, tile and split-K from the row count, and the one-row, few-row and
FP8 tensor-core paths of kernels/gemv.py and kernels/fp8.py each sum in another order, so a
token's hidden state changed in its last bits with the number of rows beside it in the step
(bench/batch_invariance.py: bf16 one row against two, o and down again at 16 rows; FP8 three
regimes up to 0.13 apart). Here one tile shape serves every row count (BLOCK_M x BLOCK_N outputs a
program, the K dimension in BLOCK_K steps from 0 to K, float32 accumulation, no split-K), so row i
of the output is the same sequence of operations on row i of x for 1 row or 10,000: the engine's
batch-invariant mode (KernelOptions.batch_invariant) takes it for every language-model product.
The row count is not a compile-time value (Triton would make a variant for 1 and for multiples of
16).
"""
from __future__ import annotations

import torch

from kernels._triton import tl, triton

# one shape for every call (a row's result depends on these, never on the row count)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    # sizes
    M, N, K, group,
    # strides
    sx, sw, ss, so,
    # meta
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    dt = out_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None].to(tl.int64) * sx
    w_rows = w_ptr + n[:, None].to(tl.int64) * sw
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        kmask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if FP8:  # code x its group's scale in float32, rounded once to the compute dtype
            s = tl.load(s_ptr + n[:, None].to(tl.int64) * ss + (kk // group)[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            w = (w.to(tl.float32) * s).to(dt)
        if DOT_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * so + n[None, :], acc.to(dt), mask=mmask[:, None] & nmask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """x (..., K) times weight (N, K)^T (+ bias (N,)) in x's dtype. With `scale`, weight holds FP8
    codes and scale (N, G) float32 their scales (columns [g * group, (g + 1) * group) of row n share
    scale[n, g]): the product of the dequantized weight, as models/quant.py's Fp8Weight.dequantize
    rounds it to x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, (tuple(weight.shape), k)
    fp8 = scale is not None
    assert fp8 or weight.dtype == x.dtype, (weight.dtype, x.dtype)
    assert not fp8 or scale.shape[1] == 1 or scale.stride(1) == 1, "a scale row's groups must be contiguous"
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        _matmul_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            x2, weight, scale if fp8 else weight, bias if bias is not None else weight, out,
            m, n, k, group if fp8 else 1,
            x2.stride(0), weight.stride(0), scale.stride(0) if fp8 else 0, out.stride(0),
            FP8=fp8, HAS_BIAS=bias is not None, DOT_FP32=x.dtype == torch.float32,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out.view(*lead, n)
