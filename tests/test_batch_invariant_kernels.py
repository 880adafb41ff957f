"""The batch-invariant kernels (KernelOptions.batch_invariant): a row's result does not depend on
the rows computed beside it. Attention: one query row of one sequence as a decode row alone, among
other sequences' decode rows, verification windows and prefill chunks (each of which changes the
default plan's tile shape or split count), inside a window of its own and as the last row of a
prefill chunk: the same bits. Products: row i of x W^T the same for 1 row or 130 (on CPU for rows
at the same place of a tile: see below). Under Triton's
interpreter on CPU (float32 and float16: its bfloat16 dot is not usable), compiled on a GPU."""
from __future__ import annotations

import pytest
import torch
from test_kernels import DEV, fp4_layer_with_outliers

from kernels.attention_plan import plan_tiles, tile_shape, warmup_launches
from kernels.matmul import matmul
from kernels.paged_attention import paged_attention, paged_attention_ref

HEADS, KV_HEADS, D, BS, NB = 6, 2, 32, 4, 100
PROBE_CTX = 100  # the probe sequence's keys: one 64-key step and part of a second


def probe_row_in(case: str, cache, invariant: bool) -> torch.Tensor:
    """The probe's row at position PROBE_CTX - 1 (the same query vector every time), computed in
    the step `case` describes; returns its (heads, D) output."""
    g = torch.Generator().manual_seed(3)
    q_probe = torch.randn(HEADS, D, generator=g)
    probe_table = list(range(-(-PROBE_CTX // BS)))
    others_table = list(range(len(probe_table), NB))
    # (query tokens, context) of the probe and of the sequences beside it
    probe_q = {"decode": 1, "window": 3, "chunk": 10}[case.split("+")[0]]
    seqs = [(probe_q, PROBE_CTX, probe_table)]
    if case.endswith("+batch"):  # decode rows of other lengths, a verification window, a chunk
        for i, (nq, ctx) in enumerate([(1, 40), (5, 70), (1, 130), (12, 20)]):
            start = (i * 13) % (len(others_table) - 33)
            seqs.append((nq, ctx, others_table[start: start + -(-ctx // BS)]))
    qs, ctx_lens, tables = [0], [], []
    for nq, ctx, table in seqs:
        qs.append(qs[-1] + nq)
        ctx_lens.append(ctx)
        tables.append(table)
    q = torch.randn(qs[-1], HEADS, D, generator=torch.Generator().manual_seed(len(case)))
    q[probe_q - 1] = q_probe  # the probe's last query row
    plan = plan_tiles(qs, ctx_lens, tables, HEADS // KV_HEADS, DEV, num_sms=132, num_kv_heads=KV_HEADS,
                      invariant=invariant)
    if isinstance(cache, tuple):
        out = paged_attention(q.to(DEV), plan, D ** -0.5, k_cache=cache[0], v_cache=cache[1])
    else:
        out = paged_attention(q.to(DEV), plan, D ** -0.5, fp4_k=cache.kernel_views("k"), fp4_v=cache.kernel_views("v"),
                              fp4_gluon=False)
    return out[probe_q - 1].cpu()


CASES = ["decode", "decode+batch", "window", "window+batch", "chunk", "chunk+batch"]


@pytest.mark.slow  # (8-9 s a KV format: a dozen kernel launches in Triton's interpreter)
@pytest.mark.parametrize("kv", ["fp32", "fp4"])
def test_a_rows_attention_is_the_same_bits_in_every_step_that_computes_it(kv):
    g = torch.Generator().manual_seed(0)
    if kv == "fp32":
        cache = (torch.randn(NB, BS, KV_HEADS, D, generator=g).to(DEV), torch.randn(NB, BS, KV_HEADS, D, generator=g).to(DEV))
    else:
        cache = fp4_layer_with_outliers(NB, BS, KV_HEADS, D)
    cases = CASES if kv == "fp32" else ["decode", "window+batch", "chunk+batch"]  # (FP4: slow in the interpreter)
    rows = {case: probe_row_in(case, cache, invariant=True) for case in cases}
    for case in cases[1:]:
        assert torch.equal(rows[case], rows["decode"]), (kv, case, (rows[case] - rows["decode"]).abs().max())
    # and it is attention: the reference's value for that row
    q = rows["decode"].new_zeros(1, HEADS, D)
    q[0] = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(3))
    if kv == "fp32":
        def gather(blocks):
            idx = torch.tensor(blocks, device=DEV)
            return cache[0][idx].reshape(-1, KV_HEADS, D), cache[1][idx].reshape(-1, KV_HEADS, D)
    else:
        gather = cache.gather
    ref = paged_attention_ref(q.to(DEV), gather, [0, 1], [PROBE_CTX], [list(range(-(-PROBE_CTX // BS)))], BS,
                              D ** -0.5)[0].cpu()
    assert torch.allclose(rows["decode"], ref, atol=1e-4, rtol=1e-4), (rows["decode"] - ref).abs().max()
    if kv == "fp32":  # (what the default plans do: the split count and tile shape follow the step)
        default = {case: probe_row_in(case, cache, invariant=False) for case in ("decode", "decode+batch", "chunk")}
        assert not (torch.equal(default["decode"], default["decode+batch"])
                    and torch.equal(default["decode"], default["chunk"]))


def test_invariant_plans_have_one_shape_and_one_launch_to_compile():
    for group in (1, 3, 6, 7, 8):
        shapes = {tile_shape(q, group, invariant=True) for q in (1, 2, 5, 16, 64, 500)}
        assert len(shapes) == 1
        plan = plan_tiles([0, 1, 31], [700, 90], [[0] * 44, [0] * 6], group, "cpu", num_sms=132, invariant=True)
        assert plan.num_splits == 1 and plan.dense_block_n is None and plan.invariant
        assert (plan.tokens_per_tile, plan.block_m) == shapes.pop()
    assert warmup_launches(7, dense=True, num_kv_heads=2, invariant=True) == [(1, 1, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_products_rows_are_the_same_bits_for_any_row_count(dtype):
    from docproc.models.quant import quantize, quantize_blocks

    g = torch.Generator().manual_seed(0)
    n, k = 200, 150  # neither a multiple of the tiles
    w = torch.randn(n, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    x = torch.randn(130, k, generator=g).to(dtype).to(DEV)
    full = matmul(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert torch.allclose(full.float(), ref, atol=0.05 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    # on CPU only rows at the same place of a tile (numpy's product of a tile, the interpreter's
    # dot, sums a row by where it sits in the tile); on a GPU any rows
    anywhere = DEV == "cuda"
    for rows in ((slice(0, 1), slice(5, 6), slice(3, 40), slice(64, 130)) if anywhere else
                 (slice(0, 1), slice(0, 5), slice(64, 65), slice(64, 130))):
        assert torch.equal(matmul(x[rows], w, b), full[rows]), rows
    for fw in (quantize(w.float().cpu()), quantize_blocks(w.float().cpu(), (128, 128))):  # per channel, block-wise
        data, scale = fw.data.to(DEV), fw.scale.to(DEV)
        y = matmul(x, data, None, scale, fw.group)
        ref = torch.nn.functional.linear(x.float(), fw.dequantize(dtype).float().to(DEV))
        assert torch.allclose(y.float(), ref, atol=0.05 if dtype == torch.float16 else 1e-4, rtol=1e-3)
        assert torch.equal(matmul(x[64:70], data, None, scale, fw.group), y[64:70])
    assert matmul(x[:0], w).shape == (0, n) and matmul(x.view(10, 13, k), w).shape == (10, 13, n)
