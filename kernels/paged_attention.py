"""Paged attention over the KV cache: a torch reference, and one Triton kernel family for decode,
speculative verification (1-16 query tokens, causal inside the window) and prefill chunks (a
chunk over its cached prefix plus itself), reading a bf16/fp16/fp32 cache (`_paged_attn_kernel`)
or an FP4 cache (`_paged_attn_fp4_kernel`: the kernels/fp4.py format, decoded in registers). Both
share the tiling, the key splits, the partials and the merge kernel. FP4 decode steps on CUDA go to
the Gluon kernel of kernels/fp4_gluon.py where it can run them (paged_attention's fp4_gluon); it
writes the same partials.

Work is split into tiles of (sequence, a run of its query tokens) x KV head: a tile's rows are
(query token, query head of the KV head's group), so each KV block is read once for the whole GQA
group. Long contexts are split along the keys (flash-decoding); a second kernel merges the
splits by log-sum-exp.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from kernels._triton import interpreting, tl, triton

from kernels import pdl
from kernels.fp4 import fp4_pair_steps
from kernels.attention_plan import INVARIANT_BLOCK_N, LOG2E, UNSPECIALIZED, TilePlan, merge_shape

TWO_119 = tl.constexpr(2.0 ** 119)


# ---- torch reference --------------------------------------------------------------------------
def paged_attention_ref(
    q: torch.Tensor,  # (num_tokens, num_heads, D)
    gather_kv: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],  # block ids -> K, V (n*bs, Hkv, D)
    query_start: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Sequence b owns query rows query_start[b]:query_start[b+1], the last tokens of its first
    context_lens[b]; query row i attends to positions 0..context_lens[b] - num_q + i."""
    out = torch.empty_like(q)
    for b in range(len(context_lens)):
        q0, q1 = query_start[b], query_start[b + 1]
        ctx = context_lens[b]
        num_q = q1 - q0
        k, v = gather_kv(block_tables[b][: -(-ctx // block_size)])
        k = k[:ctx].to(q.dtype).transpose(0, 1)  # (Hkv, ctx, D)
        v = v[:ctx].to(q.dtype).transpose(0, 1)
        if num_q == 1:  # a decode row sees the whole context
            mask, causal = None, False
        elif num_q == ctx:  # a whole prompt: plain causal (SDPA's fused kernel, ~1.8x the masked path on CPU)
            mask, causal = None, True
        elif 2 * num_q >= ctx:
            # a long chunk after a short cached prefix: causal over the query rows padded to the
            # whole context, keeping the last num_q (the fused causal kernel skips the blocks above
            # the diagonal, so ctx^2 / 2 beats num_q x ctx under a mask; same output, measured
            # bit-identical on CPU: 2,048 rows over 2,600 keys 46 ms vs 71 ms)
            qp = q.new_zeros(ctx, q.shape[1], q.shape[2])
            qp[ctx - num_q:] = q[q0:q1]
            o = F.scaled_dot_product_attention(qp.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=True)
            out[q0:q1] = o[0, :, ctx - num_q:].transpose(0, 1)
            continue
        else:  # a chunk after a cached prefix: causal aligned to the end
            q_pos = torch.arange(ctx - num_q, ctx, device=q.device)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None], False  # (num_q, ctx)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


# ---- Triton ---------------------------------------------------------------------------------------
@triton.jit
def _tile_rows(kvh, nq, GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile's rows: row r is query token r // GROUP of the tile, query head kvh * GROUP + r % GROUP."""
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (t < nq) & (r < TOKENS * GROUP)
    return r, t, head, row_ok


@triton.jit
def _program_tile(tile_seq_ptr, tile_tok_ptr, tile_nq_ptr, tile_pos_ptr):
    """This program's (tile, KV head, split) and the tile's sequence, first query row, number of
    query tokens and first query position."""
    tile = tl.program_id(0)
    seq = tl.load(tile_seq_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    nq = tl.load(tile_nq_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    return tile, tl.program_id(1), tl.program_id(2), seq, tok0, nq, pos0


@triton.jit
def _key_range(pos0, nq, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's keys [start, stop): keys 0..pos0 + nq - 1 are visible to some row of the tile."""
    kend = pos0 + nq
    chunk = tl.cdiv(tl.cdiv(kend, BLOCK_N), num_splits) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, kend)


@triton.jit
def _load_q(q_ptr, q_off, row_ok, d, unit, HALF: tl.constexpr):
    """The tile's query rows as float32 halves (dims 0..D/2 and D/2..D), times `unit`."""
    q_lo = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * unit
    q_hi = tl.load(q_ptr + q_off[:, None] + HALF + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * unit
    return q_lo, q_hi


@triton.jit
def _key_block(table_ptr, seq, s_table, n0, stop, block_size, BLOCK_N: tl.constexpr):
    """Keys n0..n0+BLOCK_N-1 of the split: their index, mask, cache block (int64) and offset in it."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < stop
    blk = tl.load(table_ptr + seq * s_table + n // block_size, mask=nmask, other=0).to(tl.int64)
    return n, nmask, blk, n % block_size


@triton.jit
def _split_state(pos0, nq, split, num_splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """This split's key range and the online softmax's empty state: (start, stop, running max,
    running sum, the two output halves)."""
    start, stop = _key_range(pos0, nq, split, num_splits, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    return start, stop, m_i, l_i, tl.zeros([BLOCK_M, HALF], tl.float32), tl.zeros([BLOCK_M, HALF], tl.float32)


@triton.jit
def _softmax_step(s, visible, m_i, l_i):
    """Online softmax over one key block (base 2): the block's weights p, the rescale of what came
    before (alpha), the new running max and sum."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc_lo, acc_hi, alpha, p, v_lo, v_hi, DOT_FP32: tl.constexpr):
    """The output halves rescaled by alpha plus this key block's weights times its values
    (bf16 tensor-core dots unless DOT_FP32)."""
    if DOT_FP32:
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo, input_precision="ieee")
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi, input_precision="ieee")
    else:
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v_lo.to(tl.bfloat16))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v_hi.to(tl.bfloat16))
    return acc_lo, acc_hi


@triton.jit
def _store_tile(out_ptr, part_acc_ptr, part_ml_ptr, acc_lo, acc_hi, m_i, l_i, tile, kvh, split, tok0, t, head, r,
                row_ok, d, so_t, so_h, num_splits, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                SPLIT: tl.constexpr):
    """The tile's output (unsplit), or its partials for the merge kernel (SPLIT): acc (tile, kvh,
    split, BLOCK_M, 2*HALF), m and l (tile, kvh, split, 2, BLOCK_M)."""
    if not SPLIT:
        inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
        o_off = (tok0 + t) * so_t + head * so_h
        tl.store(out_ptr + o_off[:, None] + d[None, :], (acc_lo * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(out_ptr + o_off[:, None] + HALF + d[None, :], (acc_hi * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        # only the rows of real (token, head) pairs: a decode tile at GQA 7 has 7 of its 16 (the
        # merge kernel reads the same rows), so the partials cost 7/16 of the traffic
        base = (tile * tl.num_programs(1) + kvh) * num_splits + split
        a_off = base * BLOCK_M * 2 * HALF + r[:, None] * 2 * HALF + d[None, :]
        tl.store(part_acc_ptr + a_off, acc_lo, mask=row_ok[:, None])
        tl.store(part_acc_ptr + a_off + HALF, acc_hi, mask=row_ok[:, None])
        tl.store(part_ml_ptr + base * 2 * BLOCK_M + r, m_i, mask=row_ok)
        tl.store(part_ml_ptr + base * 2 * BLOCK_M + BLOCK_M + r, l_i, mask=row_ok)




@triton.jit(do_not_specialize=UNSPECIALIZED)
def _paged_attn_kernel(
    # pointers
    q_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tile_seq_ptr, tile_tok_ptr, tile_nq_ptr, tile_pos_ptr, table_ptr,
    k_ptr, v_ptr,  # bf16/fp16/fp32 caches (num_blocks, block_size, Hkv, D)
    # sizes
    block_size, sm_scale_log2, num_splits,
    # strides
    sq_t, sq_h, so_t, so_h, s_table,
    sk_b, sk_s, sk_h,  # the caches
    # meta
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):
    pdl.start(PDL)  # kernels/pdl.py: everything below depends on earlier kernels
    pdl.wait(PDL)
    tile, kvh, split, seq, tok0, nq, pos0 = _program_tile(tile_seq_ptr, tile_tok_ptr, tile_nq_ptr, tile_pos_ptr)

    r, t, head, row_ok = _tile_rows(kvh, nq, GROUP, TOKENS, BLOCK_M)
    pos = pos0 + t  # absolute position of each row's query token
    d = tl.arange(0, HALF)
    q_off = (tok0 + t) * sq_t + head * sq_h
    q_lo, q_hi = _load_q(q_ptr, q_off, row_ok, d, sm_scale_log2, HALF)

    start, stop, m_i, l_i, acc_lo, acc_hi = _split_state(pos0, nq, split, num_splits, BLOCK_M, BLOCK_N, HALF)
    for n0 in range(start, stop, BLOCK_N):
        n, nmask, blk, off = _key_block(table_ptr, seq, s_table, n0, stop, block_size, BLOCK_N)
        row_off = blk * sk_b + off * sk_s + kvh * sk_h
        k_lo = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(k_ptr + row_off[:, None] + HALF + d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        if DOT_FP32:
            s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
            s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
        else:
            s = tl.dot(q_lo.to(tl.bfloat16), tl.trans(k_lo.to(tl.bfloat16)))
            s += tl.dot(q_hi.to(tl.bfloat16), tl.trans(k_hi.to(tl.bfloat16)))
        visible = (n[None, :] <= pos[:, None]) & nmask[None, :] & row_ok[:, None]
        p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i)
        v_lo = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        v_hi = tl.load(v_ptr + row_off[:, None] + HALF + d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        acc_lo, acc_hi = _accumulate(acc_lo, acc_hi, alpha, p, v_lo, v_hi, DOT_FP32)
        m_i = m_new
    pdl.end(PDL)

    _store_tile(out_ptr, part_acc_ptr, part_ml_ptr, acc_lo, acc_hi, m_i, l_i, tile, kvh, split, tok0, t, head, r,
                row_ok, d, so_t, so_h, num_splits, BLOCK_M, HALF, SPLIT)


def _fp4_decode_ptx() -> str:
    """The PTX of _fp4_decode_bf16x2, one instance per 4 code bytes ($4) and their scales ($5-$8, bf16
    pairs): outputs $0, $1 (low nibbles' values of bytes 0-1, 2-3) and $2, $3 (high nibbles')."""
    return "\n".join(["{", ".reg .b32 t01, t23, x, z;", "mov.b32 z, 0x80008000;"]
                     + fp4_pair_steps("$4", ("$5", "$6", "$7", "$8"), ["$0", "$1", "$2", "$3"]) + ["}"])


FP4_DECODE_PTX = tl.constexpr(_fp4_decode_ptx())


@triton.jit
def _fp4_decode_bf16x2(c, s_lo, s_hi):
    """(lo, hi) bf16 = (low nibble's E2M1 value x s_lo, high nibble's x s_hi) x 2^-126, for uint8
    codes c and bf16 scales s_lo, s_hi (broadcast to c's shape), in PTX on 32-bit words
    (FP4_DECODE_PTX): per 4 code bytes, two PRMTs spread the bytes into 16-bit lanes; per pair of
    values an AND isolates the nibbles, one IMAD writes the 3 magnitude bits at bf16 bits 6-8 (the
    exponent's two low bits and the mantissa's top bit) and a copy of the sign bit at bit 15, an
    AND keeps those, and a bf16x2 FMA with -0 added multiplies by the scale. The nibble as bf16
    bits is the code's value x 2^-126 exactly (0 and 0.5 are subnormal), and the product (<= 6
    significant bits) is exact, so this equals the float32 decode bit for bit. CUDA sm_80+ only;
    the interpreter and the float32 path use _fp4_tile's float32 decode."""
    return tl.inline_asm_elementwise(
        asm=FP4_DECODE_PTX,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[c, s_lo, s_hi], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


def _fp4_word_decode_ptx() -> str:
    """The PTX of _fp4_tile_words: one 32-bit word of codes ($8: bytes j..j+3 of a token-head's
    codes, so dims j..j+3 in the low nibbles and D/2 + j.. in the high ones) and the bf16x2 scale
    pairs of its low ($9) and high ($10) group in; eight bf16 out, dims j..j+3 ($0-$3) and
    D/2 + j.. ($4-$7). The per-pair steps are _fp4_decode_ptx's."""
    return "\n".join(["{", ".reg .b32 t01, t23, x, y, z;", "mov.b32 z, 0x80008000;"]
                     + fp4_pair_steps("$8", ("$9", "$9", "$10", "$10"),
                                       ["{$0, $1}", "{$2, $3}", "{$4, $5}", "{$6, $7}"]) + ["}"])


FP4_WORD_DECODE_PTX = tl.constexpr(_fp4_word_decode_ptx())


@triton.jit
def _scale_pair(e):
    """E4M3 scale bytes (int32) -> int32 holding (scale x 2^118, same) as bf16x2 (exact: 3 mantissa bits)."""
    f = (e << 20).to(tl.float32, bitcast=True) * TWO_119 * TWO_119
    b = (f.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _fp4_tile_words(codes_ptr, scales_ptr, row_c, row_s, nmask, GH: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROW: tl.constexpr = False):
    """_fp4_tile's PTX decode from 32-bit words: each thread loads whole words of codes (no byte
    repacking), and their eight decoded values stay in registers in dim order. ROW: the words as
    one (BLOCK_N, D/8) row per key, the group scales broadcast to them by a reshape; Triton then
    spreads a key's words over 4 lanes and stores the decoded tile to shared memory in 16-byte
    vectors (else (BLOCK_N, groups, 4): a whole key per thread, 2-byte stores)."""
    W: tl.constexpr = GH * 4  # words per half token-head: 4 per group of 16 dims
    g = tl.arange(0, GH)
    wp = (codes_ptr + row_c).to(tl.pointer_type(tl.int32))
    e_lo = tl.load(scales_ptr + row_s[:, None] + g[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    e_hi = tl.load(scales_ptr + row_s[:, None] + GH + g[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    if ROW:
        j = tl.arange(0, W)
        w = tl.load(wp[:, None] + j[None, :], mask=nmask[:, None], other=0)
        s_lo = tl.reshape(tl.broadcast_to(_scale_pair(e_lo)[:, :, None], [BLOCK_N, GH, 4]), [BLOCK_N, W])
        s_hi = tl.reshape(tl.broadcast_to(_scale_pair(e_hi)[:, :, None], [BLOCK_N, GH, 4]), [BLOCK_N, W])
    else:
        i = tl.arange(0, 4)
        w = tl.load(wp[:, None, None] + (g[None, :, None] * 4 + i[None, None, :]), mask=nmask[:, None, None],
                    other=0)
        s_lo = _scale_pair(e_lo)[:, :, None]
        s_hi = _scale_pair(e_hi)[:, :, None]
    o = tl.inline_asm_elementwise(
        asm=FP4_WORD_DECODE_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
        args=[w, s_lo, s_hi],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # tl.join adds its new dim last: join(join(a, c), join(b, d)) is [[a, b], [c, d]] in (pair, lane)
    # order, a, b, c, d once flattened
    lo = tl.reshape(tl.join(tl.join(o[0], o[2]), tl.join(o[1], o[3])), [BLOCK_N, W * 4])
    hi = tl.reshape(tl.join(tl.join(o[4], o[6]), tl.join(o[5], o[7])), [BLOCK_N, W * 4])
    return lo, hi


@triton.jit
def _fp4_tile(codes_ptr, scales_ptr, row_c, row_s, nmask, GH: tl.constexpr, BLOCK_N: tl.constexpr,
              PTX: tl.constexpr = False):
    """BLOCK_N cached FP4 vectors of one KV head as halves (lo: dims 0..D/2, hi: D/2..D), each
    element code value x group scale x 2^-8 (head scale left out: the caller folds it and the
    2^8 into q or the output): float32, or bf16 decoded in PTX if PTX (the same values).

    Codes are loaded once as (BLOCK_N, GH, 16) bytes (GH = D/32 groups per half), so each E4M3
    group scale is decoded once and broadcast along the group's 16 dims. An E2M1 code becomes float32
    bits in two shifts and masks: its 3 magnitude bits land on the exponent's two low bits and the
    mantissa's top bit, its sign on the sign bit; that float is the code's value x 2^-126 (exact,
    codes 0 and +-0.5 are subnormal), and 2^118 rides on the scale."""
    if PTX >= 2:
        lo, hi = _fp4_tile_words(codes_ptr, scales_ptr, row_c, row_s, nmask, GH, BLOCK_N, PTX == 3)
    else:
        lo, hi = _fp4_tile_bytes(codes_ptr, scales_ptr, row_c, row_s, nmask, GH, BLOCK_N, PTX)
    return lo, hi


@triton.jit
def _fp4_tile_bytes(codes_ptr, scales_ptr, row_c, row_s, nmask, GH: tl.constexpr, BLOCK_N: tl.constexpr,
                    PTX: tl.constexpr):
    """_fp4_tile from the codes as (BLOCK_N, GH, 16) bytes: the float32 decode, or PTX == 1's."""
    g = tl.arange(0, GH)
    j = tl.arange(0, 16)
    c = tl.load(codes_ptr + row_c[:, None, None] + (g[None, :, None] * 16 + j[None, None, :]),
                mask=nmask[:, None, None], other=0)
    # E4M3 bits << 20 are float32 bits of the scale x 2^-120 (subnormal scales included); two
    # exact multiplies by 2^119 make it scale x 2^118
    s_lo = tl.load(scales_ptr + row_s[:, None] + g[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    s_hi = tl.load(scales_ptr + row_s[:, None] + GH + g[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    s_lo = (s_lo << 20).to(tl.float32, bitcast=True) * TWO_119 * TWO_119
    s_hi = (s_hi << 20).to(tl.float32, bitcast=True) * TWO_119 * TWO_119
    if PTX == 1:
        # scale x 2^118 has E4M3's 3 mantissa bits and lies in bf16's normal range: exact in bf16
        r_lo, r_hi = _fp4_decode_bf16x2(c, s_lo.to(tl.bfloat16)[:, :, None], s_hi.to(tl.bfloat16)[:, :, None])
        lo = tl.reshape(r_lo, [BLOCK_N, GH * 16])
        hi = tl.reshape(r_hi, [BLOCK_N, GH * 16])
    else:
        c = c.to(tl.int32)
        r_lo = (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True)
        r_hi = (((c & 0x70) << 18) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
        lo = tl.reshape(r_lo * s_lo[:, :, None], [BLOCK_N, GH * 16])
        hi = tl.reshape(r_hi * s_hi[:, :, None], [BLOCK_N, GH * 16])
    return lo, hi


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _paged_attn_fp4_kernel(
    # pointers
    q_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tile_seq_ptr, tile_tok_ptr, tile_nq_ptr, tile_pos_ptr, table_ptr,
    kc_ptr, ks_ptr, ki_ptr, kv_ptr, vc_ptr, vs_ptr, khs_ptr, vhs_ptr,
    # sizes
    block_size, sm_scale_log2, num_splits,
    # strides
    sq_t, sq_h, so_t, so_h, s_table,
    sk_b, sk_s, sk_h,  # codes view
    ss_b, ss_s, ss_h,  # scales view
    si_b, si_s, si_h,  # outlier index view
    sv_b, sv_s, sv_h,  # outlier value view
    # meta
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, SPLIT: tl.constexpr, NUM_OUTLIERS: tl.constexpr, DOT_FP32: tl.constexpr,
    PTX_DECODE: tl.constexpr,
):
    """The FP4 member of the family (same tiles, splits and partials as _paged_attn_kernel).
    Keys: the group-scaled codes go through the tensor cores with q carrying the head scale; each
    outlier slot then adds q[row, channel] x value for its key (a gather of q, not a select over
    every element). Values have no slots; their head scale is applied to the output. NUM_OUTLIERS:
    the key slots per token-head."""
    tile, kvh, split, seq, tok0, nq, pos0 = _program_tile(tile_seq_ptr, tile_tok_ptr, tile_nq_ptr, tile_pos_ptr)
    GH: tl.constexpr = HALF // 16

    r, t, head, row_ok = _tile_rows(kvh, nq, GROUP, TOKENS, BLOCK_M)
    pos = pos0 + t
    d = tl.arange(0, HALF)
    q_off = (tok0 + t) * sq_t + head * sq_h
    khs = tl.load(khs_ptr + kvh)
    vhs = tl.load(vhs_ptr + kvh)
    q_unit = sm_scale_log2 * khs * 256.0  # the tile's keys hold value / (head scale x 2^8)
    q_lo, q_hi = _load_q(q_ptr, q_off, row_ok, d, q_unit, HALF)
    if not DOT_FP32:
        q_lo = q_lo.to(tl.bfloat16)
        q_hi = q_hi.to(tl.bfloat16)
    v_unit = vhs * 256.0

    start, stop, m_i, l_i, acc_lo, acc_hi = _split_state(pos0, nq, split, num_splits, BLOCK_M, BLOCK_N, HALF)
    for n0 in range(start, stop, BLOCK_N):
        n, nmask, blk, off = _key_block(table_ptr, seq, s_table, n0, stop, block_size, BLOCK_N)
        row_c = tl.multiple_of(blk * sk_b + off * sk_s + kvh * sk_h, 16)
        row_s = blk * ss_b + off * ss_s + kvh * ss_h
        row_o = blk * si_b + off * si_s + kvh * si_h
        row_v = blk * sv_b + off * sv_s + kvh * sv_h
        k_lo, k_hi = _fp4_tile(kc_ptr, ks_ptr, row_c, row_s, nmask, GH, BLOCK_N, PTX_DECODE)
        if DOT_FP32:
            s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
            s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
        else:
            s = tl.dot(q_lo, tl.trans(k_lo.to(tl.bfloat16)))
            s += tl.dot(q_hi, tl.trans(k_hi.to(tl.bfloat16)))
        for o in tl.static_range(NUM_OUTLIERS):  # unused slots hold (0, 0.0): they add nothing
            idx = tl.load(ki_ptr + row_o + o, mask=nmask, other=0).to(tl.int32)
            val = tl.load(kv_ptr + row_v + o, mask=nmask, other=0.0).to(tl.float32)
            qg = tl.load(q_ptr + q_off[:, None] + idx[None, :], mask=row_ok[:, None] & nmask[None, :],
                         other=0.0).to(tl.float32)
            s += qg * (val * sm_scale_log2)[None, :]
        visible = (n[None, :] <= pos[:, None]) & nmask[None, :] & row_ok[:, None]
        p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i)
        v_lo, v_hi = _fp4_tile(vc_ptr, vs_ptr, row_c, row_s, nmask, GH, BLOCK_N, PTX_DECODE)
        acc_lo, acc_hi = _accumulate(acc_lo, acc_hi, alpha, p, v_lo, v_hi, DOT_FP32)
        m_i = m_new
    acc_lo = acc_lo * v_unit
    acc_hi = acc_hi * v_unit

    _store_tile(out_ptr, part_acc_ptr, part_ml_ptr, acc_lo, acc_hi, m_i, l_i, tile, kvh, split, tok0, t, head, r,
                row_ok, d, so_t, so_h, num_splits, BLOCK_M, HALF, SPLIT)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, tile_tok_ptr, tile_nq_ptr,
    so_t, so_h, num_splits,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile, KV head, BLOCK_D output columns) merges the tile's num_splits partials by
    log-sum-exp, in one pass with a running maximum (as the attention kernel's online softmax).
    num_splits is a run-time value (one variant for every count), so the splits are read CHUNK at
    a time as one (CHUNK, BLOCK_M, BLOCK_D) load: a loop over a run-time count with one load per
    split waits out each load's latency in turn (at batch 1, 64 splits, that made the merge
    ~20 us slower on the H200 than the unrolled compile-time loop it replaced). Splitting the
    columns over programs gives a batch of one sequence more than one program per KV head."""
    pdl.start(PDL)
    pdl.wait(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    tok0 = tl.load(tile_tok_ptr + tile)
    nq = tl.load(tile_nq_ptr + tile)
    r, t, head, row_ok = _tile_rows(kvh, nq, GROUP, TOKENS, BLOCK_M)
    dd = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    base0 = (tile * tl.num_programs(1) + kvh) * num_splits
    c = tl.arange(0, CHUNK)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        split = base0 + s0 + c
        ok = (s0 + c) < num_splits
        ml = part_ml_ptr + split[:, None] * 2 * BLOCK_M + r[None, :]
        okr = ok[:, None] & row_ok[None, :]  # rows the attention kernel wrote
        m = tl.load(ml, mask=okr, other=float("-inf"))  # (CHUNK, BLOCK_M)
        l = tl.load(ml + BLOCK_M, mask=okr, other=0.0)
        a = tl.load(part_acc_ptr + split[:, None, None] * BLOCK_M * 2 * HALF + r[None, :, None] * 2 * HALF
                    + dd[None, None, :], mask=okr[:, :, None], other=0.0)  # (CHUNK, BLOCK_M, BLOCK_D)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)  # 0 while nothing came before
        w = tl.exp2(m - m_safe[None, :])  # 0 for an empty split (m = -inf) and for the masked ones
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], 0)
        l_run = l_run * alpha + tl.sum(l * w, 0)
        m_run = m_new
    pdl.end(PDL)
    inv = tl.where(l_run > 0, 1.0 / tl.maximum(l_run, 1e-30), 0.0)
    o_off = (tok0 + t) * so_t + head * so_h
    tl.store(out_ptr + o_off[:, None] + dd[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def default_fp4_decode(ptx: bool, small_tile: bool) -> bool | str:
    """The FP4 kernel's decode when the caller names none: False (float32) without the PTX decode;
    for decode tiles (<= 16 rows) the word decode in its row layout (H200, 7B, 16k keys, 413.7 vs
    474.2 us at batch 32 and 117.7 vs 134.6 at batch 8 against the words in one orientation); else
    the byte decode (True)."""
    if not ptx:
        return False
    if small_tile:
        return "word_rows"
    return True


def default_fp4_maxnreg(small_tile: bool, block_n: int, num_warps: int, num_stages: int, device) -> int | None:
    """The FP4 kernel's register cap when the caller names none: 128 a thread for decode tiles in
    the tuned shape (128 keys, 4 warps, 2 stages) on CUDA. Uncapped, the compiler takes 168, so an
    SM holds 3 programs; at 128 (a few spills) shared memory (56 KB a program) allows 4. H200, from
    a CUDA graph: 7B, 16k keys, batch 32 484 vs 497 us, batch 8 134-135 vs
    136-139; 2B batch 32 249 vs 257, batch 8 72-74 vs 86-88; in the row layout 375 vs 450 at 7B
    batch 32. With 3 stages the cap was slower (spills in the longer pipeline), so only 2."""
    if not (small_tile and block_n == 128 and num_warps == 4 and num_stages == 2):
        return None
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return 128


def ptx_decode_available(device) -> bool:
    """Whether the FP4 kernel can decode in inline PTX here: a CUDA device of compute capability
    8.0 or newer (bf16x2 FMA), not Triton's interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, D)
    plan: TilePlan,
    scale: float,
    *,
    k_cache: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv, D) dense caches
    v_cache: torch.Tensor | None = None,
    fp4_k: tuple | None = None,  # (codes, scales, outlier_idx, outlier_val, head_scale) views
    fp4_v: tuple | None = None,
    fp4_gluon: bool = True,  # FP4 decode tiles may take the Gluon kernel where it can run the call
    pdl_on: bool = True,  # launched with PDL where the device has it (kernels/pdl.py)
) -> torch.Tensor:
    """Causal attention of the plan's query tokens over their paged K/V (a dense cache, or the
    FP4 views), with the kernels as tuned (paged_attention_tuned's defaults). Returns (num_tokens,
    num_heads, D)."""
    return paged_attention_tuned(q, plan, scale, k_cache=k_cache, v_cache=v_cache, fp4_k=fp4_k, fp4_v=fp4_v,
                                 fp4_gluon=None if fp4_gluon else False, pdl_on=pdl_on)


def paged_attention_tuned(
    q: torch.Tensor,  # (num_tokens, num_heads, D)
    plan: TilePlan,
    scale: float,
    *,
    k_cache: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv, D) dense caches
    v_cache: torch.Tensor | None = None,
    fp4_k: tuple | None = None,  # (codes, scales, outlier_idx, outlier_val, head_scale) views
    fp4_v: tuple | None = None,
    block_n: int | None = None,  # keys per inner step (default: as tuned on the H200, see below)
    num_warps: int = 4,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
    fp4_ptx_decode: bool | str | None = None,  # FP4: decode in PTX to bf16x2 (default: on CUDA sm_80+ with
    # bf16/fp16 q); "words": the PTX decode from 32-bit words of codes (_fp4_tile_words; the default
    # for tiles of up to 16 rows), "word_rows": the same with the words as one row per key (a variant)
    maxnreg: int | None = None,  # registers per thread the compiler may use (None: FP4 as tuned, see
    # default_fp4_maxnreg; dense the compiler's choice); 0: no cap
    fp4_gluon: bool | None = None,  # FP4 decode tiles: the Gluon kernel (kernels/fp4_gluon.py); None: where
    # it can run the call (fp4_gluon.supported); True: it must; False: the Triton kernel
    pdl_on: bool = True,  # launched with PDL where the device has it (kernels/pdl.py)
) -> torch.Tensor:
    """paged_attention with the launch's tuning named: the kernel variant, its tile and pipeline
    shape, the register cap, an output buffer (benches and tests; the engine takes the defaults)."""
    n_tok, n_heads, d = q.shape
    is_fp4 = fp4_k is not None
    # Defaults from bench_kernels on the H200 (7B and 2B geometry, batch 32, 16k keys, one query
    # token): dense 32 keys per step (3.5-4% faster than 64); FP4 128 keys, scores as q K^T with
    # the PTX decode from 32-bit words (7B: 484 us against 571 for scores as K q^T from bytes, at
    # batch 32; 135 against 160 at batch 8; the words as one row per key,
    # default_fp4_decode). Tiles of more than 16 rows (prefill chunks, long windows) are not tuned: dense 64
    # keys, FP4 q K^T from bytes (Triton 3.6 does not compile the word decode there, see the assert
    # below).
    # the Gluon kernel unless the caller names a variant of the Triton one
    triton_variant = (block_n is not None or fp4_ptx_decode is not None
                      or (maxnreg is not None and not fp4_gluon))  # with fp4_gluon=True: the Gluon kernel's cap
    if plan.invariant:  # (kernels/attention_plan.py: one shape for every tile, the Triton kernels only)
        assert not fp4_gluon, "a batch-invariant plan runs the Triton kernels"
        fp4_gluon = False
        block_n = block_n or INVARIANT_BLOCK_N
    if is_fp4 and (fp4_gluon or (fp4_gluon is None and not triton_variant)):
        try:
            from kernels import fp4_gluon as gluon_kernel  # imported only where it may run
            why = gluon_kernel.supported(q, plan, fp4_k, fp4_v)
        except ImportError as e:  # a Triton without Gluon
            why = f"no Gluon in this Triton ({e})"
        assert not (fp4_gluon and why), f"the Gluon FP4 kernel cannot run this call: {why}"
        fp4_gluon = why is None
    gluon_maxnreg = maxnreg  # the caller's cap for the Gluon kernel (the Triton kernel's default is set below)
    small_tile = plan.block_m <= 16
    if block_n is None:
        block_n = 128 if is_fp4 else (plan.dense_block_n or (32 if small_tile else 64))
    assert d % 32 == 0 and (d & (d - 1)) == 0, f"head_dim must be a power of two >= 32, got {d}"
    assert q.stride(2) == 1, "q must be contiguous in head_dim"
    if is_fp4:
        kc, ks, ki, kv, khs = fp4_k
        vc, vs, vi, vv, vhs = fp4_v
        n_kv, block_size = kc.shape[2], kc.shape[1]
        assert kc.dtype == torch.uint8 and kc.shape[-1] == d // 2, "FP4 codes view: (blocks, bs, Hkv, D/2) uint8"
        assert ks.shape[-1] == d // 16 and ki.shape == kv.shape and vc.stride() == kc.stride()
        num_outliers = ki.shape[-1]
        assert vs.stride() == ks.stride()
        assert vi.shape[-1] == 0 and vv.shape[-1] == 0, "FP4 values have no outlier slots"
        strides_k = kc.stride()[:3]
        strides_s = ks.stride()[:3]
        strides_o = ki.stride()[:3]
        strides_v = kv.stride()[:3]
    else:
        assert k_cache is not None and v_cache is not None and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(-1) == 1 and k_cache.shape[-1] == d
        n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
        strides_k = k_cache.stride()[:3]
    assert n_heads % n_kv == 0, f"{n_heads} query heads are not a multiple of {n_kv} KV heads"
    group = n_heads // n_kv
    if out is None:
        out = torch.empty_like(q)
    n_tiles = plan.tile_seq.numel()
    splits = plan.num_splits
    if splits > 1:
        part_acc = torch.empty(n_tiles * n_kv * splits * plan.block_m * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n_tiles * n_kv * splits * 2 * plan.block_m, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    dot_fp32 = q.dtype == torch.float32
    if is_fp4 and fp4_ptx_decode is None:
        fp4_ptx_decode = default_fp4_decode(ptx_decode_available(q.device) and not dot_fp32, small_tile)
    assert not (fp4_ptx_decode and dot_fp32), "the PTX decode feeds bf16 tensor-core dots; float32 q uses float32"
    # Triton 3.6 fails to compile the word decode in tiles of more than 16 rows (either orientation)
    assert small_tile or fp4_ptx_decode not in ("words", "word_rows"), "the word decode is for tiles of <= 16 rows"
    if maxnreg is None and is_fp4:
        maxnreg = default_fp4_maxnreg(small_tile, block_n, num_warps, num_stages, q.device)
    if is_fp4 and fp4_gluon:
        gluon_kernel.launch(q, out, part_acc, part_ml, plan, scale, fp4_k, fp4_v, maxnreg=gluon_maxnreg)
    elif is_fp4:
        _paged_attn_fp4_kernel[(n_tiles, n_kv, splits)](
            q, out, part_acc, part_ml,
            plan.tile_seq, plan.tile_tok, plan.tile_nq, plan.tile_pos, plan.block_table,
            kc, ks, ki, kv, vc, vs, khs, vhs,
            block_size, scale * LOG2E, splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.block_table.stride(0),
            *strides_k, *strides_s, *strides_o, *strides_v,
            GROUP=group, TOKENS=plan.tokens_per_tile, BLOCK_M=plan.block_m, BLOCK_N=block_n, HALF=d // 2,
            SPLIT=splits > 1, NUM_OUTLIERS=num_outliers, DOT_FP32=dot_fp32,
            PTX_DECODE={"words": 2, "word_rows": 3}.get(fp4_ptx_decode, int(bool(fp4_ptx_decode))),
            num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
        )
    else:
        _paged_attn_kernel[(n_tiles, n_kv, splits)](
            q, out, part_acc, part_ml,
            plan.tile_seq, plan.tile_tok, plan.tile_nq, plan.tile_pos, plan.block_table,
            k_cache, v_cache,
            block_size, scale * LOG2E, splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.block_table.stride(0),
            *strides_k,
            GROUP=group, TOKENS=plan.tokens_per_tile, BLOCK_M=plan.block_m, BLOCK_N=block_n, HALF=d // 2,
            SPLIT=splits > 1, DOT_FP32=dot_fp32,
            num_warps=num_warps, num_stages=num_stages, **pdl.attention_launch(q, on=pdl_on),
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )
    if splits > 1:
        chunk, block_d = merge_shape(splits, plan.block_m, d)
        _combine_kernel[(n_tiles, n_kv, d // block_d)](
            out, part_acc, part_ml, plan.tile_tok, plan.tile_nq, out.stride(0), out.stride(1), splits,
            GROUP=group, TOKENS=plan.tokens_per_tile, BLOCK_M=plan.block_m, HALF=d // 2, BLOCK_D=block_d,
            CHUNK=chunk, **pdl.attention_launch(q, on=pdl_on),
        )
    return out
