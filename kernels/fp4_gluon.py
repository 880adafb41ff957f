"""FP4 decode attention in Gluon: one query token per sequence, head_dim 128, the
kernels/fp4.py cache read straight into the tensor cores' operand registers.

Why Gluon: the Triton kernel (`_paged_attn_fp4_kernel`) decodes a tile into a blocked layout and
the compiler moves it through shared memory to the MMA operand layout (39 barriers and ~2,900
instructions per 128-key tile, a third of the issue rate; BENCHMARKS.md). Here the
layouts are chosen so that no decoded value leaves its thread:

- Each of the 4 warps owns 32 of each step's 128 keys and keeps its own online softmax (max, sum,
  output); the warps are merged once, at the end. So S = q K^T, P and the output stay inside a
  warp.
- Keys: the B operand of m16n8k16 gives lane (g, c) = (lane / 4, lane % 4) key g of each 8-key
  block and k-indices 16 i + 8 h + 2 c + p. A dot product does not care about the order of its
  dims, so logical k is mapped to code byte 16 c + 4 i + 2 h + p (and q is loaded in the same
  order): each lane's k-indices are then 16 consecutive code bytes of its key (one 16-byte load),
  and one E4M3 group (16 dims) per half, so the group scale rides on the decode's bf16x2 FMA.
- Output: accumulated transposed, O^T = V^T P^T, whose N = 8 is the GQA group (P V would have
  M = 16, 8 rows of padding). P^T's B operand holds exactly the registers of the scores' top rows.
  V^T's A operand gives lane (g, c) dims 8 j + g and keys 2 c + p + 8 h + 16 i; output rows (dims)
  may be permuted too, so logical dim 8 j + g is code byte 8 g + j: 8 consecutive bytes of each of
  its keys (8-byte loads). A bf16x2 register pairs two keys (p = 0, 1) of one dim: a PRMT pairs
  their bytes and the decode takes the two keys' scales as its pair.
- Addressing: a kernels/fp4.FP4PagedLayer block is one page holding all its
  segments, so the kernel takes the page base and, as constants of the pool (page_geometry), each
  segment's offset and its strides per token and KV head. Per step a thread computes one page
  pointer per block (two for 16-key blocks) and one 64-bit add per segment; no load is masked
  (keys past the end read block 0's page and are masked as scores).
- Software pipelining: the next step's code words, scale bytes and key slots are loaded before
  this step's arithmetic, and the block ids of the step after that one step earlier still, so the
  code loads never wait for the block table.
- Scales: an E4M3 byte shifted left by 4 is a bf16 of the scale x 2^-120 (subnormal scales too);
  two bf16x2 multiplies by 2^119 make the decode's operand (SCALE_SPLATS for keys, SCALE_PAIRS for
  values), exact, where a float32 detour took 6 instructions a scale.
The per-pair decode is kernels/fp4.py's (fp4_pair_steps: exact, equal to the float32
decode bit for bit). Key outlier slots: a gather of q; the cache has no value slots. Compiled for sm_90 with Triton 3.6: 1,220 SASS
instructions per 128-key step with 2 key slots, 998 without (scripts/gluon_fp4_probe.py --kernel);
speed and its limits: BENCHMARKS.md and docs/fp4.md.

Torch reference: kernels/paged_attention.paged_attention_ref over FP4PagedLayer.gather, as for the
Triton kernel; tests/test_kernels.py (test_fp4_gluon_*: CUDA only, Gluon has no interpreter; the
compiled form's SASS is checked without a GPU).
"""
from __future__ import annotations

import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels._triton import interpreting
from kernels.attention_plan import LOG2E, UNSPECIALIZED, TilePlan
from kernels.fp4 import fp4_pair_steps

WARPS = gl.constexpr(4)
KEYS = gl.constexpr(32)  # keys per warp per step
BLOCK_N = gl.constexpr(128)  # WARPS x KEYS
HEAD_DIM = 128  # the only head size this kernel reads (Qwen2-VL's)
HALF = gl.constexpr(HEAD_DIM // 2)


def _key_decode_ptx() -> str:
    """pack=4 over (word, its byte b = 0..3): one 32-bit word of key codes ($4; $5-$7 are copies)
    and the lo and hi groups' scales as bf16x2 splats ($8, $12; the rest copies) -> the 4 bytes'
    low-nibble values ($0, $1) and high-nibble values ($2, $3), bf16 pairs: kernels/fp4.py's steps."""
    return "\n".join(["{", ".reg .b32 t01, t23, x, y, z;", "mov.b32 z, 0x80008000;"]
                     + fp4_pair_steps("$4", ("$8", "$8", "$12", "$12"), ["$0", "$1", "$2", "$3"]) + ["}"])


def _value_decode_ptx() -> str:
    """pack=4 over (key pair p, byte b, b + 1): the words of keys 2k ($4) and 2k + 1 ($5; $6, $7
    copies), the PRMT selector of byte b ($8 = 0x4400 + 0x1111 b; $9-$11 copies) and the two keys'
    lo scales ($12) and hi scales ($13) as bf16x2 pairs (SCALE_PAIRS; $14, $15 copies) -> pairs
    (key 2k, key 2k + 1) of byte b's and b + 1's low-nibble values ($0, $1) and high-nibble values
    ($2, $3). The selector puts byte b of each key in the low byte of one 16-bit lane (the other
    bytes are masked off by the steps)."""
    lines = ["{", ".reg .b32 t01, t23, x, y, z, s;", "mov.b32 z, 0x80008000;",
             "prmt.b32 t01, $4, $5, $8;", "add.u32 s, $8, 0x1111;", "prmt.b32 t23, $4, $5, s;"]
    steps = fp4_pair_steps("$4", ("$12", "$12", "$13", "$13"), ["$0", "$1", "$2", "$3"])[2:]  # t01, t23 made above
    return "\n".join(lines + steps + ["}"])


# E4M3 scale bytes -> the decode's bf16 scale operands, scale x 2^118 (the decode's codes are value x
# 2^-126, and q carries 2^8). An E4M3 byte shifted left by 4 is a bf16 whose value is the scale x
# 2^-120, subnormal scales included (E4M3's exponent field lands in bf16's low exponent bits, its
# 3 mantissa bits in bf16's top 3); two exact bf16x2 multiplies by 2^119 (0x7B00) follow.
_TO_SCALE = ["fma.rn.bf16x2 {r}, {r}, c, z;", "fma.rn.bf16x2 {out}, {r}, c, z;"]


def _scale_splats_ptx() -> str:
    """pack=1: a key's lo ($2) and hi ($3) group scale bytes -> each as a bf16x2 splat ($0, $1):
    the byte times 0x00100010 is the byte << 4 in both 16-bit lanes."""
    lines = ["{", ".reg .b32 x, y, c, z;", "mov.b32 c, 0x7B007B00;", "mov.b32 z, 0x80008000;",
             "mul.lo.u32 x, $2, 0x00100010;", "mul.lo.u32 y, $3, 0x00100010;"]
    lines += [t.format(r="x", out="$0") for t in _TO_SCALE] + [t.format(r="y", out="$1") for t in _TO_SCALE]
    return "\n".join(lines + ["}"])


def _scale_pairs_ptx() -> str:
    """pack=2 over keys 2k, 2k + 1: their lo ($2, $3) and hi ($4, $5) group scale bytes -> the lo
    pair ($0) and the hi pair ($1) as bf16x2 (key 2k in the low lane)."""
    lines = ["{", ".reg .b32 x, y, c, z;", "mov.b32 c, 0x7B007B00;", "mov.b32 z, 0x80008000;",
             "prmt.b32 x, $2, $3, 0x5410;", "prmt.b32 y, $4, $5, 0x5410;", "shl.b32 x, x, 4;", "shl.b32 y, y, 4;"]
    lines += [t.format(r="x", out="$0") for t in _TO_SCALE] + [t.format(r="y", out="$1") for t in _TO_SCALE]
    return "\n".join(lines + ["}"])


SCALE_SPLATS = gl.constexpr(_scale_splats_ptx())
SCALE_PAIRS = gl.constexpr(_scale_pairs_ptx())
KEY_DECODE = gl.constexpr(_key_decode_ptx())
VALUE_DECODE = gl.constexpr(_value_decode_ptx())

# Layouts, all rank 3 or more with the warp as the leading (batch) dim.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# key codes as (warp, c, byte of c's 16, key): lane = c + 4 g, 16 bytes a register run; loaded (and
# carried to the next step) as 32-bit words (warp, c, word, key), taken apart as (.., word, byte, ..)
K_BYTES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4, 4, 1], threads_per_warp=[1, 4, 1, 1, 8],
                                        warps_per_cta=[4, 1, 1, 1, 1], order=[3, 2, 1, 4, 0]))
K_WORDS = gl.constexpr(gl.SliceLayout(3, K_BYTES))
# value codes as (warp, key, g, j): loaded as words (warp, key, g, word), decoded with the key pair fastest
V_BYTES = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 2, 4], threads_per_warp=[1, 4, 8, 1, 1],
                                        warps_per_cta=[4, 1, 1, 1, 1], order=[4, 3, 1, 2, 0]))
V_WORDS = gl.constexpr(gl.SliceLayout(4, V_BYTES))
V_ASM = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 2, 4], threads_per_warp=[1, 4, 8, 1, 1],
                                      warps_per_cta=[4, 1, 1, 1, 1], order=[1, 4, 3, 2, 0]))


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
def _ids(n0, stop, table_ptr, seq, s_table, BS_LOG2: gl.constexpr):
    """The block ids of each warp's keys n0 + 32 warp + 0..15 and + 16..31, as (WARPS, 1) each (the
    same block twice unless blocks are 16 keys). Ids past `stop` are not read (the table's row may
    hold anything there): those keys read block 0's page, whose bytes are valid codes, and are
    masked as scores. Read a step before the codes they address (the loop carries them), so that
    the code loads do not wait for the table."""
    W2: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(2, K_WORDS)))
    wk = gl.expand_dims(n0 + gl.arange(0, WARPS, layout=W2) * KEYS, 1)
    row0 = table_ptr + seq * s_table
    if BS_LOG2 >= 5:
        b0 = gl.load(row0 + (wk >> BS_LOG2), mask=wk < stop, other=0)
        b1 = b0
    else:
        b0 = gl.load(row0 + (wk >> 4), mask=wk < stop, other=0)
        b1 = gl.load(row0 + (wk >> 4) + 1, mask=wk + 16 < stop, other=0)
    return b0, b1


@gluon.jit
def _rows(p0, p1, wk, kl, L: gl.constexpr, seg, S: gl.constexpr, BS_LOG2: gl.constexpr, LANE_BITS: gl.constexpr):
    """Byte pointers to the rows of keys wk + kl (kl: 0..31 as (1, KEYS) in L) in a segment that
    starts `seg` bytes into the page (its KV head's part) with S bytes per token. Written as a
    base per block plus a lane's part of kl x S plus a register's part (LANE_BITS: the bits of kl
    that vary across lanes in L; any value gives the same addresses, since bit 4 is never a lane
    bit, and the right one is what lets the compiler fold), so that the compiler can fold the register parts into the loads'
    immediate offsets (sm_90, Triton 3.6: 14 64-bit multiply-adds a step in the loop without key
    slots, where per-key addresses took 4-6 instructions each)."""
    p0 = gl.convert_layout(p0, L, assert_trivial=True)
    p1 = gl.convert_layout(p1, L, assert_trivial=True)
    if BS_LOG2 >= 5:
        base = p0 + (seg + (gl.convert_layout(wk, L, assert_trivial=True) & ((1 << BS_LOG2) - 1)) * S)
    else:
        base = gl.where((kl & ~LANE_BITS) >= 16, p1 + (seg - 16 * S), p0 + seg)
    return (base + (kl & LANE_BITS) * S) + (kl & ~LANE_BITS) * S


@gluon.jit
def _local_keys(L: gl.constexpr):
    """0..31 as (1, KEYS) in L."""
    return gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(0, L)), 0)


# the scores' top 8 rows (the query heads of a GQA group of <= 8) of the (warp, 16, 32) accumulator
S_TOP = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16]], lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 8, 32]))


@gluon.jit
def _add_slot(s, idx, val, q_rowp, k_scale):
    """scores += q[row, idx] x val x scale for one key slot (idx, val per key; q_rowp: each score
    row's q row). A slot's index is always a channel (an empty slot holds (0, 0.0)), so the gather
    needs no mask."""
    qg = gl.load(q_rowp + gl.expand_dims(idx, 1).to(gl.int32)).to(gl.float32)
    return s + qg * (gl.expand_dims(val, 1).to(gl.float32) * k_scale)


@gluon.jit
def _fetch(n0, ids, page_ptr, kvh, PAGE: gl.constexpr, KC: gl.constexpr,
           KS: gl.constexpr, KI: gl.constexpr, KV: gl.constexpr, VC: gl.constexpr, VS: gl.constexpr,
           C_S: gl.constexpr, C_H: gl.constexpr, S_S: gl.constexpr, S_H: gl.constexpr, I_S: gl.constexpr,
           I_H: gl.constexpr, O_S: gl.constexpr, O_H: gl.constexpr, BS_LOG2: gl.constexpr,
           NUM_OUTLIERS: gl.constexpr):
    """One step's raw bytes (keys n0 + 32 warp + 0..31), as 32-bit words where they stay in
    registers until the next step: key code words and scale bytes, value code words and scale
    bytes, and per key its two slots' indices (16 bits) and values (32 bits), from the blocks `ids`
    (_ids). No load is masked: keys at or past the split's end read block 0's page and are masked
    as scores. The segment offsets (KC...) and strides per token (_S) and KV head (_H) are in
    bytes (page_geometry)."""
    W2: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(2, K_WORDS)))
    wk = gl.expand_dims(n0 + gl.arange(0, WARPS, layout=W2) * KEYS, 1)
    p0 = page_ptr + ids[0].to(gl.uint32).to(gl.int64) * PAGE
    p1 = page_ptr + ids[1].to(gl.uint32).to(gl.int64) * PAGE
    # keys: code words (warp, c, word, key), scale bytes (warp, c, key)
    SK2: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, K_WORDS))
    kl = _local_keys(SK2)
    row = gl.multiple_of(_rows(p0, p1, wk, kl, SK2, KC + kvh * C_H, C_S, BS_LOG2, 7), [16, 16])
    SKC: gl.constexpr = gl.SliceLayout(2, K_WORDS)
    ck = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SKC))), 0), 2)
    ik = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, K_WORDS))))
    ik = gl.expand_dims(gl.expand_dims(gl.expand_dims(ik, 0), 1), 3)
    kw = gl.load(gl.expand_dims(gl.expand_dims(row.to(gl.pointer_type(gl.int32)), 1), 2) + gl.expand_dims(ck, 2) * 4 + ik)
    srow = gl.expand_dims(gl.convert_layout(_rows(p0, p1, wk, kl, SK2, KS + kvh * S_H, S_S, BS_LOG2, 7),
                                            gl.SliceLayout(1, SKC), assert_trivial=True), 1) + ck
    ke_lo = gl.load(srow)
    ke_hi = gl.load(srow + 4)
    # values: code words (warp, key, g, word), scale bytes (warp, key, g)
    SV2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, V_WORDS))
    vl = _local_keys(SV2)
    vrow = gl.multiple_of(_rows(p0, p1, wk, vl, SV2, VC + kvh * C_H, C_S, BS_LOG2, 6), [16, 16])
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, V_WORDS))))
    gv3 = gl.expand_dims(gl.expand_dims(gv, 0), 1)
    iv = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, V_WORDS))))
    iv = gl.expand_dims(gl.expand_dims(gl.expand_dims(iv, 0), 1), 2)
    vw = gl.load(gl.expand_dims(gl.expand_dims(vrow.to(gl.pointer_type(gl.int32)), 2), 3) + gl.expand_dims(gv3, 3) * 2 + iv)
    vsrow = gl.expand_dims(_rows(p0, p1, wk, vl, SV2, VS + kvh * S_H, S_S, BS_LOG2, 6), 2) + gv3 // 2
    ve_lo = gl.load(vsrow)
    ve_hi = gl.load(vsrow + 4)
    # key slots, per key of the scores' columns: both indices in 16 bits, both values in 32
    COLS_T: gl.constexpr = gl.SliceLayout(1, S_TOP)
    if NUM_OUTLIERS > 0:
        ol = _local_keys(COLS_T)
        oidx = gl.load(_rows(p0, p1, wk, ol, COLS_T, KI + kvh * I_H, I_S, BS_LOG2, 6).to(gl.pointer_type(gl.int16)))
        oval = gl.load(_rows(p0, p1, wk, ol, COLS_T, KV + kvh * O_H, O_S, BS_LOG2, 6).to(gl.pointer_type(gl.int32)))
    else:
        oidx = gl.full([WARPS, KEYS], 0, gl.int16, layout=COLS_T)
        oval = gl.full([WARPS, KEYS], 0, gl.int32, layout=COLS_T)
    return kw, ke_lo, ke_hi, vw, ve_lo, ve_hi, oidx, oval


@gluon.jit(do_not_specialize=UNSPECIALIZED)  # as the Triton kernels: a warm-up at one table width covers all
def _fp4_decode_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tile_seq_ptr, tile_tok_ptr, tile_pos_ptr, table_ptr, page_ptr, khs_ptr, vhs_ptr,
    sm_scale_log2, num_splits,
    sq_t, sq_h, so_t, so_h, s_table,
    GROUP: gl.constexpr, SPLIT: gl.constexpr, BS_LOG2: gl.constexpr, NUM_OUTLIERS: gl.constexpr,
    PAGE: gl.constexpr, KC: gl.constexpr, KS: gl.constexpr, KI: gl.constexpr, KV: gl.constexpr,
    VC: gl.constexpr, VS: gl.constexpr, C_S: gl.constexpr, C_H: gl.constexpr, S_S: gl.constexpr,
    S_H: gl.constexpr, I_S: gl.constexpr, I_H: gl.constexpr, O_S: gl.constexpr, O_H: gl.constexpr,
):
    """One program: (tile = sequence, KV head, split); GROUP <= 8 query heads. Partials as
    _paged_attn_fp4_kernel writes them (BLOCK_M 16). S = q K^T takes the MMA's 16 rows (8 of them
    zero); the output is accumulated transposed, O^T = V^T P^T, whose N = 8 fits the group: P^T's
    B operand holds exactly the scores' top-row registers, and the accumulator is 32 registers.
    The next step's bytes are loaded before this step's arithmetic (software pipelining).
    Key outlier slots (NUM_OUTLIERS 0 or 2; their codes are 0): each adds q[row, channel] x value
    to its key's scores, a gather of q per (row, key, slot). Values have no slots."""
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

    # the scores' top rows: key of each column, q row of each row (for the key slots' gather)
    ROWS_T: gl.constexpr = gl.SliceLayout(2, S_TOP)
    COLS_T: gl.constexpr = gl.SliceLayout(1, S_TOP)
    n_t = gl.expand_dims(gl.expand_dims(gl.arange(0, KEYS, layout=gl.SliceLayout(0, COLS_T)), 0), 1)
    w_t = gl.expand_dims(gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, COLS_T)), 1), 1)
    r_t = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, ROWS_T)), 0), 2)
    q_rowp = q_ptr + tok0 * sq_t + (kvh * GROUP + gl.minimum(r_t, GROUP - 1)) * sq_h  # rows past the group: unused
    k_scale = sm_scale_log2  # the slots hold values in the model's units

    m_i = gl.full([WARPS, 8], float("-inf"), gl.float32, layout=ROWS_T)
    l_i = gl.full([WARPS, 8], 0.0, gl.float32, layout=ROWS_T)
    acc_lo = gl.full([WARPS, HALF, 8], 0.0, gl.float32, layout=MMA)  # O^T: (warp, dim, row)
    acc_hi = gl.full([WARPS, HALF, 8], 0.0, gl.float32, layout=MMA)
    nxt = _fetch(start, _ids(start, stop, table_ptr, seq, s_table, BS_LOG2), page_ptr, kvh, PAGE, KC, KS, KI, KV, VC,
                 VS, C_S, C_H, S_S, S_H, I_S, I_H, O_S, O_H, BS_LOG2, NUM_OUTLIERS)
    ids = _ids(start + BLOCK_N, stop, table_ptr, seq, s_table, BS_LOG2)
    for n0 in range(start, stop, BLOCK_N):
        kw, ke_lo, ke_hi, vw, ve_lo, ve_hi, oidx, oval = nxt
        # a block of its own (the condition always holds), so that ptxas issues the next step's
        # loads at the top of this one: left in one block with the arithmetic, it sinks them to
        # 64-84% of the step, where DRAM's latency is no longer hidden
        if n0 >= start:
            nxt = _fetch(n0 + BLOCK_N, ids, page_ptr, kvh, PAGE, KC, KS, KI, KV, VC, VS, C_S, C_H, S_S, S_H, I_S,
                         I_H, O_S, O_H, BS_LOG2, NUM_OUTLIERS)
        ids = _ids(n0 + 2 * BLOCK_N, stop, table_ptr, seq, s_table, BS_LOG2)
        bk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, K_BYTES)))))
        bk = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(bk, 0), 1), 2), 4)
        kw5, _ = gl.broadcast(gl.expand_dims(kw, 3), bk)  # (warp, c, word, byte, key): the word per byte
        ks_lo, ks_hi = gl.inline_asm_elementwise(SCALE_SPLATS, "=r,=r,r,r", [ke_lo.to(gl.int32), ke_hi.to(gl.int32)],
                                                 dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        k_lo, k_hi = gl.inline_asm_elementwise(
            KEY_DECODE, "=r,=r,=r,=r" + ",r" * 12,
            [kw5, gl.expand_dims(gl.expand_dims(ks_lo, 2), 3), gl.expand_dims(gl.expand_dims(ks_hi, 2), 3)],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        k_lo = gl.reshape(k_lo, [WARPS, 4, 16, KEYS])
        k_hi = gl.reshape(k_hi, [WARPS, 4, 16, KEYS])
        # (warp, c, byte 4 i + 2 h + p, key) -> (warp, k = 16 i + 8 h + 2 c + p, key)
        k_lo = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(k_lo, [WARPS, 4, 4, 2, 2, KEYS]), [0, 2, 3, 1, 4, 5]),
                                            [WARPS, HALF, KEYS]), B_OP, assert_trivial=True)
        k_hi = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(k_hi, [WARPS, 4, 4, 2, 2, KEYS]), [0, 2, 3, 1, 4, 5]),
                                            [WARPS, HALF, KEYS]), B_OP, assert_trivial=True)
        s = mma_v2(q_lo, k_lo, gl.full([WARPS, 16, KEYS], 0.0, gl.float32, layout=MMA))
        s = mma_v2(q_hi, k_hi, s)
        # rows 0..7 only (the rest are the MMA's padding)
        s, _ = gl.split(gl.permute(gl.reshape(s, [WARPS, 2, 8, KEYS]), [0, 2, 3, 1]))
        s = gl.convert_layout(s, S_TOP, assert_trivial=True)
        if NUM_OUTLIERS > 0:
            i0 = oidx & 0xFF
            i1 = (oidx >> 8) & 0xFF
            v0 = (oval & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
            v1 = (oval >> 16).to(gl.int16).to(gl.float16, bitcast=True)
            # unused slots hold (0, 0.0): they add nothing
            s = _add_slot(s, i0, v0, q_rowp, k_scale)
            s = _add_slot(s, i1, v1, q_rowp, k_scale)
        s = gl.where((n0 + w_t * KEYS + n_t) < stop, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        p_t = gl.convert_layout(gl.permute(p.to(gl.bfloat16), [0, 2, 1]), B_OP, assert_trivial=True)  # (warp, key, row)

        bv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, V_ASM)))))
        sel = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims((bv & 2) * 0x1111 + 0x4400, 0), 1), 2), 3)
        vw5, sel = gl.broadcast(gl.expand_dims(gl.convert_layout(vw, gl.SliceLayout(4, V_ASM), assert_trivial=True),
                                               4), sel)
        SV3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, V_ASM))
        # keys 2k, 2k + 1's (lo pair, hi pair) as one tensor's two elements: the decode's pack of 4
        # over (key pair, 2 bytes) then receives them as its operands 12 and 13
        vs_pairs = gl.inline_asm_elementwise(SCALE_PAIRS, "=r,=r,r,r,r,r", [ve_lo.to(gl.int32), ve_hi.to(gl.int32)],
                                             dtype=gl.int32, is_pure=True, pack=2)
        v_lo, v_hi = gl.inline_asm_elementwise(
            VALUE_DECODE, "=r,=r,=r,=r" + ",r" * 12,
            [vw5, sel, gl.expand_dims(gl.expand_dims(gl.convert_layout(vs_pairs, SV3, assert_trivial=True), 3), 4)],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        v_lo = gl.reshape(v_lo, [WARPS, KEYS, 8, 8])
        v_hi = gl.reshape(v_hi, [WARPS, KEYS, 8, 8])
        # (warp, key, g, j) -> V^T (warp, m = 8 j + g, key)
        v_lo = gl.convert_layout(gl.reshape(gl.permute(v_lo, [0, 3, 2, 1]), [WARPS, HALF, KEYS]), A_OP,
                                 assert_trivial=True)
        v_hi = gl.convert_layout(gl.reshape(gl.permute(v_hi, [0, 3, 2, 1]), [WARPS, HALF, KEYS]), A_OP,
                                 assert_trivial=True)
        a3 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, MMA)), 1)
        acc_lo = mma_v2(v_lo, p_t, acc_lo * a3)
        acc_hi = mma_v2(v_hi, p_t, acc_hi * a3)

    # merge the warps' softmax states
    m = gl.max(m_i, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    f = gl.exp2(m_i - gl.expand_dims(m_safe, 0))
    l = gl.sum(l_i * f, 0)
    f3 = gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, MMA)), 1) * (vhs * 256.0)
    o_lo = gl.sum(acc_lo * f3, 0)  # (dim m, row)
    o_hi = gl.sum(acc_hi * f3, 0)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    m_o = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(1, OL)), 1)
    r_o = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, OL)), 0)
    dim_o = (m_o % 8) * 8 + m_o // 8  # m = 8 j + g is dim 8 g + j
    row_ok = (r_o < GROUP) & (dim_o >= 0)
    if SPLIT:
        base = (tile * gl.num_programs(1) + kvh) * num_splits + split
        a_off = base * 16 * 2 * HALF + r_o * 2 * HALF + dim_o
        gl.store(part_acc_ptr + a_off, o_lo, mask=row_ok)
        gl.store(part_acc_ptr + a_off + HALF, o_hi, mask=row_ok)
        RL: gl.constexpr = gl.SliceLayout(0, ROWS_T)
        r1 = gl.arange(0, 8, layout=RL)
        gl.store(part_ml_ptr + base * 2 * 16 + r1, m, mask=r1 < GROUP)
        gl.store(part_ml_ptr + base * 2 * 16 + 16 + r1, l, mask=r1 < GROUP)
    else:
        l2 = gl.convert_layout(l, gl.SliceLayout(0, OL))
        inv = gl.expand_dims(gl.where(l2 > 0, 1.0 / gl.maximum(l2, 1e-30), 0.0), 0)
        o_off = tok0 * so_t + (kvh * GROUP + r_o) * so_h + dim_o
        gl.store(out_ptr + o_off, (o_lo * inv).to(out_ptr.dtype.element_ty), mask=row_ok)
        gl.store(out_ptr + o_off + HALF, (o_hi * inv).to(out_ptr.dtype.element_ty), mask=row_ok)


def _why_not(device, dtype: torch.dtype, head_dim: int, group: int, key_slots: int) -> str | None:
    """The conditions that depend on the engine alone (not on a step): None if they hold."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return "not a CUDA device (Gluon has no interpreter)"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "needs sm_80 or newer (bf16 mma)"
    if dtype not in (torch.bfloat16, torch.float16):
        return "q must be bf16 or fp16"
    if head_dim != HEAD_DIM:
        return f"head_dim must be {HEAD_DIM}"
    if group > 8:
        return "decode tiles only (one query token, GQA group <= 8)"
    if key_slots not in (0, 2):
        return "key outlier slots must be 0 or 2"
    return None


def engine_can_use(group: int, head_dim: int, key_slots: int, compute_dtype: torch.dtype, device) -> bool:
    """Whether an engine's FP4 decode steps will run this kernel (supported() for its calls), so
    that its plans take this kernel's split count (the engine asks only where its
    KernelOptions.fp4_gluon is on).
    (EngineConfig.fp4_gluon)."""
    return _why_not(device, compute_dtype, head_dim, group, key_slots) is None


def supported(q: torch.Tensor, plan: TilePlan, fp4_k: tuple, fp4_v: tuple) -> str | None:
    """None if this kernel can run the call, else why not."""
    kc, _, ki, _, _ = fp4_k
    why = _why_not(q.device, q.dtype, q.shape[-1], q.shape[1] // kc.shape[2], ki.shape[-1])
    if why is None and (plan.tokens_per_tile != 1 or plan.block_m != 16):
        why = "decode tiles only (one query token, GQA group <= 8)"
    bs = kc.shape[1]
    if why is None and (bs & (bs - 1) or not 16 <= bs <= 128 or any(st % 16 for st in kc.stride()[:3])):
        why = "block size must be a power of two from 16 to 128 and code rows 16-byte aligned"
    if why is None and page_geometry(fp4_k, fp4_v) is None:
        why = "the views must be one FP4PagedLayer's pages"
    return why


def launch(q: torch.Tensor, out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, plan: TilePlan,
           scale: float, fp4_k: tuple, fp4_v: tuple, maxnreg: int | None = None) -> None:
    """The split kernel (or the whole attention, unsplit); kernels/paged_attention.paged_attention
    owns the partial buffers and the merge. maxnreg: a register cap (None: the compiler's choice,
    250 registers with key slots and 237 without for sm_90 with Triton 3.6, so 2 programs an SM).
    A cap of 168 (3 programs an SM) is about 2x slower on the H200 with the loads issued first, so
    it is not the default."""
    kc, _, _, _, khs = fp4_k
    _, _, _, _, vhs = fp4_v
    n_kv = kc.shape[2]
    group = q.shape[1] // n_kv
    n_tiles = plan.tile_seq.numel()
    splits = plan.num_splits
    _without_jit_hooks(lambda: _fp4_decode_kernel[(n_tiles, n_kv, splits)](
        q, out, part_acc, part_ml,
        plan.tile_seq, plan.tile_tok, plan.tile_pos, plan.block_table, kc, khs, vhs,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.block_table.stride(0),
        GROUP=group, SPLIT=splits > 1, BS_LOG2=kc.shape[1].bit_length() - 1, NUM_OUTLIERS=fp4_k[2].shape[-1],
        **page_geometry(fp4_k, fp4_v), num_warps=WARPS, **({"maxnreg": maxnreg} if maxnreg else {}),
    ))


_GEOMETRY: dict = {}  # page_geometry's answers by the views' addresses, strides and shapes


def page_geometry(fp4_k: tuple, fp4_v: tuple) -> dict | None:
    """The kernel's constants for one pool: the page's bytes (PAGE), each segment's byte offset from
    the key codes (KC = 0, KS, KI, KV, VC, VS) and the byte strides per token (_S) and per KV head
    (_H) of codes (C, both K and V), scales (S), slot indices (I) and slot values (O). None if the
    views are not one kernels/fp4.FP4PagedLayer page (the same storage and block stride, K and V alike).
    Memoized by what determines it (each view's address, strides, shape and dtype): a decode step
    asks once per layer, twice (supported, launch), and working it out takes tens of microseconds."""
    views = (*fp4_k[:4], *fp4_v[:2])
    key = tuple((t.data_ptr(), t.stride(), t.shape, t.dtype) for t in views)
    if key not in _GEOMETRY:
        if len(_GEOMETRY) > 256:
            _GEOMETRY.clear()
        _GEOMETRY[key] = _page_geometry(fp4_k, fp4_v)
    return _GEOMETRY[key]


def _page_geometry(fp4_k: tuple, fp4_v: tuple) -> dict | None:
    kc, ks, ki, kv, _ = fp4_k
    vc, vs, _, _, _ = fp4_v
    views = [t for t in (kc, ks, ki, kv, vc, vs) if t.numel()]  # without key slots, their views are empty

    def strides(t):
        return tuple(st * t.element_size() for st in t.stride()[:3]) if t.numel() else (0, 0, 0)

    def offset(t):
        return t.data_ptr() - kc.data_ptr() if t.numel() else 0

    page = strides(kc)[0]
    if not (all(t.untyped_storage().data_ptr() == kc.untyped_storage().data_ptr() for t in views)
            and all(strides(t)[0] == page and 0 <= offset(t) < page for t in views)
            and strides(kc) == strides(vc) and strides(ks) == strides(vs) and page % 16 == 0):
        return None
    offs = [offset(t) for t in (kc, ks, ki, kv, vc, vs)]
    return dict(PAGE=page, KC=0, KS=offs[1], KI=offs[2], KV=offs[3], VC=offs[4], VS=offs[5],
                C_S=strides(kc)[1], C_H=strides(kc)[2], S_S=strides(ks)[1], S_H=strides(ks)[2],
                I_S=strides(ki)[1], I_H=strides(ki)[2], O_S=strides(kv)[1], O_H=strides(kv)[2])


# Called with (kernel name, seconds) when a launch compiled (or loaded) a variant of this kernel:
# docproc.engine.jit_watch listens, as it does to Triton's hooks for the other kernels.
COMPILE_LISTENERS: list = []


def _without_jit_hooks(run) -> None:
    """Run a launch with Triton's JIT hooks unset: Triton 3.6 serializes a kernel's constants to JSON
    before it calls them, which fails for a Gluon kernel's (a constexpr), so a hook installed by
    the engine (docproc.engine.jit_watch) made the first launch raise TypeError. A compile is
    reported to COMPILE_LISTENERS instead."""
    rt = triton.knobs.runtime
    hooks = (getattr(rt, "jit_cache_hook", None), getattr(rt, "jit_post_compile_hook", None))
    if hooks == (None, None):
        run()
        return
    before = _variants()
    t0 = time.perf_counter()
    rt.jit_cache_hook = rt.jit_post_compile_hook = None
    try:
        run()
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = hooks
    if _variants() > before:
        for listener in COMPILE_LISTENERS:
            listener("_fp4_decode_kernel", time.perf_counter() - t0)


def _variants() -> int:
    """Compiled variants of the kernel, on every device."""
    return sum(len(c[0]) for c in getattr(_fp4_decode_kernel, "device_caches", {}).values())
