"""kernels/gemv.py against its torch reference (Triton's interpreter on CPU, compiled on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.fused import silu_mul_ref
from kernels.gemv import gemv, gemv_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,bias,gated,config", [
    (40, 96, True, False, (8, 32, 4)),     # several K tiles, bias
    (37, 80, False, False, (8, 32, 4)),    # N and K not multiples of the tile
    (24, 48, False, True, (8, 32, 4)),     # gated: SiLU(gate) x up on the fly
    (19, 70, False, True, (4, 64, 2)),     # gated, ragged K
])
def test_gemv_matches_reference(n, k, bias, gated, config):
    g = torch.Generator().manual_seed(n * 1000 + k)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    x = torch.randn(1, 2 * k if gated else k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    got = gemv(x, w, b, gated=gated, config=config)
    want = gemv_ref(x, w, b, gated=gated)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * k ** 0.5)
    # the gated reference is the engine's own path: silu_mul, then the projection
    if gated:
        h = silu_mul_ref(x)
        torch.testing.assert_close(gemv_ref(h, w), want, rtol=tol, atol=tol * k ** 0.5)
    # a weight that is a row slice of a wider matrix (stride along N > K) reads the right rows
    wide = torch.randn(n, k + 16, generator=g).to(DEV, dtype)
    torch.testing.assert_close(gemv(x, wide[:, 8: 8 + k], b, gated=gated, config=config),
                               gemv_ref(x, wide[:, 8: 8 + k], b, gated=gated), rtol=tol, atol=tol * k ** 0.5)


@pytest.mark.gpu
def test_engine_decodes_the_same_with_the_one_row_kernels(qwen2_vl_dir, monkeypatch):
    """Batch-1 decode (CUDA graphs) with every one-row product through kernels/gemv.py, and with
    cuBLAS: the same greedy tokens in float32 (bf16 numerics: the kernel tests above)."""
    import kernels.gemv as kg
    from docproc import LLM, SamplingParams

    req = {"prompt": "<|im_start|>user\nthe quick brown fox"}
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    got = {}
    for on in (False, True):
        calls = []
        real = kg._gemv_kernel.run
        monkeypatch.setattr(kg._gemv_kernel, "run", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
                  one_row_kernels=on)
        got[on] = llm.generate([req], sp)[0].outputs[0].token_ids
        assert bool(calls) == on
        monkeypatch.undo()
    assert got[True] == got[False]
