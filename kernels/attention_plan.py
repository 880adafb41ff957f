"""Planning paged attention: how a step's query tokens become tiles, how many key splits each
tile takes and which kernel shape runs it; the launches warm-up compiles. No kernels here: the
Triton family (kernels/paged_attention.py) and the Gluon FP4 decode (kernels/fp4_gluon.py) both
run these plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from kernels._triton import triton

LOG2E = 1.4426950408889634

# Integer arguments Triton must not specialize on (it compiles a variant for a value of 1 and one
# for a multiple of 16). The block table's row stride is its width, the longest table of the step:
# it changes from step to step, so a warm-up at one width would not cover a step at another (one
# load per key block). The split count is a run-time value too (as a compile-time constant it made
# 7 counts x 4 tile shapes = 28 variants per kernel for warm-up to compile, 107 s at engine start on
# the H200 for the bf16 engine with its draft): a kernel has one variant per tile shape for unsplit
# tiles and one for split tiles (SPLIT), 8 in all, and the merge kernel one per tile shape. A split count only enters one division per program and the partials'
# offsets.
UNSPECIALIZED = ["s_table", "num_splits"]


def merge_shape(num_splits: int, block_m: int, head_dim: int) -> tuple[int, int]:
    """The merge kernel's (splits per load, output columns per program). Up to 8 splits (every
    batch of 32 or more sequences at the 7B geometry): all of them in one (8, rows, 32) load.
    More (small batches over long contexts, up to 64): 32 splits per load over 16 columns, so a
    batch of one gets 8 programs per KV head and two loads in turn. H200, 7B, replayed from a
    CUDA graph: one shape of 32 x 16 for every count took batch 32 from 26.9 to 38.3 us at 1k
    keys; 8 at a time over 32 columns left batch 1 at 16k keys (64 splits) at 28.6 us, against
    19.3 with 32 x 16 and 17.9 for the compile-time loop these replace. Fewer splits per load
    for tiles of more rows keep a load at 32-64 values per thread at 4 warps."""
    if num_splits <= 8:
        return 8, min(32, head_dim)
    return max(8, 512 // block_m), 16


@dataclass
class TilePlan:
    """Host-side split of a batch's query tokens into tiles (built once per step, shared by all
    layers)."""

    tile_seq: torch.Tensor  # (T,) int32
    tile_tok: torch.Tensor  # (T,) int32: first query row of the tile in q
    tile_nq: torch.Tensor  # (T,) int32
    tile_pos: torch.Tensor  # (T,) int32: absolute position of the tile's first query token
    block_table: torch.Tensor  # (num_seqs, max_blocks) int32
    tokens_per_tile: int
    block_m: int
    num_splits: int
    max_context: int
    dense_block_n: int | None = None  # the dense kernel's keys per step chosen with the splits (wide decode)
    invariant: bool = False  # a batch-invariant plan (INVARIANT_BLOCK_N below): one fixed shape


# Batch-invariant plans (KernelOptions.batch_invariant). A row's attention output must not depend
# on the rows beside it: not on the step's longest window (which sets the tile shape above), nor on
# the number of tiles (which sets the split count, and with it where the online softmax restarts
# and how the merge adds the pieces). So every tile of every step (decode, verification, prefill
# chunk) takes one shape: one query token (its GQA group's heads are the tile's rows, so a row sits
# at the same place of the same tile shape however its step is made), INVARIANT_BLOCK_N keys a
# step, one key split. A row then sums its keys in blocks [0, 64), [64, 128), ... up to its own
# position; key rows past it inside its last block add exact zeros (weight 0). The price: decode
# parallelism (one program per sequence and KV head, where the default plan splits long contexts
# to fill the chip), and prefill chunks and verification windows read their keys once per token.
INVARIANT_BLOCK_N = 64


def tile_shape(max_q: int, group: int, invariant: bool = False) -> tuple[int, int]:
    """(query tokens per tile, BLOCK_M rows) for windows of at most max_q tokens and GQA group size
    `group`: up to ~64 rows of (token, head) per tile, a power of two >= 16. invariant: the one
    shape of batch-invariant plans (above), one token's, whatever max_q."""
    if invariant:
        return tile_shape(1, group)
    tokens = max(1, min(max_q, max(1, 64 // group)))
    block_m = max(16, triton.next_power_of_2(tokens * group))
    tokens = max(1, block_m // group) if max_q > 1 else 1
    return tokens, block_m


MAX_SPLITS = 64


def warmup_launches(group: int, max_window: int = 64, dense: bool = False,
                    num_kv_heads: int | None = None, invariant: bool = False) -> list[tuple[int, int, int | None]]:
    """(query tokens per sequence, key splits) pairs whose launches compile every variant of the
    kernels that plan_tiles and default_num_splits can ask for with GQA group `group`: one window
    length per distinct tile_shape (decode, verify windows, prefill chunks), unsplit (1) and split
    (the split count is a run-time argument, so 2 stands for every count up to 8 and 16 for every
    count above, the two shapes of the merge kernel, merge_shape). The other compile-time parameters are fixed per engine (head size,
    cache format, group, dtype) or follow from the tile shape (the FP4 key layout, the dense
    kernel's keys per step), but for the dense kernel's wide decode (dense_wide_decode): its 128
    keys a step, unsplit and split, and at two KV heads its narrow decode (dense_narrow_decode): 64
    keys a step, unsplit and split (32 splits on 132 SMs; fewer SMs, fewer). Triples (q_len,
    splits, the plan's dense_block_n). invariant: the one launch of batch-invariant plans."""
    if invariant:
        return [(1, 1, None)]
    shapes: dict[tuple[int, int], int] = {}
    for q_len in range(1, max_window + 1):
        shapes.setdefault(tile_shape(q_len, group), q_len)
    out = [(q_len, s, None) for q_len in shapes.values() for s in (1, 2, 16)]
    if dense:
        out += [(1, s, WIDE_BLOCK_N) for s in (1, 2)]
        if num_kv_heads == 2:
            out += [(1, s, NARROW_BLOCK_N) for s in (1, 2)]
    return out


# The dense kernel's decode shape for few (tile, KV head) pairs: 128 keys a step and about two
# programs an SM. H200, from a CUDA graph, default shape -> wide (us; BENCHMARKS.md):
# - PDL on: 7B, 16k keys, batch 1 26.0 -> 16.6, batch 2 50.0 -> 26.1, batch 4
#   52.6 -> 40.9; 4k keys 13.5 -> 8.9, 17.4 -> 10.5, 17.9 -> 13.6; 2B (2 KV heads) batch 8 52.8 ->
#   41.6 (16k), 96.0 -> 73.2 (32k); from 128 pairs slower (7B batch 32, 16k: 252.7 -> 267.2).
# - 1k-16k keys, 2-64 pairs (the default shape against the wide one at the same
#   cells, PDL on and off): the wide shape is faster in 40 of the 44 cells compared (below 4k keys,
#   or above 16 pairs): default / wide up to 1.45 (7B batch 16, 1k keys, PDL off), 1.34 (7B batch 8,
#   1k, PDL on), 1.00-1.03 at 32 pairs over 16k keys. The four exceptions are 2-4 pairs at 2k keys:
#   0.97-0.99 with PDL off, and 0.87 at 2B batch 1 with PDL on. At 64 pairs over 16k keys it was
#   faster with PDL off (132.2 against 136.8) and much slower with PDL on (170.0 against 135.7), so
#   not above 32 pairs.
# So: one query token, at least 1k keys, up to 32 pairs (7B batch 8, 2B batch 16). Under 1k keys:
# not measured, the default.
WIDE_BLOCK_N = 128
WIDE_MAX_PAIRS = 32
WIDE_MIN_CONTEXT = 1024


def dense_wide_decode(num_tiles: int, max_q: int, max_context: int, num_kv_heads: int) -> bool:
    """Whether a dense decode step (one query token per sequence) takes the wide shape:
    WIDE_BLOCK_N keys a step, splits from default_num_splits(wide=True)."""
    return max_q == 1 and num_tiles * num_kv_heads <= WIDE_MAX_PAIRS and max_context >= WIDE_MIN_CONTEXT


# The dense kernel's decode shape at two KV heads and 9-16 pairs (2B geometry, batch 5-8) over at
# least 4k keys: 64 keys a step in the default split count (32 there). H200, from a CUDA graph,
# 2B batch 8 (16 pairs), this shape against the wide one, PDL on: 4k keys 12.26
# against 13.67 us, 16k 40.43 against 42.04, 32k 70.96 against 73.74 (PDL off, 16k: 41.50 against
# 41.26); the same pair count at four KV heads (7B batch 4, 16k) was 10% slower than wide (45.63
# against 41.38), so only two KV heads. As the engine plans it: batch 8 at
# 8k, 16k, 32k keys 25.1, 40.4, 70.3 us against wide's 25.6, 41.6, 72.9 (SDPA 22.7, 37.0, 66.0);
# batch 6 (12 pairs) 21.5, 36.0, 62.2 against 23.5, 39.0, 68.1.
NARROW_BLOCK_N = 64
NARROW_MIN_CONTEXT = 4096


def dense_narrow_decode(num_tiles: int, max_q: int, max_context: int, num_kv_heads: int) -> bool:
    """Whether a dense decode step takes the narrow shape: NARROW_BLOCK_N keys a step, the default
    split count (default_num_splits(wide=False))."""
    return (max_q == 1 and num_kv_heads == 2 and 8 < num_tiles * num_kv_heads <= 16
            and max_context >= NARROW_MIN_CONTEXT)


def dense_decode_block_n(num_tiles: int, max_q: int, max_context: int, num_kv_heads: int) -> int | None:
    """The dense kernel's keys per step for a plan whose split count is left to the default:
    NARROW_BLOCK_N (dense_narrow_decode), WIDE_BLOCK_N (dense_wide_decode), else None (the
    kernel's default). The split count follows: default_num_splits(wide=block_n == WIDE_BLOCK_N)."""
    if dense_narrow_decode(num_tiles, max_q, max_context, num_kv_heads):
        return NARROW_BLOCK_N
    if dense_wide_decode(num_tiles, max_q, max_context, num_kv_heads):
        return WIDE_BLOCK_N
    return None


def default_num_splits(num_tiles: int, max_context: int, num_sms: int, num_kv_heads: int = 4,
                       wide: bool = False) -> int:
    """Key splits: enough programs to fill the chip (about 8 per SM over tiles x KV heads x splits),
    but at least 64 keys per split, a power of two (the counts tuned on the H200), at most 32, or
    64 where even 32 splits leave SMs without a program (a batch of one or two sequences).
    (Counting KV heads matters at 2B's 2 KV heads: 2 x SMs over tiles alone left its rows 9-15%
    behind SDPA. And fewer keys per split pay: at 7B, batch 1, replayed from a CUDA graph on the
    H200, 1k keys take 12.1 us in 4 splits, 7.3 us in 16; 4k keys 13.7 us in 16 splits, 10.2 us in
    64; SDPA 6.5 and 7.6 us.)
    wide (dense_wide_decode): about 2 programs an SM of WIDE_BLOCK_N keys a step, a power of two,
    at most MAX_SPLITS, each split at least one step."""
    if wide:
        n = max(1, min(MAX_SPLITS, 2 * num_sms // max(1, num_tiles * num_kv_heads), max_context // WIDE_BLOCK_N))
        return 1 << (n.bit_length() - 1)
    want = max(1, -(-8 * num_sms // max(1, num_tiles * num_kv_heads)))
    cap = MAX_SPLITS if num_tiles * num_kv_heads * 32 < num_sms else 32
    n = max(1, min(want, max_context // 64, cap))
    return 1 << (n.bit_length() - 1)


def launch_shape(num_tiles: int, max_q: int, max_context: int, num_sms: int, num_kv_heads: int,
                 dense: bool = False, fp4_gluon: bool = False, invariant: bool = False) -> tuple[int, int | None]:
    """(key splits, the dense kernel's keys per step or None) of a launch of num_tiles tiles of
    at most max_q query tokens over at most max_context keys: the one rule of the eager plans
    (plan_tiles) and the graph keys (graph_runner), which count a graph's padded tiles. dense:
    the dense kernel, which may take its wide or narrow decode shape (dense_decode_block_n);
    fp4_gluon: decode launches run the Gluon FP4 kernel, whose split count is the wide shape's.
    invariant: a batch-invariant plan's (one split, the kernel's invariant shape)."""
    if invariant:
        return 1, None
    shape = dense_decode_block_n(num_tiles, max_q, max_context, num_kv_heads) if dense else None
    wide = shape == WIDE_BLOCK_N or (fp4_gluon and max_q == 1)
    return default_num_splits(num_tiles, max_context, num_sms, num_kv_heads, wide=wide), shape


def plan_tiles(query_start: list[int], context_lens: list[int], block_tables: list[list[int]], group: int,
               device, num_splits: int | None = None, num_sms: int = 132, num_kv_heads: int = 4,
               dense: bool = False, dense_block_n: int | None = None, fp4_gluon: bool = False,
               invariant: bool = False) -> TilePlan:
    """dense: the plan is for the dense kernel, which may take the wide or the narrow decode shape
    (dense_decode_block_n) when the split count is left to the default; dense_block_n names its
    keys per step outright (warm-up). fp4_gluon: decode steps (one query token) run the Gluon FP4
    kernel (kernels/fp4_gluon.py), whose split count is the wide shape's, about 2 programs an SM:
    H200, 7B, from a CUDA graph, batch 8 at 16k keys 56.5 us in 8 splits
    against 75.8 in the default 32 and 64.7 in 16; batch 32 189.1 in 2 against 209.3 in 8.
    invariant: a batch-invariant plan (INVARIANT_BLOCK_N above): the other choices are not taken."""
    max_q = max(query_start[i + 1] - query_start[i] for i in range(len(context_lens)))
    tokens, block_m = tile_shape(max_q, group, invariant)
    if invariant:  # a tile per query token, made in one pass (a Python loop took 5.9 ms for 8k tokens)
        num_splits, dense_block_n = 1, None
        starts = np.asarray(query_start, dtype=np.int64)
        num_q = np.diff(starts)
        seqs = np.repeat(np.arange(len(context_lens)), num_q)
        toks = np.arange(starts[0], starts[-1])
        nqs = np.ones(len(toks), dtype=np.int64)
        poss = toks - np.repeat(starts[:-1] - np.asarray(context_lens, dtype=np.int64) + num_q, num_q)
    else:
        seqs, toks, nqs, poss = [], [], [], []
        for b, ctx in enumerate(context_lens):
            q0, q1 = query_start[b], query_start[b + 1]
            num_q = q1 - q0
            for j in range(0, num_q, tokens):
                seqs.append(b)
                toks.append(q0 + j)
                nqs.append(min(tokens, num_q - j))
                poss.append(ctx - num_q + j)
    max_ctx = max(context_lens)
    if num_splits is None:
        num_splits, shape = launch_shape(len(seqs), max_q, max_ctx, num_sms, num_kv_heads, dense, fp4_gluon,
                                         invariant)
        if shape:
            dense_block_n = shape
    # the block tables side by side, zero-padded to the longest, filled in one pass (a row at a time
    # took 1.9 of a 176-sequence step's 2.2 ms of planning)
    lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lens.max())
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    table[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32,
                                                           count=int(lens.sum()))

    def i32(xs):
        return torch.from_numpy(np.array(xs, dtype=np.int32)).to(device, non_blocking=True)

    return TilePlan(i32(seqs), i32(toks), i32(nqs), i32(poss), torch.from_numpy(table).to(device, non_blocking=True),
                    tokens, block_m, num_splits, max_ctx, dense_block_n, invariant)
