"""Triton kernels vs their torch references: compiled on a GPU, under TRITON_INTERPRET=1 on CPU
(conftest sets it), so the shapes are small and irregular."""
from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fp4  # noqa: E402
from kernels.fp4 import (FP4PagedLayer, FP4Tensor, bytes_per_token_head, dequantize_lut,  # noqa: E402
                         dequantize_ref, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, quantize_ref)
from kernels.attention_plan import default_num_splits, merge_shape, plan_tiles, tile_shape, warmup_launches  # noqa: E402
from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_tuned  # noqa: E402

# compiled kernels on a GPU, the interpreter on CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_e4m3_rounds_to_the_nearest_representable_value():
    # every non-negative E4M3 (fn) value, enumerated from the format's definition
    grid = torch.tensor([m * 2.0 ** -9 for m in range(8)]
                        + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:-1])
    g = torch.Generator().manual_seed(0)
    mids = (grid[1:] + grid[:-1]) / 2  # every exact tie
    v = torch.cat([torch.rand(20000, generator=g) * 500, torch.rand(5000, generator=g) * 0.02, mids,
                   torch.tensor([0.0, 448.0, 500.0, 1e-6])])
    dist = (v.clamp(max=448)[:, None] - grid[None, :]).abs()
    ties = dist == dist.min(1, keepdim=True).values
    nearest = torch.where(ties, grid[None, :], torch.full_like(dist, -1.0)).max(1).values  # ties round up
    assert (e4m3_decode(e4m3_encode(v)) == nearest).all()
    assert (e4m3_decode(e4m3_encode(grid)) == grid).all()


def test_e2m1_codes_round_trip_all_values():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals[:8].tolist() == list(fp4.E2M1_VALUES)
    assert (e2m1_decode(e2m1_encode(vals)) == vals).all()


def test_half_split_packing_round_trips():
    d = 64
    x = torch.zeros(3, d)
    x[0, 5] = 6.0  # lo half -> low nibble of byte 5
    x[0, 32 + 5] = -3.0  # hi half -> high nibble of byte 5
    x[0, 32 + 6] = 6.0  # same group: its scale is 1, so -3 is code 8|5
    x[1] = torch.linspace(-6, 6, d)
    x[2] = torch.randn(d)
    q = quantize_ref(x, 1.0, num_outliers=0)
    assert q.codes.shape == (3, d // 2)
    assert int(q.codes[0, 5]) & 15 == 7 and int(q.codes[0, 5]) >> 4 == (8 | 5)
    assert torch.allclose(dequantize_ref(q, 1.0)[0], x[0])


@pytest.mark.parametrize("d", [32, 64, 128])
def test_dequantize_error_is_bounded_by_the_group_scale(d):
    torch.manual_seed(d)
    x = torch.randn(50, 3, d) * torch.rand(50, 3, 1) * 4
    x[:, :, 3] += 40.0  # a large fixed channel: taken as an outlier, so exact up to fp16
    q = quantize_ref(x)
    y = dequantize_ref(q)
    scale = (e4m3_decode(q.scales) * fp4.DEFAULT_HEAD_SCALE).repeat_interleave(16, dim=-1)
    err = (y - x).abs()
    is_outlier = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, q.outlier_idx.long(), q.outlier_val != 0)
    # E2M1's half-step is at most 1 scale unit (between 4 and 6); outliers carry fp16 rounding only
    assert (err[~is_outlier] <= scale[~is_outlier] + 1e-6).all()
    assert (err[is_outlier] <= x[is_outlier].abs() * 2 ** -11).all()
    assert torch.allclose(y[:, :, 3], x[:, :, 3].half().float())
    assert (q.outlier_idx == 3).any(-1).all()


def test_outliers_reduce_error_on_keys_with_large_channels():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, [11, 77]] *= 25.0
    err = {}
    for s in (0, 2):
        y = dequantize_ref(quantize_ref(x, num_outliers=s))
        err[s] = ((y - x).norm() / x.norm()).item()
    assert err[2] < 0.5 * err[0]


def test_bytes_per_token_formula_and_allocation():
    assert bytes_per_token_head(128) == 78 and 78 / 256 <= 0.31
    layer = FP4PagedLayer(5, 16, 4, 128, "cpu")
    assert layer.bytes_per_token == 4 * (78 + 72)  # K with 2 slots, V without; no padding at block_size 16
    assert layer.pages.numel() == 5 * 16 * layer.bytes_per_token


@pytest.mark.parametrize("heads,d,slots", [(3, 64, 2), (1, 32, 1), (2, 128, 4)])
@pytest.mark.slow
def test_store_kernel_matches_reference(heads, d, slots):
    torch.manual_seed(heads + d)
    n, bs, nb = 7, 4, 5
    layer_t = FP4PagedLayer(nb, bs, heads, d, DEV, num_outliers=slots)
    layer_r = FP4PagedLayer(nb, bs, heads, d, DEV, num_outliers=slots)
    k = torch.randn(n, heads, d, device=DEV) * 3
    v = torch.randn(n, heads, d, device=DEV)
    k[:, :, 1] += 50.0
    slots_map = torch.tensor([3, 9, 0, 15, 6, 19, 12], device=DEV)
    layer_t.store(k, v, slots_map, use_triton=True)
    layer_r.store(k, v, slots_map, use_triton=False)
    assert (layer_t.pages != layer_r.pages).float().mean() < 1e-3  # bit-exact but for rounding ties
    kt, vt = layer_t.gather(list(range(nb)))
    kr, vr = layer_r.gather(list(range(nb)))
    assert torch.allclose(kt, kr, atol=0.2) and torch.allclose(vt, vr, atol=0.1)


def make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, d, generator=g, dtype=torch.float32).to(dtype).to(DEV)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for ctx in ctx_lens:
        n = -(-ctx // bs)
        tables.append(perm[used: used + n])
        used += n
    assert used <= nb
    qs = [0]
    for n in q_lens:
        qs.append(qs[-1] + n)
    return q, qs, tables


CASES = [  # (query tokens per sequence, context lengths): decode, verify windows, prefill chunks
    ([1, 1, 1], [5, 37, 16]),
    ([5, 3], [21, 9]),
    ([13, 1, 4], [13, 40, 30]),
]


@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_dense_matches_reference(q_lens, ctx_lens, splits):
    heads, kv_heads, d, bs, nb = 6, 2, 32, 4, 40
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb)
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=splits)
    out, ref = dense_and_reference(q, qs, ctx_lens, tables, plan, kv_heads, bs, nb, block_n=16)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def dense_and_reference(q, qs, ctx_lens, tables, plan, kv_heads, bs, nb, **kw):
    """The dense kernel's output on random caches, and the torch reference's."""
    d = q.shape[-1]
    k_cache = torch.randn(nb, bs, kv_heads, d, device=DEV)
    v_cache = torch.randn(nb, bs, kv_heads, d, device=DEV)
    out = paged_attention_tuned(q, plan, d ** -0.5, k_cache=k_cache, v_cache=v_cache, **kw)

    def gather(blocks):
        idx = torch.tensor(blocks, device=DEV)
        return k_cache[idx].reshape(-1, kv_heads, d), v_cache[idx].reshape(-1, kv_heads, d)

    return out, paged_attention_ref(q, gather, qs, ctx_lens, tables, bs, d ** -0.5)


@pytest.mark.slow
def test_dense_wide_decode_matches_reference():
    """The dense kernel's wide decode shape (128 keys a step, about 2 programs an SM), as the
    engine's plan picks it for a few sequences over long contexts, against the reference; some of
    its 32 splits end part way through a step, one past the shorter sequence's keys."""
    heads, kv_heads, d, bs = 4, 2, 32, 16
    q_lens, ctx_lens = [1, 1], [4100, 4500]
    nb = sum(-(-c // bs) for c in ctx_lens)
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb)
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_kv_heads=kv_heads, dense=True)
    assert plan.dense_block_n == 128 and plan.num_splits == 32
    out, ref = dense_and_reference(q, qs, ctx_lens, tables, plan, kv_heads, bs, nb)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def test_a_plans_block_table_is_each_sequences_table_zero_padded():
    plan = plan_tiles([0, 1, 4, 5], [9, 30, 2], [[7, 3, 5], [1, 2, 4, 6, 8, 9, 10, 11], [12]], 2, "cpu")
    assert plan.block_table.dtype == torch.int32
    assert plan.block_table.tolist() == [[7, 3, 5, 0, 0, 0, 0, 0], [1, 2, 4, 6, 8, 9, 10, 11], [12, 0, 0, 0, 0, 0, 0, 0]]
    assert plan.tile_seq.tolist() == [0, 1, 2] and plan.tile_tok.tolist() == [0, 1, 4]
    assert plan.tile_nq.tolist() == [1, 3, 1] and plan.tile_pos.tolist() == [8, 27, 1]


def test_wide_decode_rule():
    from kernels.attention_plan import dense_wide_decode
    # up to 32 (tile, KV head) pairs of one query token over at least 1k keys: 7B batch 1-8, 2B 1-16
    assert dense_wide_decode(4, 1, 16384, 4) and dense_wide_decode(8, 1, 4096, 2)
    assert dense_wide_decode(8, 1, 16384, 4) and dense_wide_decode(16, 1, 1024, 2)  # 32 pairs
    assert not dense_wide_decode(16, 1, 2048, 4)  # 64 pairs (7B batch 16): much slower with PDL at 16k
    assert not dense_wide_decode(1, 1, 1023, 4)  # under 1k keys: not measured, the default
    assert not dense_wide_decode(1, 2, 16384, 4)  # verify windows and prefill: the default
    # its splits: about 2 programs an SM (264 on 132 SMs), a power of two, at most 64, >= 128 keys each
    assert default_num_splits(1, 16384, 132, 4, wide=True) == 64
    assert default_num_splits(2, 16384, 132, 4, wide=True) == 32
    assert default_num_splits(4, 16384, 132, 4, wide=True) == 16
    assert default_num_splits(8, 16384, 132, 2, wide=True) == 16
    assert default_num_splits(1, 4096, 132, 4, wide=True) == 32
    assert default_num_splits(8, 16384, 132, 4, wide=True) == 8  # 32 pairs: 264 // 32
    assert default_num_splits(1, 1024, 132, 4, wide=True) == 8  # 1k keys: 8 steps of 128
    # the plan: only for the dense kernel (FP4 plans keep the default), only where the rule holds
    q1 = [0, 1, 2]
    wide = plan_tiles(q1, [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4, dense=True)
    assert wide.dense_block_n == 128 and wide.num_splits == 32
    fp4_plan = plan_tiles(q1, [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4)
    assert fp4_plan.dense_block_n is None and fp4_plan.num_splits == default_num_splits(2, 16384, 132, 4)
    # the Gluon FP4 decode: the wide shape's split count (about 2 programs an SM), no dense keys per step
    gluon = plan_tiles(q1, [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4, fp4_gluon=True)
    assert gluon.dense_block_n is None and gluon.num_splits == default_num_splits(2, 16384, 132, 4, wide=True) == 32
    window = plan_tiles([0, 3, 6], [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4, fp4_gluon=True)
    assert window.num_splits == plan_tiles([0, 3, 6], [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4).num_splits
    short = plan_tiles(q1, [1000, 900], [[0], [0]], 7, "cpu", num_kv_heads=4, dense=True)
    assert short.dense_block_n is None
    many = plan_tiles(list(range(17)), [2048] * 16, [[0]] * 16, 7, "cpu", num_kv_heads=4, dense=True)
    assert many.dense_block_n is None  # 64 pairs
    # a split count given outright (tests, warm-up) is kept, with the keys per step given with it
    forced = plan_tiles(q1, [16384, 9000], [[0], [0]], 7, "cpu", num_kv_heads=4, dense=True, num_splits=2)
    assert forced.num_splits == 2 and forced.dense_block_n is None


@pytest.mark.slow
def test_dense_narrow_decode_matches_reference():
    """The dense kernel's narrow decode shape (two KV heads, 9-16 (sequence, KV head) pairs: 64 keys
    a step in 32 splits; the plan's rule: test_narrow_decode_rule) against the reference, over
    shorter contexts than the rule's 4k keys (Triton's interpreter is slow): sequences of
    different lengths, splits ending part way through a step, and empty splits past a sequence's
    keys."""
    heads, kv_heads, d, bs = 4, 2, 32, 16
    q_lens, ctx_lens = [1] * 2, [333, 64 * 32 + 5]
    nb = sum(-(-c // bs) for c in ctx_lens)
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb)
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_kv_heads=kv_heads, num_splits=32,
                      dense_block_n=64)
    assert plan.dense_block_n == 64 and plan.num_splits == 32
    out, ref = dense_and_reference(q, qs, ctx_lens, tables, plan, kv_heads, bs, nb)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def test_narrow_decode_rule():
    from kernels.attention_plan import dense_decode_block_n, dense_narrow_decode, warmup_launches
    # two KV heads, 9-16 pairs (2B batch 5-8), one query token, >= 4k keys
    assert dense_narrow_decode(8, 1, 16384, 2) and dense_narrow_decode(5, 1, 4096, 2)
    assert not dense_narrow_decode(4, 1, 16384, 2)  # 8 pairs: wide
    assert not dense_narrow_decode(9, 1, 16384, 2)  # 18 pairs: wide
    assert not dense_narrow_decode(4, 1, 16384, 4)  # 16 pairs at 4 KV heads (7B batch 4): wide was faster
    assert not dense_narrow_decode(8, 1, 4095, 2) and not dense_narrow_decode(8, 2, 16384, 2)
    assert dense_decode_block_n(8, 1, 16384, 2) == 64 and dense_decode_block_n(8, 1, 2048, 2) == 128
    assert dense_decode_block_n(4, 1, 16384, 4) == 128 and dense_decode_block_n(16, 1, 16384, 4) is None
    # its split count: the default's, 32 for 9-16 pairs from 4k keys
    for tiles, ctx in ((5, 4096), (8, 16384), (8, 32768), (7, 9000)):
        assert default_num_splits(tiles, ctx, 132, 2) == 32
    # only the dense kernel's plans take it
    q8 = list(range(9))
    assert plan_tiles(q8, [16384] * 8, [[0]] * 8, 6, "cpu", num_kv_heads=2, dense=True).dense_block_n == 64
    assert plan_tiles(q8, [16384] * 8, [[0]] * 8, 6, "cpu", num_kv_heads=2).dense_block_n is None
    # warm-up compiles its (split) variant at two KV heads only
    assert {(1, 1, 64), (1, 2, 64)} <= set(warmup_launches(6, dense=True, num_kv_heads=2))
    assert not any(x[2] == 64 for x in warmup_launches(7, dense=True, num_kv_heads=4))
    assert not any(x[2] == 64 for x in warmup_launches(6, dense=False, num_kv_heads=2))


def test_wide_decode_only_for_two_byte_dense_caches():
    """The backends that ask for the wide shape: the dense kernel over bf16/fp16 K/V with bf16/fp16
    compute at head_dim <= 128 (float32 tiles, or head_dim 256, of 128 keys in two stages would not
    fit in shared memory), never FP4."""
    from docproc.layers.attention import DenseAttention, FP4Attention

    def dense(dtype, compute, head_dim=128):
        return DenseAttention(28, 4, head_dim, 0.1, torch.device("cpu"), dtype, compute).wide_decode

    assert dense(torch.bfloat16, torch.bfloat16) and dense(torch.float16, torch.float16)
    assert not dense(torch.float32, torch.float32) and not dense(torch.bfloat16, torch.float32)
    assert dense(torch.bfloat16, torch.bfloat16, 64) and not dense(torch.bfloat16, torch.bfloat16, 256)
    assert FP4Attention.wide_decode is False


def fp4_layer_with_outliers(nb, bs, kv_heads, d, seed=0, head_scale=fp4.DEFAULT_HEAD_SCALE):
    """An FP4 pool whose keys carry a large fixed channel (in the low half), so their outlier slots
    are used (and many stay unused), and whose values carry large ones too (they have no slots:
    the group scales take them)."""
    g = torch.Generator().manual_seed(seed)
    layer = FP4PagedLayer(nb, bs, kv_heads, d, DEV, head_scale=head_scale)
    k = torch.randn(nb * bs, kv_heads, d, generator=g) * 2
    k[:, :, 9] += 30.0
    v = torch.randn(nb * bs, kv_heads, d, generator=g)
    v[::3, :, d // 2 + 5] -= 25.0
    v[7::11, :, 0] += 40.0  # channel 0: an unused slot (0, 0.0) must not be mistaken for it
    layer.store(k.to(DEV), v.to(DEV), torch.arange(nb * bs, device=DEV), use_triton=False)
    return layer


@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
def test_paged_attention_fp4_matches_reference(q_lens, ctx_lens):
    heads, kv_heads, d, bs, nb = 4, 2, 64, 4, 40
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, seed=1)
    layer = fp4_layer_with_outliers(nb, bs, kv_heads, d)
    assert (layer.k["oval"] != 0).any() and (layer.k["oval"] == 0).any() and layer.v["oval"].shape[-1] == 0
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=2)
    out = paged_attention_tuned(q, plan, d ** -0.5, fp4_k=layer.kernel_views("k"), fp4_v=layer.kernel_views("v"),
                          block_n=16)
    ref = paged_attention_ref(q, layer.gather, qs, ctx_lens, tables, bs, d ** -0.5)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_paged_attention_fp4_head_dim_128_non_power_of_two_head_scale():
    """The real models' head_dim (128: four 16-dim groups per half), a head scale that is not a
    power of two, one split; bf16 queries on a GPU (the interpreter's bf16 dot is not usable on
    CPU), float32 under the interpreter."""
    heads, kv_heads, d, bs, nb = 6, 2, 128, 4, 24
    q_lens, ctx_lens = [1, 3], [29, 18]
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, dtype=dtype, seed=2)
    layer = fp4_layer_with_outliers(nb, bs, kv_heads, d, seed=4, head_scale=0.07)
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=1)
    out = paged_attention_tuned(q, plan, d ** -0.5, fp4_k=layer.kernel_views("k"), fp4_v=layer.kernel_views("v"),
                          block_n=16)
    ref = paged_attention_ref(q.float(), layer.gather, qs, ctx_lens, tables, bs, d ** -0.5)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.gpu  # compiled kernel at the 7B geometry: GPU only
@pytest.mark.parametrize("block_n,num_warps", [(64, 4), (128, 4), (128, 8), (256, 4)])
def test_paged_attention_fp4_7b_geometry_on_gpu(block_n, num_warps):
    heads, kv_heads, d, bs = 28, 4, 128, 16
    q_lens, ctx_lens = [1] * 5 + [5, 16], [4096, 1, 77, 1000, 2049, 300, 1500]
    nb = sum(-(-c // bs) for c in ctx_lens) + 3
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, dtype=torch.bfloat16, seed=5)
    layer = fp4_layer_with_outliers(nb, bs, kv_heads, d, seed=6)
    ref = paged_attention_ref(q.float(), layer.gather, qs, ctx_lens, tables, bs, d ** -0.5)
    for splits in (1, 8):
        plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=splits)
        out = paged_attention_tuned(q, plan, d ** -0.5, fp4_k=layer.kernel_views("k"), fp4_v=layer.kernel_views("v"),
                              block_n=block_n, num_warps=num_warps, fp4_gluon=False)
        err = ((out.float() - ref).abs().amax(-1) / ref.abs().amax(-1)).max()
        assert err < 2e-2, (splits, err)


@pytest.mark.gpu  # inline PTX: GPU only
def test_fp4_ptx_decode_equals_the_float32_decode_bit_for_bit():
    """Every code byte (both nibbles) under every finite E4M3 scale byte, decoded by the PTX bf16x2
    path and by the float32 path: the same values (the PTX path is exact, subnormals included)."""
    import triton
    import triton.language as tl

    from kernels.paged_attention import _fp4_tile

    @triton.jit
    def decode(codes_ptr, scales_ptr, out_ptr, PTX: tl.constexpr, BLOCK_N: tl.constexpr):
        n = tl.arange(0, BLOCK_N)
        lo, hi = _fp4_tile(codes_ptr, scales_ptr, n * 64, n * 8, n < BLOCK_N, 4, BLOCK_N, PTX)
        d = tl.arange(0, 64)
        tl.store(out_ptr + n[:, None] * 128 + d[None, :], lo.to(tl.float32))
        tl.store(out_ptr + n[:, None] * 128 + 64 + d[None, :], hi.to(tl.float32))

    n = 256
    codes = torch.arange(n * 64, device="cuda").remainder(256).to(torch.uint8).view(n, 64)
    codes = codes[:, torch.randperm(64, device="cuda")].contiguous()
    scales = torch.arange(n * 8, device="cuda").remainder(127).to(torch.uint8).view(n, 8)  # 0x7f is NaN
    out = {}
    for ptx in (0, 1, 2, 3):  # float32, PTX from bytes, PTX from 32-bit words (two layouts)
        out[ptx] = torch.full((n, 128), float("nan"), device="cuda")
        decode[(1,)](codes, scales, out[ptx], PTX=ptx, BLOCK_N=n)
    assert torch.isfinite(out[0]).all()
    assert all(torch.equal(out[p], out[0]) for p in (1, 2, 3))
    # and they are the format's values: code x scale x 2^-8 (head scale left out)
    ref = torch.stack([fp4.e2m1_decode(codes & 0xF), fp4.e2m1_decode(codes >> 4)], 1).view(n, 2, 4, 16)
    ref = (ref * fp4.e4m3_decode(scales).view(n, 2, 4, 1)).reshape(n, 128) / 256
    assert torch.equal(out[1], ref.float())


@pytest.mark.gpu  # inline PTX: GPU only
def test_fp4_attention_with_ptx_decode_equals_the_float32_decode():
    """Both PTX decodes (from bytes, and from 32-bit words in either layout: "word_rows" the default
    for tiles of up to 16 rows) give the float32 decode's output; tiles of more rows (a 5-token
    window) take the bytes decode by default."""
    heads, kv_heads, d, bs = 28, 4, 128, 16
    for q_lens, ctx_lens, variants in (
            ([1] * 4, [4096, 77, 1000, 300], (True, "words", "word_rows", None)),
            ([1] * 3 + [5], [4096, 77, 1000, 300], (True, None))):
        nb = sum(-(-c // bs) for c in ctx_lens) + 3
        q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, dtype=torch.bfloat16, seed=7)
        layer = fp4_layer_with_outliers(nb, bs, kv_heads, d, seed=8)
        plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=4)
        errs = {}
        views = {"fp4_k": layer.kernel_views("k"), "fp4_v": layer.kernel_views("v")}
        ref = paged_attention_tuned(q, plan, d ** -0.5, **views, fp4_ptx_decode=False).float()
        for ptx in variants:
            out = paged_attention_tuned(q, plan, d ** -0.5, **views, fp4_ptx_decode=ptx, fp4_gluon=False).float()
            errs[ptx] = float(((out - ref).abs().amax(-1) / ref.abs().amax(-1)).max())
        print(q_lens, errs)
        # the decoded values are bit-identical (test above); the products may pair them with the
        # tensor cores' operands in another order (another MMA shape), so the sums can differ in
        # their last bit: at most one bf16 rounding of the output row's scale
        assert all(e <= 2.0 ** -7 for e in errs.values()), errs


def _zero_width(views):
    c, sc, oi, ov, hs = views
    return c, sc, oi[..., :0], ov[..., :0], hs


@pytest.mark.gpu  # Gluon: GPU only (no interpreter)
@pytest.mark.parametrize("heads,kv_heads,dtype,key_slots,bs", [
    (28, 4, torch.bfloat16, True, 16), (28, 4, torch.bfloat16, False, 16), (12, 2, torch.bfloat16, True, 16),
    (8, 1, torch.float16, True, 16), (28, 4, torch.bfloat16, True, 32), (12, 2, torch.bfloat16, True, 128)])
def test_fp4_gluon_decode_matches_the_reference(heads, kv_heads, dtype, key_slots, bs, monkeypatch):
    """kernels/fp4_gluon.py (decode tiles, no value slots) against the float32 reference over the
    same pool, with the value slots (and without key_slots the key slots) emptied; and against the
    Triton kernel over the same views: the same decoded values, summed in another order. Contexts
    of 1 key, partial 128-key steps and steps whose warps have no keys; 1-32 splits (3: a split
    count that is not a power of two; 32: empty splits); the engine's default picks it. Blocks of 16
    keys (two per warp and step) and of 32 and 128 (one)."""
    d = 128
    ctx_lens = [4096, 1, 77, 1000, 2049, 300, 1500, 128, 129, 33]
    q_lens = [1] * len(ctx_lens)
    nb = sum(-(-c // bs) for c in ctx_lens) + 3
    q, qs, tables = make_batch(q_lens, ctx_lens, heads, kv_heads, d, bs, nb, dtype=dtype, seed=9)
    layer = fp4_layer_with_outliers(nb, bs, kv_heads, d, seed=10, head_scale=0.07)
    assert (layer.k["oval"] != 0).any()
    fk = layer.kernel_views("k") if key_slots else _zero_width(layer.kernel_views("k"))
    fv = _zero_width(layer.kernel_views("v"))
    plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=4)
    assert paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv).equal(
        paged_attention_tuned(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=True))  # the default
    layer.v["oval"].zero_()
    if not key_slots:
        layer.k["oval"].zero_()
    ref = paged_attention_ref(q.float(), layer.gather, qs, ctx_lens, tables, bs, d ** -0.5)
    for splits in (1, 3, 8, 32):
        plan = plan_tiles(qs, ctx_lens, tables, heads // kv_heads, DEV, num_splits=splits)
        out = paged_attention_tuned(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=True).float()
        tri = paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=False).float()
        err = ((out - ref).abs().amax(-1) / ref.abs().amax(-1)).max()
        err_tri = ((out - tri).abs().amax(-1) / tri.abs().amax(-1)).max()
        assert err < 2e-2 and err_tri <= 2.0 ** -7, (splits, err, err_tri)


@pytest.mark.gpu  # Gluon: GPU only
def test_fp4_gluon_is_only_taken_where_it_can_run(monkeypatch):
    """Verify windows or a named Triton variant keep the Triton kernel; fp4_gluon=True where it
    cannot run is an error; fp4_gluon=False (an engine whose KernelOptions.fp4_gluon is off) keeps
    the Triton kernel."""
    from kernels import fp4_gluon

    heads, kv_heads, d, bs = 28, 4, 128, 16
    q, qs, tables = make_batch([1, 1], [300, 40], heads, kv_heads, d, bs, 24, dtype=torch.bfloat16, seed=11)
    layer = fp4_layer_with_outliers(24, bs, kv_heads, d, seed=12)
    plan = plan_tiles(qs, [300, 40], tables, heads // kv_heads, DEV, num_splits=2)
    fk, fv = layer.kernel_views("k"), layer.kernel_views("v")
    assert fp4_gluon.supported(q, plan, fk, fv) is None
    q2, qs2, tables2 = make_batch([3], [300], heads, kv_heads, d, bs, 24, dtype=torch.bfloat16, seed=13)
    plan2 = plan_tiles(qs2, [300], tables2, heads // kv_heads, DEV, num_splits=2)
    assert "decode tiles only" in fp4_gluon.supported(q2, plan2, fk, fv)
    with pytest.raises(AssertionError, match="cannot run"):
        paged_attention_tuned(q2, plan2, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=True)
    calls = []
    real = fp4_gluon.launch
    monkeypatch.setattr(fp4_gluon, "launch", lambda *a, **k: (calls.append(1), real(*a, **k)))
    paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv)
    paged_attention_tuned(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_ptx_decode="words")
    paged_attention(q2, plan2, d ** -0.5, fp4_k=fk, fp4_v=fv)
    paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=False)
    assert calls == [1]


def test_the_engines_attention_entry_has_no_tuning_knobs():
    """paged_attention (what the engine calls) takes caches, plan and the engine's choices only;
    the launch's tuning is paged_attention_tuned's, whose defaults it runs: the same output."""
    import inspect

    assert set(inspect.signature(paged_attention).parameters) == {
        "q", "plan", "scale", "k_cache", "v_cache", "fp4_k", "fp4_v", "fp4_gluon", "pdl_on"}
    heads, kv_heads, d, bs, nb = 4, 2, 32, 4, 12
    q, qs, tables = make_batch([1, 3], [9, 6], heads, kv_heads, d, bs, nb, seed=21)
    k = torch.randn(nb, bs, kv_heads, d).to(DEV)
    v = torch.randn(nb, bs, kv_heads, d).to(DEV)
    plan = plan_tiles(qs, [9, 6], tables, heads // kv_heads, DEV, num_splits=2)
    assert paged_attention(q, plan, d ** -0.5, k_cache=k, v_cache=v).equal(
        paged_attention_tuned(q, plan, d ** -0.5, k_cache=k, v_cache=v))


def test_fp4_gluon_dispatch_and_its_register_cap(monkeypatch):
    """The dispatch, with the kernel's launch stubbed (so it runs on CPU): the default takes it where
    supported() allows; a named Triton variant does not; fp4_gluon=True with maxnreg passes the
    caller's cap, and without one passes none (not the Triton kernel's default cap of 128)."""
    from kernels import fp4_gluon

    heads, kv_heads, d, bs = 4, 2, 64, 4
    q, qs, tables = make_batch([1, 1], [9, 5], heads, kv_heads, d, bs, 8, seed=14)
    layer = FP4PagedLayer(8, bs, kv_heads, d, DEV)
    plan = plan_tiles(qs, [9, 5], tables, heads // kv_heads, DEV, num_splits=1)  # no merge of stubbed partials
    caps = []
    monkeypatch.setattr(fp4_gluon, "supported", lambda *a: None)
    monkeypatch.setattr(fp4_gluon, "launch", lambda *a, maxnreg=None: caps.append(maxnreg))
    monkeypatch.setattr(pa_module(), "default_fp4_maxnreg", lambda *a: 128)
    fk, fv = layer.kernel_views("k"), layer.kernel_views("v")
    paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv)
    paged_attention_tuned(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=True, maxnreg=168)
    assert caps == [None, 168]
    paged_attention_tuned(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, maxnreg=168)  # a Triton variant: not Gluon
    paged_attention(q, plan, d ** -0.5, fp4_k=fk, fp4_v=fv, fp4_gluon=False)
    assert caps == [None, 168]


def test_fp4_gluon_engine_rule_is_the_calls_rule(monkeypatch):
    """engine_can_use (what an engine plans for) and supported (what a call may run) share one rule:
    CUDA sm_80+, bf16/fp16, head_dim 128, GQA <= 8, 0 or 2 key slots; the engine's
    fp4_gluon option (KernelOptions, handed to its FP4 backend) turns its choice off. Checked on CPU
    with the device stubbed."""
    from types import SimpleNamespace

    from docproc.layers.attention import FP4Attention
    from kernels.options import KernelOptions
    from kernels import fp4_gluon

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(fp4_gluon, "interpreting", lambda: False)  # the suite's interpreter would say no first
    ok = dict(group=7, head_dim=128, key_slots=2, compute_dtype=torch.bfloat16, device="cuda")
    assert fp4_gluon.engine_can_use(**ok)
    for change, why in ((dict(group=16), "GQA group <= 8"),
                        (dict(head_dim=64), "head_dim"), (dict(key_slots=4), "key outlier"),
                        (dict(compute_dtype=torch.float32), "bf16 or fp16"), (dict(device="cpu"), "CUDA")):
        args = {**ok, **change}
        assert not fp4_gluon.engine_can_use(**args)
        assert why in fp4_gluon._why_not(args["device"], args["compute_dtype"], args["head_dim"], args["group"],
                                         args["key_slots"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "sm_80" in fp4_gluon._why_not("cuda", torch.bfloat16, 128, 7, 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132))
    backend = (28, 4, 128, 128 ** -0.5, torch.device("cuda"))
    assert FP4Attention(*backend, compute_dtype=torch.bfloat16).fp4_gluon
    off = FP4Attention(*backend, compute_dtype=torch.bfloat16, kernels=KernelOptions(fp4_gluon=False))
    assert not off.fp4_gluon and off.kernels.pdl


def pa_module():
    import kernels.paged_attention as pa

    return pa


@pytest.mark.slow
def test_fp4_gluon_kernel_keeps_its_operands_in_registers():
    """The Gluon kernel compiled for sm_90 (no GPU needed; a subprocess, because the interpreter
    that conftest turns on cannot compile Gluon): its key loop has no shared-memory operation
    (every layout conversion is within a thread), loads each key's 16 code bytes and each value's 8
    in one instruction, and runs 48 tensor-core MMAs per 128 keys (per warp 32 for the scores, 16
    for the transposed output)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gluon_fp4_probe.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    reports = {}
    for slots in (2, 0):
        proc = subprocess.run([sys.executable, str(script), "--kernel", "--json", "--key-slots", str(slots)],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rep = reports[slots] = json.loads(proc.stdout.strip().splitlines()[-1])
        mix = rep["mix"]
        assert rep["loop_shared"] == 0, rep
        assert mix.get("HMMA.16816.F32.BF16") == 48 and mix.get("LDG.E.128") == 4 and mix.get("LDG.E.64") == 8, mix
        assert rep["loop_instructions"] < (1250 if slots else 1000) and rep["loop_spills"] == 0, rep
    assert reports[2]["loop_instructions"] > reports[0]["loop_instructions"]  # the key slots' gather


def test_fp4_decode_defaults():
    from kernels.paged_attention import default_fp4_decode
    # no PTX (CPU, float32 q): the float32 decode whatever the tile
    assert default_fp4_decode(False, True) is False and default_fp4_decode(False, False) is False
    # decode tiles: the word decode in its row layout (faster there on the H200)
    assert default_fp4_decode(True, True) == "word_rows"
    # tiles of more than 16 rows: the byte decode
    assert default_fp4_decode(True, False) is True


def test_fp4_register_cap_defaults(monkeypatch):
    from kernels import paged_attention as pa
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # decode tiles in the tuned shape on CUDA: 128 registers a thread (4 programs an SM, not 3)
    assert pa.default_fp4_maxnreg(True, 128, 4, 2, "cuda") == 128
    # any other shape (tiles of more rows, other steps, warps or stages), the CPU or the
    # interpreter: the compiler's choice
    assert pa.default_fp4_maxnreg(False, 128, 4, 2, "cuda") is None
    assert pa.default_fp4_maxnreg(True, 64, 4, 2, "cuda") is None
    assert pa.default_fp4_maxnreg(True, 128, 8, 2, "cuda") is None
    assert pa.default_fp4_maxnreg(True, 128, 4, 3, "cuda") is None
    assert pa.default_fp4_maxnreg(True, 128, 4, 2, "cpu") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pa.default_fp4_maxnreg(True, 128, 4, 2, "cuda") is None


def test_split_counts_fill_the_chip_only_where_it_is_underfilled():
    # 7B (4 KV heads) on 132 SMs, batch 1: 1k and 4k keys get the split counts measured best on the
    # H200 (32k follows the same rule, not measured)
    assert default_num_splits(1, 1024, 132, 4) == 16
    assert default_num_splits(1, 4096, 132, 4) == 64
    assert default_num_splits(1, 32768, 132, 4) == 64
    # at least 64 keys per split, never fewer than one split
    assert default_num_splits(1, 200, 132, 4) == 2 and default_num_splits(1, 10, 132, 4) == 1
    # where 32 splits already give every SM a program the cap stays 32: the memory-bound rows keep
    # the split counts they were measured with
    assert default_num_splits(8, 16384, 132, 4) == 32 and default_num_splits(8, 32768, 132, 2) == 32
    assert default_num_splits(32, 16384, 132, 4) == 8 and default_num_splits(128, 32768, 132, 4) == 2


@pytest.mark.slow
def test_warmup_launches_cover_every_plan_the_engine_can_make():
    """Every (tile shape, split count) that a step can ask for -- decode, verify windows, prefill
    chunks, any batch and context -- is among the launches the engine compiles at start: for the
    dense kernel (its wide and narrow decode shapes) and the FP4 ones."""
    import random

    rng = random.Random(0)
    seen = set()
    for group in (1, 2, 6, 7, 8):
        for dense in (True, False):
            # a kernel variant is (tile shape, split or not, the dense kernel's keys per step) and
            # the merge kernel's shape: the split count itself is a run-time argument (the attention
            # kernel's keys per step do not reach the merge kernel)
            def variant(shape, splits, dense_block_n):
                return (shape, splits > 1, dense_block_n), (shape, splits > 1 and merge_shape(splits, shape[1], 128))

            warm = {}
            for kv_heads in (1, 2, 4):
                launches = [variant(tile_shape(q_len, group), splits, dbn)
                            for q_len, splits, dbn in warmup_launches(group, dense=dense, num_kv_heads=kv_heads)]
                warm[kv_heads] = {a for a, _ in launches}, {m for _, m in launches}
            for _ in range(300):
                n = rng.choice([1, 2, 3, 4, 8, 32, 130])
                q_max = rng.choice([1, 1, 2, 3, 5, 9, 17, 64, 2048])
                q_lens = [rng.randint(1, q_max) for _ in range(n)]
                ctx = [q + rng.choice([0, 5, 900, 4000, 40000]) for q in q_lens]
                starts = [0]
                for q in q_lens:
                    starts.append(starts[-1] + q)
                kv_heads = rng.choice([1, 2, 4])
                plan = plan_tiles(starts, ctx, [[0]] * n, group, "cpu", num_sms=rng.choice([1, 78, 132]),
                                  num_kv_heads=kv_heads, dense=dense)
                attn, merge = variant((plan.tokens_per_tile, plan.block_m), plan.num_splits, plan.dense_block_n)
                assert attn in warm[kv_heads][0] and merge in warm[kv_heads][1], (group, kv_heads, q_lens, ctx)
                seen.add(plan.dense_block_n)
    assert seen == {None, 64, 128}, seen


@pytest.mark.slow
def test_block_table_width_and_split_count_do_not_make_new_kernel_variants():
    """The block table's row stride (the step's longest table) and the split count must not be
    specialized on, or a step at a value of 1, a multiple of 16 or neither would compile anew after
    warm-up (which launches one split count above 1 per tile shape)."""
    import subprocess
    import sys

    code = ("import kernels.paged_attention as pa\n"
            "from triton.runtime.jit import native_specialize_impl\n"
            "from triton.backends.compiler import BaseBackend\n"
            "for k, name in ((pa._paged_attn_kernel, 's_table'), (pa._paged_attn_fp4_kernel, 's_table'),\n"
            "                (pa._paged_attn_kernel, 'num_splits'), (pa._paged_attn_fp4_kernel, 'num_splits'),\n"
            "                (pa._combine_kernel, 'num_splits')):\n"
            "    p = [x for x in k.params if x.name == name][0]\n"
            "    keys = {native_specialize_impl(BaseBackend, w, False, not p.do_not_specialize, True) for w in (1, 16, 81)}\n"
            "    print(len(keys))\n")
    env = {**__import__("os").environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1"] * 5, out.stdout + out.stderr


@pytest.mark.parametrize("splits", [5, 13, 64])
@pytest.mark.slow
def test_paged_attention_with_many_splits_matches_reference(splits):
    """The batch-1 split count the default now picks for long contexts: 64 splits of a 1,000-key
    context, some of them empty, merged; and counts that are not a multiple of the merge kernel's
    unrolled chunk of 8 (the count is a run-time argument)."""
    heads, kv_heads, d, bs, nb = 8, 2, 32, 16, 80
    q, qs, tables = make_batch([1], [1000], heads, kv_heads, d, bs, nb, seed=7)
    k_cache = torch.randn(nb, bs, kv_heads, d, device=DEV)
    v_cache = torch.randn(nb, bs, kv_heads, d, device=DEV)
    plan = plan_tiles(qs, [1000], tables, heads // kv_heads, DEV, num_splits=splits)
    out = paged_attention_tuned(q, plan, d ** -0.5, k_cache=k_cache, v_cache=v_cache, block_n=16)

    def gather(blocks):
        idx = torch.tensor(blocks, device=DEV)
        return k_cache[idx].reshape(-1, kv_heads, d), v_cache[idx].reshape(-1, kv_heads, d)

    ref = paged_attention_ref(q, gather, qs, [1000], tables, bs, d ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


def test_paged_reference_agrees_with_contiguous_attention():
    torch.manual_seed(3)
    heads, kv_heads, d, bs = 4, 2, 32, 4
    ctx = 23
    k = torch.randn(ctx, kv_heads, d)
    v = torch.randn(ctx, kv_heads, d)
    q = torch.randn(ctx, heads, d)
    nb = 8
    table = [5, 2, 7, 0, 3, 1]
    k_cache = torch.zeros(nb, bs, kv_heads, d)
    v_cache = torch.zeros(nb, bs, kv_heads, d)
    for i in range(ctx):
        k_cache[table[i // bs], i % bs] = k[i]
        v_cache[table[i // bs], i % bs] = v[i]

    def gather(blocks):
        idx = torch.tensor(blocks)
        return k_cache[idx].reshape(-1, kv_heads, d), v_cache[idx].reshape(-1, kv_heads, d)

    paged = paged_attention_ref(q, gather, [0, ctx], [ctx], [table], bs, d ** -0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    assert torch.allclose(paged, dense, atol=1e-5)
    # a chunk after a cached prefix, short (masked) and long (padded to a causal square), and decode
    for num_q in (1, 5, 11, 12, 20):
        chunk = paged_attention_ref(q[ctx - num_q:], gather, [0, num_q], [ctx], [table], bs, d ** -0.5)
        assert torch.allclose(chunk, dense[ctx - num_q:], atol=1e-5), num_q


def test_table_dequantize_is_bit_identical_to_the_reference():
    """The CPU decode path dequantizes by table lookup; every code, scale byte and outlier slot
    must give exactly the reference's floats."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 3, 128, generator=g) * 5
    x[:, :, 7] += 40.0
    for hs in (fp4.DEFAULT_HEAD_SCALE, 0.07, torch.tensor([0.5, 0.01, 3.0]).expand(64, 3)):
        q = quantize_ref(x, hs)
        assert torch.equal(dequantize_lut(q, hs), dequantize_ref(q, hs))
    every = FP4Tensor(torch.arange(256, dtype=torch.uint8).view(4, 64).repeat(1, 1),
                      torch.arange(32, dtype=torch.uint8).view(4, 8) * 4 % 127,
                      torch.zeros(4, 2, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float16))
    assert torch.equal(dequantize_lut(every, 1.0), dequantize_ref(every, 1.0))


def test_bench_kernels_reports_the_engine_fp4_row():
    """bench_kernels' console line compares SDPA with the engine's FP4 decode: the Gluon row at the
    smallest split count (the engine's), not a capped or slot-free variant."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    by = {"ours_fp4_gluon_s8": {"num_splits": 8, "us_graph": 20.0}, "ours_fp4_gluon_s16": {"num_splits": 16, "us_graph": 10.0},
          "ours_fp4_gluon_r168_s8": {"num_splits": 8, "us_graph": 1.0},
          "ours_fp4_gluon_no_outliers_s8": {"num_splits": 8, "us_graph": 1.0}, "torch_sdpa_bf16": {"us_graph": 30.0}}
    assert bench._engine_fp4_line(by) == "  engine fp4 (gluon, 8 splits)/sdpa, graph 1.50x"
    assert bench._engine_fp4_line({"torch_sdpa_bf16": {"us_graph": 30.0}}) == ""


def test_fp4_gluon_page_geometry():
    """The Gluon kernel's pool constants: one FP4PagedLayer page per block, each segment's byte
    offset and strides (memoized, the same answers); empty key-slot views give zeros; views that
    are not one pool's pages give None (the call then takes the Triton kernel)."""
    from kernels import fp4_gluon

    bs, h, d = 16, 4, 128
    layer = FP4PagedLayer(6, bs, h, d, "cpu")
    k, v = layer.kernel_views("k"), layer.kernel_views("v")
    g = fp4_gluon.page_geometry(k, v)
    base = layer.pages.data_ptr()
    assert g == fp4_gluon._page_geometry(k, v)
    assert g["PAGE"] == layer.page_bytes and g["KC"] == 0 and k[0].data_ptr() == base
    assert (g["C_S"], g["C_H"], g["S_S"], g["S_H"]) == (h * d // 2, d // 2, h * d // 16, d // 16)
    assert (g["I_S"], g["I_H"], g["O_S"], g["O_H"]) == (h * 2, 2, h * 2 * 2, 2 * 2)
    for name, t in (("KS", k[1]), ("KI", k[2]), ("KV", k[3]), ("VC", v[0]), ("VS", v[1])):
        assert g[name] == t.data_ptr() - base and 0 < g[name] < layer.page_bytes, name
    empty = (k[0], k[1], k[2][..., :0], k[3][..., :0], k[4])
    g0 = fp4_gluon.page_geometry(empty, v)
    assert (g0["KI"], g0["I_S"], g0["KV"], g0["O_S"]) == (0, 0, 0, 0) and g0["VC"] == g["VC"]
    apart = tuple(t.clone() if i < 4 else t for i, t in enumerate(k))  # each segment its own tensor
    assert fp4_gluon.page_geometry(apart, v) is None
