"""One-row matrix-vector products for batch-1 decode: y = x W^T (+ bias), and the MLP's down
projection with SiLU(gate) x up computed on the fly from the gate/up product (no separate kernel,
no intermediate tensor).

Why: a batch-1 decode step is the weights read once from memory. cuBLAS's kernels for one row
read the 7B layers at ~0.87 of the copy bandwidth (H200 profile, BENCHMARKS.md) and add a split-K reduction kernel to some of them; each kernel in a CUDA graph also
costs a few microseconds of its own. Here each program owns BLOCK_N output columns, streams their
rows of W along K in (BLOCK_N, BLOCK_K) tiles (16-byte loads, many programs per SM to keep enough
bytes in flight), multiplies in float32 and reduces once at the end: no split-K pass.

Numerics: float32 products and sums (as cuBLAS accumulates), the bias added in float32, one
rounding to the output dtype; the gated form rounds SiLU(gate) to the model dtype before the
multiply by up and rounds that product too, as kernels/fused.silu_mul and the torch reference do,
so the down projection sees the same bf16 input either way.
"""
from __future__ import annotations

import torch

from kernels._triton import tl, triton

from kernels import pdl
from kernels.fused import silu_times
from kernels.matmul import matmul
from kernels.options import DEFAULT, KernelOptions

# the model's one-row products go through gemv() on CUDA unless its engine turns them off
# (KernelOptions.one_row, from EngineConfig.one_row_kernels; off: cuBLAS for every product). Products
# of two or more rows go to cuBLAS: a tensor-core kernel over the same streamed tiles measured
# 2.0-2.8x slower at 5 rows.


# ---- torch reference --------------------------------------------------------------------------------
def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             gated: bool = False) -> torch.Tensor:
    """x: (1, K) (or (1, 2K) gate|up when gated), weight (N, K) -> (1, N) in x's dtype."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- Triton -----------------------------------------------------------------------------------------
@triton.jit
def _x_tile(x_ptr, kk, K, GATED: tl.constexpr, EVEN_K: tl.constexpr, dt: tl.constexpr):
    """The input's float32 values at columns kk (SiLU(gate) x up when GATED, with silu_mul's
    roundings, kernels/fused.py)."""
    if EVEN_K:
        if GATED:
            g = tl.load(x_ptr + kk).to(tl.float32)
            u = tl.load(x_ptr + K + kk).to(tl.float32)
        else:
            xv = tl.load(x_ptr + kk).to(tl.float32)
    else:
        kmask = kk < K
        if GATED:
            g = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + kk, mask=kmask, other=0.0).to(tl.float32)
        else:
            xv = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    if GATED:
        xv = silu_times(g, u, dt).to(tl.float32)
    return xv


@triton.jit
def _program_rows(w_ptr, N, sw, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output rows n (BLOCK_N,), their mask, the tile's column offsets k
    (BLOCK_K,) and the pointers to the rows of W (BLOCK_N, 1)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return n, n < N, tl.arange(0, BLOCK_K), w_ptr + n[:, None].to(tl.int64) * sw


@triton.jit
def _w_tile(rows, kk, K, nmask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + kk[None, :], mask=nmask[:, None], other=0.0)
    return tl.load(rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # sizes
    N, K,
    # strides
    sw,
    # meta
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    n, nmask, k, rows = _program_rows(w_ptr, N, sw, BLOCK_N, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    if PDL != 0:
        # PDL (kernels/pdl.py): the first weight tile, then the wait, then everything that reads x.
        # The wait must precede x's loads on every path in the compiled code, so it is not put
        # inside the loop's first iteration (Triton and LLVM may move loads above a conditional
        # wait); tests/test_pdl.py checks the PTX. The long-K gated down projection (7B) lets the
        # next kernel launch only after its loop: on entry it is 11% slower on the H200
        # (BENCHMARKS.md).
        w = _w_tile(rows, k, K, nmask, EVEN_K)
        pdl.start(PDL)
        pdl.wait(PDL)
        acc = w.to(tl.float32) * _x_tile(x_ptr, k, K, GATED, EVEN_K, dt)[None, :]
        k_first = BLOCK_K
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        k_first = 0
    for k0 in range(k_first, K, BLOCK_K):
        kk = k0 + k
        w = _w_tile(rows, kk, K, nmask, EVEN_K)
        acc += w.to(tl.float32) * _x_tile(x_ptr, kk, K, GATED, EVEN_K, dt)[None, :]
    pdl.end(PDL)
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(dt), mask=nmask)


def default_config(n: int, k: int, gated: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an (n, k) weight, from scripts/bench_gemv.py on the H200
    (each product type over all 28 layers, 5 configurations; BENCHMARKS.md):
    - wide outputs (gate|up, the LM head: n >= 8k): 8 x 512, 4 warps;
    - the gated down projection: 4 x 512, 4 warps at 7B (k = 18,944), 8 x 1,024, 8 warps at 2B
      (k = 8,960): the SiLU recomputed per program weighs more against fewer, shorter rows;
    - the rest (qkv, o: n ~ k): 4 rows of 512, 4 warps, the most programs per SM."""
    if gated:
        return (4, 512, 4) if k >= 16384 else (8, 1024, 8)
    if n >= 8 * k:
        return 8, 512, 4
    return 4, 512, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int] | None = None, pdl_on: bool = True) -> torch.Tensor:
    """As gemv_ref, in one kernel. x: (1, K) contiguous ((1, 2K) when gated); weight (N, K) with
    unit stride along K. pdl_on: launched with PDL where the device has it (kernels/pdl.py)."""
    n, k = weight.shape
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 * k if gated else k) and x.stride(-1) == 1
    assert weight.stride(1) == 1 and x.dtype == weight.dtype
    block_n, block_k, warps = config or default_config(n, k, gated)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        GATED=gated, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=warps, **pdl.launch(x, early=not (gated and k >= 16384), on=pdl_on))
    return out


# ---- a few rows: the tensor cores over the same streamed weight tiles ------------------------------
def use_gemv(x: torch.Tensor, opts: KernelOptions = DEFAULT) -> bool:
    """Whether a product with input x takes this kernel: one row on CUDA, where opts allow (not
    in the batch-invariant mode: kernels/matmul.py serves every row count there)."""
    return (opts.one_row and not opts.batch_invariant and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.stride(-1) == 1)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            gated: bool = False, opts: KernelOptions = DEFAULT) -> torch.Tensor:
    """gemv() (callers check use_gemv first)."""
    return gemv(x, weight, bias, gated=gated, pdl_on=opts.pdl)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           opts: KernelOptions = DEFAULT) -> torch.Tensor:
    """F.linear, through gemv() for one row on CUDA (where opts allow); on CUDA in the
    batch-invariant mode through kernels/matmul.py for any row count."""
    if opts.batch_invariant and x.is_cuda:
        return matmul(x, weight, bias)
    if use_gemv(x, opts):
        return product(x, weight, bias, opts=opts)
    return torch.nn.functional.linear(x, weight, bias)
