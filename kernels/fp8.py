"""FP8 weight products: y = x W^T (+ bias) with W held as float8_e4m3fn codes and float32 scales
(one per output row and group of GROUP_K input columns; GROUP_K = K: one per row).

- torch reference (`fp8_linear_ref`): W dequantized to x's dtype (code x scale in float32, one
  rounding), then the float product: the CPU path, and what the CUDA paths are compared with.
- one row on CUDA (`gemv_fp8`): batch-1 decode reads the codes once, 1 byte a weight. Each
  program owns BLOCK_N output rows and streams them along K in (BLOCK_N, BLOCK_K) tiles as
  kernels/gemv.py does; products and sums in float32, each group's partial sum times its scale.
  The gated form computes SiLU(gate) x up from the gate|up product on the fly (down projection).
- a few rows on CUDA (`gemm_fp8_rows`, verification windows and batches up to ROWS_MAX): the
  codes read once for all rows, converted exactly to the input's dtype (weight-only).
- a decode batch on CUDA (`gemm_fp8_tc`, up to TC_ROWS_MAX rows): the input quantized per row
  (or per row and group) in one kernel, then a Triton product on the FP8 tensor cores whose tile
  holds every row, so each weight tile is read once; its K split where the tiles alone leave SMs
  idle.
- more rows on CUDA (`scaled_mm`): the input quantized per row (token), then the FP8 tensor
  cores through torch._scaled_mm with row-wise scales (per-row weights); `scaled_mm_blocks` for
  128 x 128 block-wise weights: the input quantized per row and 128 columns, then cuBLAS's block
  scaling (torch.nn.functional.scaled_mm).
"""
from __future__ import annotations

import functools

import torch

from kernels._triton import tl, triton

from kernels import pdl
from kernels.gemv import _program_rows, _w_tile, _x_tile

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# scales are max |x| times this (a float32 product), codes x times the scale's reciprocal (an
# IEEE float32 division, then a product): the same arithmetic in the torch references and the
# kernels, so that their codes are equal (Triton's `/` on float32 is an approximate division)
INV_FP8_MAX = 1.0 / FP8_MAX


# ---- torch reference --------------------------------------------------------------------------------
def dequantize_ref(data: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) codes and (N, G) scales -> W (N, K) in dtype."""
    n, k = data.shape
    g = scale.shape[1]
    w = data.float()
    if g == 1:
        return (w * scale).to(dtype)
    pad = g * group - k
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return (w.view(n, g, group) * scale[:, :, None]).view(n, -1)[:, :k].to(dtype)


def fp8_linear_ref(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, group: int,
                   bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    return torch.nn.functional.linear(x, dequantize_ref(data, scale, group, x.dtype), bias)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) dynamic FP8: (codes (M, K), scales (M, 1) float32), x ~ codes x scale.
    amax (M, 1) float32: each row's max |value| where x holds only some of its columns."""
    if amax is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
    s = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    return (x.float() * torch.reciprocal(s)).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def quantize_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group`-columns dynamic FP8 (the activations of block-wise products): codes
    (M, K) and scales (M, ceil(K / group)) float32, each group's max |value| / 448 (1 for a group
    of zeros)."""
    m, k = x.shape
    g = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(m, g, group)
    amax = xf.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    return (xf * torch.reciprocal(s)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, -1)[:, :k], s


# ---- Triton: dynamic activation quantization (one pass, one kernel) --------------------------------
@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, sx, sq, ss_row, ss_col, INV: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """PER_ROW: program r writes row r's codes and scale (the row read twice: its maximum, then
    its codes). Else program (r, c) writes row r's BLOCK // GROUP groups of GROUP columns from
    column c * BLOCK, each with its own scale. Arithmetic as quantize_rows (INV_FP8_MAX)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if PER_ROW:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * sx + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        m = tl.max(amax, 0)
        s = tl.where(m > 0, m * INV, 1.0)
        r = tl.math.div_rn(1.0, s)
        tl.store(s_ptr + row * ss_row, s)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * sx + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * r, -448.0, 448.0)
            tl.store(q_ptr + row * sq + k0 + cols, q.to(tl.float8e4nv), mask=k0 + cols < K)
    else:
        GROUPS: tl.constexpr = BLOCK // GROUP
        c = tl.program_id(1) * BLOCK + cols
        x = tl.load(x_ptr + row * sx + c, mask=c < K, other=0.0).to(tl.float32)
        xg = tl.reshape(x, [GROUPS, GROUP])
        m = tl.max(tl.abs(xg), 1)
        s = tl.where(m > 0, m * INV, 1.0)
        r = tl.math.div_rn(tl.full([GROUPS], 1.0, tl.float32), s)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        tl.store(s_ptr + row * ss_row + g * ss_col, s, mask=g * GROUP < K)
        q = tl.reshape(tl.clamp(xg * r[:, None], -448.0, 448.0), [BLOCK])
        tl.store(q_ptr + row * sq + c, q.to(tl.float8e4nv), mask=c < K)


def quantize_rows_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows (amax from the whole row) in one kernel: (codes (M, K), scales (M, 1))."""
    m, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), 0, INV=INV_FP8_MAX,
                               GROUP=1, BLOCK=min(4096, triton.next_power_of_2(k)), PER_ROW=True, num_warps=8)
    return q, s


def quantize_groups(x: torch.Tensor, group: int, scales: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups_ref in one kernel. scales: where to write the (M, ceil(K / group)) scales
    (any strides: the layout a product wants), else a new row-major tensor; out: where to write
    the codes (its first M rows), else a new (M, K) tensor."""
    m, k = x.shape
    assert x.stride(-1) == 1 and group & (group - 1) == 0
    g = -(-k // group)
    q = out if out is not None else torch.empty(m, k, dtype=FP8, device=x.device)
    assert q.shape[0] >= m and q.shape[1] == k and q.stride(-1) == 1
    s = scales if scales is not None else torch.empty(m, g, dtype=torch.float32, device=x.device)
    assert s.shape[0] >= m and s.shape[1] >= g
    if m:
        block = max(group, min(1024, triton.next_power_of_2(k)))  # a program: up to 1,024 columns of a row
        _quantize_kernel[(m, triton.cdiv(k, block))](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                      INV=INV_FP8_MAX, GROUP=group, BLOCK=block, PER_ROW=False, num_warps=4)
    return q, s


# ---- Triton: one row ---------------------------------------------------------------------------------
@triton.jit
def _fp8_accumulate(acc, w, x_ptr, kk, k0, K, s_ptr, n, nmask, ss, num_groups, GATED: tl.constexpr,
                    EVEN_K: tl.constexpr, dt: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr):
    """acc plus one (BLOCK_N, BLOCK_K) tile of codes w times the input at columns kk: summed per
    group and scaled (group-wise), or kept per column (per-row scales, applied at the end)."""
    prod = w.to(tl.float32) * _x_tile(x_ptr, kk, K, GATED, EVEN_K, dt)[None, :]
    if PER_ROW:
        return acc + prod
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    g = k0 // GROUP_K + tl.arange(0, GROUPS)
    s = tl.load(s_ptr + n[:, None] * ss + g[None, :], mask=nmask[:, None] & (g < num_groups)[None, :], other=0.0)
    return acc + tl.sum(tl.reshape(prod, [BLOCK_N, GROUPS, GROUP_K]), 2) * s


@triton.jit
def _gemv_fp8_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    # sizes
    N, K, num_groups,
    # strides
    sw, ss,
    # meta
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, PER_ROW: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    n, nmask, k, rows = _program_rows(w_ptr, N, sw, BLOCK_N, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    if PER_ROW:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, GROUPS], tl.float32)
    k_first = 0
    if PDL != 0:
        # as kernels/gemv.py: the first tile of codes (weights only) before the wait, then
        # everything that reads the input (kernels/pdl.py's rules)
        w = _w_tile(rows, k, K, nmask, EVEN_K)
        pdl.start(PDL)
        pdl.wait(PDL)
        acc = _fp8_accumulate(acc, w, x_ptr, k, 0, K, s_ptr, n, nmask, ss, num_groups, GATED, EVEN_K, dt, PER_ROW,
                              BLOCK_N, BLOCK_K, GROUP_K)
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        kk = k0 + k
        w = _w_tile(rows, kk, K, nmask, EVEN_K)
        acc = _fp8_accumulate(acc, w, x_ptr, kk, k0, K, s_ptr, n, nmask, ss, num_groups, GATED, EVEN_K, dt, PER_ROW,
                              BLOCK_N, BLOCK_K, GROUP_K)
    pdl.end(PDL)
    y = tl.sum(acc, 1)
    if PER_ROW:
        y = y * tl.load(s_ptr + n * ss, mask=nmask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(dt), mask=nmask)


def default_config(n: int, k: int, gated: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from `scripts/bench_gemv.py --fp8` on the H200 at the 7B
    geometry (every layer's weights, six configurations; BENCHMARKS.md):
    - the gated down projection: 8 rows of 1,024 codes (its SiLU x up input, 4 bytes a column,
      shared by more rows), 0.66 of the copy bandwidth against 0.59 with 4 rows;
    - outputs wider than the input (gate|up, q|k|v): 8 rows of 512, 0.88 and 0.51 (against 0.76, 0.48);
    - square ones (o): 4 rows of 1,024, 0.59 (the most programs per SM)."""
    if gated:
        return 8, 1024, 4
    if n > k:
        return 8, 512, 4
    return 4, 1024, 4


def gemv_fp8(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, group: int,
             bias: torch.Tensor | None = None, gated: bool = False,
             config: tuple[int, int, int] | None = None, pdl_on: bool = True) -> torch.Tensor:
    """fp8_linear_ref for one row, in one kernel (pdl_on: as gemv's). x: (1, K) contiguous ((1, 2K) when gated); data
    (N, K) float8 codes with unit stride along K; scale (N, G) float32 (G = 1: per row; else
    groups of `group` columns, a power of two dividing BLOCK_K)."""
    n, k = data.shape
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 * k if gated else k) and x.stride(-1) == 1
    assert data.dtype == FP8 and data.stride(1) == 1 and scale.dtype == torch.float32 and scale.shape[0] == n
    block_n, block_k, warps = config or default_config(n, k, gated)
    per_row = scale.shape[1] == 1
    group_k = block_k if per_row else group
    assert per_row or (block_k % group == 0 and group & (group - 1) == 0), f"group {group} and BLOCK_K {block_k}"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, data, scale, bias if bias is not None else scale, out, n, k, scale.shape[1], data.stride(0),
        scale.stride(0),
        GATED=gated, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_K=group_k,
        PER_ROW=per_row, EVEN_K=k % block_k == 0, num_warps=warps,
        **pdl.launch(x, early=not (gated and k >= 16384), on=pdl_on))
    return out


# ---- Triton: a few rows (verification windows, small decode batches) -------------------------------
ROWS_MAX = 16  # up to this many rows one program's tile covers them all (BLOCK_M); more rows read
# the codes slower than the tensor-core product with quantized inputs (bench/fp8_products.py: at
# 72B, 32 rows in 32-row tiles 0.59 ms a layer against 0.44 + the quantization)


@triton.jit
def _rows_fp8_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    sx, sw, ss, so,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_ROW: tl.constexpr, EVEN_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    k = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    rows = w_ptr + n[:, None].to(tl.int64) * sw
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN_K:
            w = tl.load(rows + kk[None, :], mask=nmask[:, None], other=0.0)
            xv = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None], other=0.0)
        else:
            kmask = kk < K
            w = tl.load(rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xv = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        # the codes exactly in the input's dtype (every e4m3 value is a bf16/fp16 value), float32 sums
        part = tl.dot(xv, tl.trans(w.to(tl.float32).to(xv.dtype)), out_dtype=tl.float32)
        if PER_ROW:
            acc += part
        else:  # one scale per row and BLOCK_K columns (the group)
            acc += part * tl.load(s_ptr + n * ss + k0 // BLOCK_K, mask=nmask, other=0.0)[None, :]
    if PER_ROW:
        acc = acc * tl.load(s_ptr + n * ss, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(dt), mask=mmask[:, None] & nmask[None, :])


def rows_config(group: int, per_row: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the few-row kernel: BLOCK_K is the group for
    group-wise scales. From `scripts/bench_gemv.py --fp8 --rows 7` on the H200 (BENCHMARKS.md): 32
    output rows a program, twice the programs of 64, read the codes of a 72B layer at 0.65-0.95
    of the copy bandwidth against 0.54-0.72 (one verification's products 20.9 ms against 25.7 ms
    at 72B; a decode step's are 19.7 ms), and 32 x 128 beats 64 x 128 at both geometries."""
    return (32, 256, 4, 3) if per_row else (32, group, 4, 4)


def gemm_fp8_rows(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, group: int,
                  bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """fp8_linear_ref (weight-only: the input is not quantized) for 1 to ROWS_MAX rows in one pass
    over the codes: each program streams BLOCK_N rows of W once for every input row, on the tensor
    cores (the codes converted exactly to the input's dtype). torch._scaled_mm at a verification
    window's 5-9 rows read the 72B weights at about half the copy bandwidth (BENCHMARKS.md)."""
    mrows, k = x.shape
    n = data.shape[0]
    assert 1 <= mrows <= ROWS_MAX and x.stride(-1) == 1 and data.shape[1] == k and data.stride(1) == 1
    per_row = scale.shape[1] == 1
    block_n, block_k, warps, stages = config or rows_config(group, per_row)
    assert per_row or block_k == group, f"group-wise scales need BLOCK_K = group ({group})"
    out = torch.empty(mrows, n, dtype=x.dtype, device=x.device)
    _rows_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, data, scale, bias if bias is not None else scale, out, mrows, n, k,
        x.stride(0), data.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=ROWS_MAX, BLOCK_N=block_n, BLOCK_K=block_k, PER_ROW=per_row,
        EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return out


# ---- several rows: FP8 tensor cores ------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "M_TILES"])  # one compile for every row count of a tile shape
def _tc_fp8_kernel(
    q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, M_TILES, K_SPLIT,
    sq, ssx_row, ssx_col, sw, ssw, so,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_ROW: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
):
    """(codes_x x scale_x) (codes_w x scale_w)^T on the FP8 tensor cores, float32 sums. PER_ROW:
    one scale per input row and one per weight row, applied to the finished sums; else one per
    row and BLOCK_K columns on both sides (BLOCK_K = the group), applied per K step. The M tiles
    of one N tile are neighbouring programs, so a weight tile is read from memory once (the next
    M tile finds it in L2). SPLIT: program (., s) sums columns [s K_SPLIT, (s + 1) K_SPLIT) into
    ws[s] (float32; per-row scales not yet applied) for _tc_reduce_kernel."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = pid % M_TILES
    pid_n = pid // M_TILES
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    k = tl.arange(0, BLOCK_K)
    rows_w = w_ptr + n[:, None].to(tl.int64) * sw
    rows_x = q_ptr + m[:, None].to(tl.int64) * sq
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + k
        if EVEN_K:
            a = tl.load(rows_x + kk[None, :], mask=mmask[:, None], other=0.0)
            b = tl.load(rows_w + kk[None, :], mask=nmask[:, None], other=0.0)
        else:
            kmask = kk < K
            a = tl.load(rows_x + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(rows_w + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        if PER_ROW:
            acc += part
        else:
            g = k0 // BLOCK_K
            sa = tl.load(sx_ptr + m * ssx_row + g * ssx_col, mask=mmask, other=0.0)
            sb = tl.load(sw_ptr + n * ssw + g, mask=nmask, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
    cell = m[:, None].to(tl.int64) * N + n[None, :]
    if SPLIT:
        tl.store(ws_ptr + split.to(tl.int64) * M * N + cell, acc, mask=mmask[:, None] & nmask[None, :])
    else:
        if PER_ROW:
            sa = tl.load(sx_ptr + m * ssx_row, mask=mmask, other=0.0)
            sb = tl.load(sw_ptr + n * ssw, mask=nmask, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * so + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["M", "SPLITS"])
def _tc_reduce_kernel(ws_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, SPLITS, ssx_row, ssw, so,
                      HAS_BIAS: tl.constexpr, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """out[m] = the splits' partial sums of row m in order (x the row's and the weight rows'
    scales where PER_ROW) + bias, in out's dtype: program (m, c) covers BLOCK columns."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(ws_ptr + (s * M + m) * N + n, mask=nmask, other=0.0)
    if PER_ROW:
        acc = acc * tl.load(sx_ptr + m * ssx_row) * tl.load(sw_ptr + n * ssw, mask=nmask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * so + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


# Up to this many rows the Triton product below; more: cuBLAS's where it applies. H200, one 72B
# layer's four products in a CUDA graph (bench/fp8_products.py --graphs): at 32 rows 0.28 ms
# per-channel against 0.39 for quantize + torch._scaled_mm, 0.36 block-wise; at 128 rows cuBLAS's
# 0.28 against 0.38.
TC_ROWS_MAX = 64
# Group-wise weights that cuBLAS's block scaling does not take (a tensor-parallel share cut inside
# a block, a GPU without it) stay on the Triton product up to this many rows, then take the
# dequantized product: one 72B layer at 1,024 rows 5.5 ms against 9.1, at 8,192 rows 45 against 27
# (the Triton product then in 128 x 128 tiles; BENCHMARKS.md).
TC_GROUP_ROWS_MAX = 1024


def tc_config(m: int, group: int, per_row: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton FP8 product for m rows:
    all rows in one tile up to 128 (a weight tile read once), 128-row tiles past that (group-wise
    weights that cuBLAS's block scaling does not take). From the --sweep-tc tiles at 72B and 7B."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    if block_m > 64:
        return (block_m, 64, 128 if per_row else group, 4, 4)
    return (block_m, 64, 256 if per_row else group, 4, 4)


def tc_splits(programs: int, k_steps: int, num_sms: int) -> int:
    """Key splits of the Triton FP8 product: enough programs for two per SM where the tiles alone
    leave SMs idle or in a thin last wave (a 72B o projection: 128 tiles of 8,192 columns), each
    split at least 8 BLOCK_K steps, at most 8 splits."""
    if programs >= 2 * num_sms:
        return 1
    return max(1, min(8, -(-2 * num_sms // programs), k_steps // 8))


def tc_warm_rows() -> tuple[int, ...]:
    """A row count for each tile shape tc_config picks past ROWS_MAX (each is one Triton compile;
    the row count itself is not specialised)."""
    shapes = {}
    for m in range(ROWS_MAX + 1, 257):
        shapes.setdefault((tc_config(m, 128, True), tc_config(m, 128, False)), m)
    return tuple(shapes.values())


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def gemm_fp8_tc(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """x (M, K) 16-bit against FP8 weights on the FP8 tensor cores: x quantized per row (per-row
    weights) or per row and `group` columns (group-wise weights: the 128 x 128 block-wise layout
    and the finer groups of a tensor-parallel share) in one kernel, then product_fp8_tc. Output
    in x's dtype."""
    if scale.shape[1] == 1:
        xq, sx = quantize_rows_fast(x)
    else:
        assert group >= 32 and group & (group - 1) == 0, f"group {group}: a power of two from 32"
        xq, sx = quantize_groups(x, group)
    return product_fp8_tc(xq, sx, data, scale, group, bias, x.dtype, config)


def product_fp8_tc(xq: torch.Tensor, sx: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, group: int,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple | None = None) -> torch.Tensor:
    """(xq x sx) (data x scale)^T (+ bias) for FP8 codes on both sides: sx (M, 1) with per-row
    weight scales, (M, G) with group-wise ones. One Triton product that reads each weight tile
    once for all rows (the M tiles of an N tile run side by side), its K split where the tiles
    are too few for the SMs (partial sums in float32, added in a fixed order by a second kernel:
    no atomics, the same result on every call). config: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[,
    splits])."""
    m, k = xq.shape
    n = data.shape[0]
    per_row = scale.shape[1] == 1
    assert xq.stride(-1) == 1 and data.shape[1] == k and data.stride(1) == 1 and sx.shape[0] == m
    block_m, block_n, block_k, warps, stages, *rest = config or tc_config(m, group, per_row)
    assert per_row or block_k == group, f"group-wise scales need BLOCK_K = group ({group})"
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if not m:
        return out
    m_tiles = triton.cdiv(m, block_m)
    programs = m_tiles * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    splits = rest[0] if rest else tc_splits(programs, k_steps, _num_sms(xq.device))
    k_split = triton.cdiv(k_steps, splits) * block_k
    splits = triton.cdiv(k, k_split)  # (no empty split)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device) if splits > 1 else out
    b = bias if bias is not None else scale
    _tc_fp8_kernel[(programs, splits)](
        xq, sx, data, scale, b, out, ws, m, n, k, m_tiles, k_split,
        xq.stride(0), sx.stride(0), sx.stride(1), data.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PER_ROW=per_row,
        EVEN_K=k % block_k == 0, SPLIT=splits > 1, num_warps=warps, num_stages=stages)
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _tc_reduce_kernel[(m, triton.cdiv(n, block))](
            ws, sx, scale, b, out, m, n, splits, sx.stride(0), scale.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PER_ROW=per_row, BLOCK=block, num_warps=4)
    return out


# ---- several rows: cuBLAS ------------------------------------------------------------------------------
def scaled_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16/fp16 against per-row FP8 weights (scale (N, 1)): x quantized per row (one
    kernel), one FP8 product with both scales applied to its float32 result, output in x's dtype."""
    assert scale.shape[1] == 1, "row-wise scales only (per-output-channel weights)"
    xq, sx = quantize_rows_fast(x)
    y = torch._scaled_mm(xq, data.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                         bias=bias)
    return y


@functools.lru_cache(maxsize=None)
def tensor_core_fp8(device: torch.device) -> tuple[bool, bool]:
    """(FP8 products with row-wise scales, FP8 products with 128 x 128 block scales) on this CUDA
    device: compute capability 8.9 and later for the first; for the second a Hopper GPU (9.x: the
    block scaling torch reaches is cuBLAS's for that architecture, from CUDA 12.9) and a torch
    that has torch.nn.functional.scaled_mm, checked once by a small product (any error: no)."""
    cap = torch.cuda.get_device_capability(device)
    rows = cap >= (8, 9)
    if not (cap[0] == 9 and HAVE_BLOCK_MM):
        return rows, False
    try:
        x = torch.zeros(16, 128, device=device).to(FP8)
        w = torch.zeros(128, 128, device=device).to(FP8)
        sa = torch.ones(1, 16, device=device).t()
        sb = torch.ones(1, 4, device=device).t()  # (G rounded up to 4, N / 128), column-major
        st = _F.ScalingType
        _F.scaled_mm(x, w.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)
        return rows, True
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return rows, False


BLOCK = 128  # the block-wise layout's tile (rows and columns) that cuBLAS's block scaling takes
_F = torch.nn.functional
HAVE_BLOCK_MM = hasattr(_F, "scaled_mm") and hasattr(_F, "ScalingType") and \
    hasattr(_F.ScalingType, "BlockWise128x128")


def cublas_block_scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """A block-wise weight's scales ((N, G): each 128-row block's scale repeated over its rows) in
    the layout cuBLAS's 128 x 128 block scaling reads: (G', N / 128), G' = G rounded up to 4,
    column-major (padding scales 1). None where the weight is not whole 128 x 128 blocks of one
    scale each: N or K not a multiple of 128 (a tensor-parallel share of an MLP), or a stack
    whose part's rows end inside a block."""
    if n % BLOCK or k % BLOCK:
        return None
    g = scale.shape[1]
    blocks = scale.view(n // BLOCK, BLOCK, g)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        return None
    gp = -(-g // 4) * 4
    out = torch.ones(n // BLOCK, gp, dtype=torch.float32, device=scale.device)
    out[:, :g] = blocks[:, 0]
    return out.t()


def scaled_mm_blocks(x: torch.Tensor, data: torch.Tensor, block_scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16 against block-wise FP8 weights (128 x 128 tiles; block_scales from
    cublas_block_scales): x quantized per row and 128-column group (one kernel), then one FP8
    product on the tensor cores with cuBLAS's block scaling, output in x's dtype. M is padded to a
    multiple of 16 (rows of zeros) for cuBLAS."""
    m, k = x.shape
    g = -(-k // BLOCK)
    mp = -(-m // 16) * 16
    q = torch.empty(mp, k, dtype=FP8, device=x.device)
    sa = torch.empty(g, mp, dtype=torch.float32, device=x.device).t()  # column-major (M, G)
    if mp > m:
        q[m:].zero_()
        sa[m:].fill_(1.0)
    quantize_groups(x, BLOCK, sa, out=q)
    st = _F.ScalingType
    y = _F.scaled_mm(q, data.t(), sa, st.BlockWise1x128, block_scales, st.BlockWise128x128, bias=bias,
                     output_dtype=x.dtype)
    return y[:m] if mp > m else y
