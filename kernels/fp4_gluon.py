"""FP4 decode attention in Gluon (issue #5): one query token per sequence, head_dim 128, the
kernels/fp4.py cache read straight into the tensor cores' operand registers.

Why Gluon: the Triton kernel (`_paged_attn_fp4_kernel`) decodes a tile into a blocked layout and
the compiler moves it through shared memory to the MMA operand layout (39 barriers and ~2,900
instructions per 128-key tile, a third of the issue rate; BENCHMARKS, nineteenth session). Here the
layouts are chosen so that no decoded value leaves its thread:

- Each of the 4 warps owns 32 of each step's 128 keys and keeps its own online softmax (max, sum,
  output); the warps are merged once, at the end. So S = q K^T, P and P V stay inside a warp, and
  P goes from the scores' accumulator registers to the A operand of P V without moving.
- Keys: the B operand of m16n8k16 gives lane (g, c) = (lane / 4, lane % 4) key g of each 8-key
  block and k-indices 16 i + 8 h + 2 c + p. A dot product does not care about the order of its
  dims, so logical k is mapped to code byte 16 c + 4 i + 2 h + p (and q is loaded in the same
  order): each lane's k-indices are then 16 consecutive code bytes of its key (one 16-byte load),
  and one E4M3 group (16 dims) per half, so the group scale rides on the decode's bf16x2 FMA.
- Values: the B operand of P V is (keys, dims): lane (g, c) holds keys 2 c + p + 8 h + 16 i and
  columns 8 j + g. Output columns may be permuted too, so column 8 j + g is code byte 8 g + j: 8
  consecutive bytes of each of its keys (8-byte loads). The bf16x2 register pairs two keys (p = 0,
  1) of one dim; the decode is the same PTX with the two keys' scales as its pair.
The per-pair decode is kernels/paged_attention.py's FP4_DECODE_PTX (exact: equal to the float32
decode bit for bit). Outlier slots: see the kernel's docstring.

Torch reference: kernels/paged_attention.paged_attention_ref over FP4PagedLayer.gather, as for the
Triton kernel; tests/test_fp4_gluon.py (CUDA only: Gluon has no interpreter).
"""
from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.paged_attention import LOG2E, TilePlan, _fp4_decode_ptx

WARPS = gl.constexpr(4)
KEYS = gl.constexpr(32)  # keys per warp per step
BLOCK_N = gl.constexpr(128)  # WARPS x KEYS
HALF = gl.constexpr(64)
DECODE = gl.constexpr(_fp4_decode_ptx())

# Layouts, all rank 3 or more with the warp as the leading (batch) dim.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# key codes as (warp, c, byte of c's 16, key): lane = c + 4 g, 16 bytes a register run
K_CODES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 16, 1], threads_per_warp=[1, 4, 1, 8],
                                        warps_per_cta=[4, 1, 1, 1], order=[2, 1, 3, 0]))
# value codes as (warp, key, g, j): loaded with j fastest (8 bytes), decoded with the key pair fastest
V_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 8], threads_per_warp=[1, 4, 8, 1],
                                       warps_per_cta=[4, 1, 1, 1], order=[3, 1, 2, 0]))
V_PAIR = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 8], threads_per_warp=[1, 4, 8, 1],
                                       warps_per_cta=[4, 1, 1, 1], order=[1, 3, 2, 0]))


@gluon.jit
def _arange3(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along `dim` of a rank-3 layout, expanded to rank 3."""
    if dim == 0:
        x = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(x, 1), 2)
    elif dim == 1:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(x, 0), 2)
    else:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        return gl.expand_dims(gl.expand_dims(x, 0), 1)


@gluon.jit
def _scale_bf16(e):
    """E4M3 scale bytes -> bf16 scale x 2^118 (exact), the decode's FMA operand."""
    return ((e.to(gl.int32) << 20).to(gl.float32, bitcast=True) * 6.646139978924579e+35 * 6.646139978924579e+35
            ).to(gl.bfloat16)


@gluon.jit
def _rows(table_ptr, seq, s_table, key, stop, kvh, sk_b, sk_s, sk_h, ss_b, ss_s, ss_h, BS_LOG2: gl.constexpr):
    """Keys' mask and their rows in the codes and scales views (block size 2^BS_LOG2)."""
    ok = key < stop
    blk = gl.load(table_ptr + seq * s_table + (key >> BS_LOG2), mask=ok, other=0).to(gl.int64)
    off = key & ((1 << BS_LOG2) - 1)
    return ok, blk * sk_b + off * sk_s + kvh * sk_h, blk * ss_b + off * ss_s + kvh * ss_h


@gluon.jit
def _fp4_decode_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tile_seq_ptr, tile_tok_ptr, tile_pos_ptr, table_ptr,
    kc_ptr, ks_ptr, ki_ptr, kv_ptr, vc_ptr, vs_ptr, khs_ptr, vhs_ptr,
    sm_scale_log2, num_splits,
    sq_t, sq_h, so_t, so_h, s_table,
    sk_b, sk_s, sk_h, ss_b, ss_s, ss_h, si_b, si_s, si_h, sv_b, sv_s, sv_h,
    GROUP: gl.constexpr, SPLIT: gl.constexpr, BS_LOG2: gl.constexpr, NUM_OUTLIERS: gl.constexpr,
):
    """One program: (tile = sequence, KV head, split); rows are the GROUP query heads of the KV
    head (16 rows, GROUP <= 16). Partials as _paged_attn_fp4_kernel writes them (BLOCK_M 16).
    Key outlier slots (NUM_OUTLIERS; their codes are 0): each adds q[row, channel] x value to
    its key's scores, a gather of q per (row, key, slot) in the scores' own layout. Value slots:
    none (the caller checks; the Triton kernel reads caches with them)."""
    tile = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq = gl.load(tile_seq_ptr + tile)
    tok0 = gl.load(tile_tok_ptr + tile)
    pos0 = gl.load(tile_pos_ptr + tile)
    kend = pos0 + 1
    chunk = gl.cdiv(gl.cdiv(kend, BLOCK_N), num_splits) * BLOCK_N
    start = split * chunk
    stop = gl.minimum(start + chunk, kend)
    khs = gl.load(khs_ptr + kvh)
    vhs = gl.load(vhs_ptr + kvh)

    # q in the A-operand layout, k-index 16 i + 8 h + 2 c + p read from dim 16 c + 4 i + 2 h + p
    w_a = _arange3(WARPS, 0, A_OP)
    r_a = _arange3(16, 1, A_OP)
    k_a = _arange3(HALF, 2, A_OP)
    dim_a = ((k_a >> 1) & 3) * 16 + (k_a >> 4) * 4 + ((k_a >> 3) & 1) * 2 + (k_a & 1) + w_a * 0
    q_row = (tok0 * sq_t + (kvh * GROUP + r_a) * sq_h)
    q_ok = (r_a < GROUP) & (dim_a >= 0)
    q_unit = sm_scale_log2 * khs * 256.0  # decoded keys are value / (head scale x 2^8)
    q_lo = (gl.load(q_ptr + q_row + dim_a, mask=q_ok, other=0.0).to(gl.float32) * q_unit).to(gl.bfloat16)
    q_hi = (gl.load(q_ptr + q_row + HALF + dim_a, mask=q_ok, other=0.0).to(gl.float32) * q_unit).to(gl.bfloat16)

    # key-side index tensors (K_CODES): keys (warp, key) and bytes (c, byte)
    SK2: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, K_CODES))  # (warp, key)
    wk = gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, SK2)), 1)
    nk = gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(0, SK2)), 0)
    SKC: gl.constexpr = gl.SliceLayout(2, K_CODES)  # (warp, c, key)
    ck = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SKC))), 0), 2)
    bk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, K_CODES))))
    bk = gl.expand_dims(gl.expand_dims(gl.expand_dims(bk, 0), 1), 3)  # (1, 1, 16, 1)
    # value side (V_LOAD / V_PAIR): keys (warp, key), g, j
    SV2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, V_LOAD))
    wv = gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, SV2)), 1)
    nv = gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(0, SV2)), 0)
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, V_LOAD))))
    gv = gl.expand_dims(gl.expand_dims(gl.expand_dims(gv, 0), 1), 3)
    jv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, V_LOAD))))
    jv = gl.expand_dims(gl.expand_dims(gl.expand_dims(jv, 0), 1), 2)
    SVP: gl.constexpr = gl.SliceLayout(3, V_PAIR)  # (warp, key, g) for the value scales
    wvp = gl.expand_dims(gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, SVP))), 1), 2)
    nvp = gl.expand_dims(gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SVP))), 0), 2)
    gvp = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SVP))), 0), 1)
    # scores' columns (MMA): key of each column
    w_s = _arange3(WARPS, 0, MMA)
    n_s = _arange3(KEYS, 2, MMA)
    r_s = _arange3(16, 1, MMA)
    q_row_s = tok0 * sq_t + (kvh * GROUP + r_s) * sq_h
    q_ok_s = r_s < GROUP

    SROW: gl.constexpr = gl.SliceLayout(2, MMA)
    m_i = gl.full([WARPS, 16], float("-inf"), gl.float32, layout=SROW)
    l_i = gl.full([WARPS, 16], 0.0, gl.float32, layout=SROW)
    acc_lo = gl.full([WARPS, 16, HALF], 0.0, gl.float32, layout=MMA)
    acc_hi = gl.full([WARPS, 16, HALF], 0.0, gl.float32, layout=MMA)
    for n0 in range(start, stop, BLOCK_N):
        # keys: codes (warp, c, byte, key), scales (warp, c, key)
        key = n0 + wk * KEYS + nk
        ok, row_c, row_s = _rows(table_ptr, seq, s_table, key, stop, kvh, sk_b, sk_s, sk_h,
                                 ss_b, ss_s, ss_h, BS_LOG2)
        row_c = gl.multiple_of(row_c, [16, 16])
        ok3 = gl.expand_dims(ok, 1)
        kc = gl.load(kc_ptr + gl.expand_dims(gl.expand_dims(row_c, 1), 2) + gl.expand_dims(ck, 2) * 16 + bk,
                     mask=gl.expand_dims(ok3, 2), other=0)
        rs3 = gl.expand_dims(row_s, 1)
        ks_lo = _scale_bf16(gl.load(ks_ptr + rs3 + ck, mask=ok3, other=0))
        ks_hi = _scale_bf16(gl.load(ks_ptr + rs3 + 4 + ck, mask=ok3, other=0))
        k_lo, k_hi = gl.inline_asm_elementwise(
            DECODE, "=r,=r,=r,=r,r,r,r,r,r", [kc, gl.expand_dims(ks_lo, 2), gl.expand_dims(ks_hi, 2)],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        # (warp, c, byte 4 i + 2 h + p, key) -> (warp, k = 16 i + 8 h + 2 c + p, key)
        k_lo = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(k_lo, [WARPS, 4, 4, 2, 2, KEYS]), [0, 2, 3, 1, 4, 5]),
                                            [WARPS, HALF, KEYS]), B_OP, assert_trivial=True)
        k_hi = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(k_hi, [WARPS, 4, 4, 2, 2, KEYS]), [0, 2, 3, 1, 4, 5]),
                                            [WARPS, HALF, KEYS]), B_OP, assert_trivial=True)
        s = mma_v2(q_lo, k_lo, gl.full([WARPS, 16, KEYS], 0.0, gl.float32, layout=MMA))
        s = mma_v2(q_hi, k_hi, s)
        skey = n0 + w_s * KEYS + n_s  # (warp, 1, key)
        visible = skey < stop
        if NUM_OUTLIERS > 0:
            _, row_o, row_v = _rows(table_ptr, seq, s_table, skey, stop, kvh, si_b, si_s, si_h, sv_b, sv_s, sv_h,
                                    BS_LOG2)
            for o in gl.static_range(NUM_OUTLIERS):  # unused slots hold (0, 0.0): they add nothing
                idx = gl.load(ki_ptr + row_o + o, mask=visible, other=0).to(gl.int32)
                val = gl.load(kv_ptr + row_v + o, mask=visible, other=0.0).to(gl.float32)
                qg = gl.load(q_ptr + q_row_s + idx, mask=visible & q_ok_s, other=0.0).to(gl.float32)
                s += qg * (val * sm_scale_log2)

        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        p_op = gl.convert_layout(p.to(gl.bfloat16), A_OP)

        # values: codes (warp, key, g, j), scales (warp, key, g)
        vkey = n0 + wv * KEYS + nv
        vok, vrow_c, vrow_s = _rows(table_ptr, seq, s_table, vkey, stop, kvh, sk_b, sk_s, sk_h,
                                    ss_b, ss_s, ss_h, BS_LOG2)
        vrow_c = gl.multiple_of(vrow_c, [16, 16])
        vc = gl.load(vc_ptr + gl.expand_dims(gl.expand_dims(vrow_c, 2), 3) + gv * 8 + jv,
                     mask=gl.expand_dims(gl.expand_dims(vok, 2), 3), other=0)
        vc = gl.convert_layout(vc, V_PAIR, assert_trivial=True)
        vkey_p = n0 + wvp * KEYS + nvp
        vok_p, _, vrow_sp = _rows(table_ptr, seq, s_table, vkey_p, stop, kvh, sk_b, sk_s, sk_h,
                                  ss_b, ss_s, ss_h, BS_LOG2)
        vs_lo = _scale_bf16(gl.load(vs_ptr + vrow_sp + gvp // 2, mask=vok_p, other=0))
        vs_hi = _scale_bf16(gl.load(vs_ptr + vrow_sp + 4 + gvp // 2, mask=vok_p, other=0))
        v_lo, v_hi = gl.inline_asm_elementwise(
            DECODE, "=r,=r,=r,=r,r,r,r,r,r", [vc, gl.expand_dims(vs_lo, 3), gl.expand_dims(vs_hi, 3)],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        # (warp, key, g, j) -> (warp, key, column 8 j + g)
        v_lo = gl.convert_layout(gl.reshape(gl.permute(v_lo, [0, 1, 3, 2]), [WARPS, KEYS, HALF]), B_OP,
                                 assert_trivial=True)
        v_hi = gl.convert_layout(gl.reshape(gl.permute(v_hi, [0, 1, 3, 2]), [WARPS, KEYS, HALF]), B_OP,
                                 assert_trivial=True)
        a3 = gl.expand_dims(alpha, 2)
        acc_lo = mma_v2(p_op, v_lo, acc_lo * a3)
        acc_hi = mma_v2(p_op, v_hi, acc_hi * a3)

    # merge the warps' softmax states
    m = gl.max(m_i, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    f = gl.exp2(m_i - gl.expand_dims(m_safe, 0))
    l = gl.sum(l_i * f, 0)
    f3 = gl.expand_dims(f, 2) * (vhs * 256.0)
    o_lo = gl.sum(acc_lo * f3, 0)
    o_hi = gl.sum(acc_hi * f3, 0)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    r_o = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, OL)), 1)
    n_o = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, OL)), 0)
    dim_o = (n_o % 8) * 8 + n_o // 8  # column 8 j + g is dim 8 g + j
    row_ok = r_o < GROUP
    if SPLIT:
        base = (tile * gl.num_programs(1) + kvh) * num_splits + split
        a_off = base * 16 * 2 * HALF + r_o * 2 * HALF + dim_o
        gl.store(part_acc_ptr + a_off, o_lo, mask=row_ok & (dim_o >= 0))
        gl.store(part_acc_ptr + a_off + HALF, o_hi, mask=row_ok & (dim_o >= 0))
        RL: gl.constexpr = gl.SliceLayout(0, SROW)
        r1 = gl.arange(0, 16, layout=RL)
        gl.store(part_ml_ptr + base * 2 * 16 + r1, m, mask=r1 < GROUP)
        gl.store(part_ml_ptr + base * 2 * 16 + 16 + r1, l, mask=r1 < GROUP)
    else:
        l2 = gl.convert_layout(l, gl.SliceLayout(1, OL))
        inv = gl.expand_dims(gl.where(l2 > 0, 1.0 / gl.maximum(l2, 1e-30), 0.0), 1)
        o_off = tok0 * so_t + (kvh * GROUP + r_o) * so_h + dim_o
        gl.store(out_ptr + o_off, (o_lo * inv).to(out_ptr.dtype.element_ty), mask=row_ok & (dim_o >= 0))
        gl.store(out_ptr + o_off + HALF, (o_hi * inv).to(out_ptr.dtype.element_ty), mask=row_ok & (dim_o >= 0))


def supported(q: torch.Tensor, plan: TilePlan, fp4_k: tuple, fp4_v: tuple) -> str | None:
    """None if this kernel can run the call, else why not."""
    if q.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "not a CUDA device (Gluon has no interpreter)"
    if torch.cuda.get_device_capability(q.device)[0] < 8:
        return "needs sm_80 or newer (bf16 mma)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "q must be bf16 or fp16"
    if q.shape[-1] != 2 * HALF:
        return f"head_dim must be {2 * HALF}"
    kc, ks, ki, kv, _ = fp4_k
    if plan.tokens_per_tile != 1 or plan.block_m != 16 or q.shape[1] // kc.shape[2] > 16:
        return "decode tiles only (one query token, GQA group <= 16)"
    if fp4_v[2].shape[-1] != 0:
        return "value outlier slots are not read by this kernel"
    bs = kc.shape[1]
    if bs & (bs - 1) or any(st % 16 for st in kc.stride()[:3]):
        return "block size must be a power of two and code rows 16-byte aligned"
    return None


def launch(q: torch.Tensor, out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, plan: TilePlan,
           scale: float, fp4_k: tuple, fp4_v: tuple) -> None:
    """The split kernel (or the whole attention, unsplit); kernels/paged_attention.paged_attention
    owns the partial buffers and the merge."""
    kc, ks, ki, kv, khs = fp4_k
    vc, vs, _, _, vhs = fp4_v
    n_kv = kc.shape[2]
    group = q.shape[1] // n_kv
    n_tiles = plan.tile_seq.numel()
    splits = plan.num_splits
    _fp4_decode_kernel[(n_tiles, n_kv, splits)](
        q, out, part_acc, part_ml,
        plan.tile_seq, plan.tile_tok, plan.tile_pos, plan.block_table,
        kc, ks, ki, kv, vc, vs, khs, vhs,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.block_table.stride(0),
        *kc.stride()[:3], *ks.stride()[:3], *ki.stride()[:3], *kv.stride()[:3],
        GROUP=group, SPLIT=splits > 1, BS_LOG2=kc.shape[1].bit_length() - 1, NUM_OUTLIERS=ki.shape[-1],
        num_warps=WARPS,
    )
