"""Programmatic dependent launch (kernels/pdl.py): when it is used, and that a chain of kernels
launched with it computes exactly what plain stream order computes (GPU, sm_90+)."""
from __future__ import annotations

import pytest
import torch

import kernels.pdl as pdl


def test_pdl_launch_arguments(monkeypatch):
    """Off on CPU and when turned off; on CUDA sm_90+ the trigger placement per call site, or
    forced by DOCPROC_PDL_TRIGGER's value (pdl.TRIGGER)."""
    monkeypatch.setattr(pdl, "TRIGGER", "")
    monkeypatch.setattr(pdl, "ENABLED", True)
    if _hopper():
        x = torch.zeros(1, device="cuda")
        assert pdl.launch(x) == {"PDL": 1, "launch_pdl": True}
        assert pdl.launch(x, early=False) == {"PDL": 2, "launch_pdl": True}
        monkeypatch.setattr(pdl, "TRIGGER", "end")
        assert pdl.launch(x)["PDL"] == 2
        monkeypatch.setattr(pdl, "TRIGGER", "start")
        assert pdl.launch(x, early=False)["PDL"] == 1
        monkeypatch.undo()
    assert pdl.launch(torch.zeros(1)) == {"PDL": 0}
    assert not pdl.enabled(torch.zeros(1))
    monkeypatch.setattr(pdl, "ENABLED", False)
    if torch.cuda.is_available():
        assert pdl.launch(torch.zeros(1, device="cuda")) == {"PDL": 0}


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _chain(x, r, W, h):
    """A decode step's layer kernels without attention, each reading the one before."""
    from kernels.fused import add_rms_norm
    from kernels.gemv import gemm_rows, gemv

    for L in W:
        hh, r = add_rms_norm(x, r, L["n1"], 1e-6)
        qkv = gemv(hh, L["qkv"], L["b"])
        o = gemv(qkv[:, :h], L["o"])
        hh, r = add_rms_norm(o, r, L["n2"], 1e-6)
        x = gemv(gemv(hh, L["gu"]), L["down"], gated=True)
        x = gemm_rows(torch.cat([x, r]), L["o"])[:1]  # the rows kernel too (cat: a torch kernel between)
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs sm_90 or later")
@pytest.mark.parametrize("trigger", ["start", "end"])
def test_pdl_chain_in_a_graph_matches_plain_order(monkeypatch, trigger):
    """Replayed with new inputs each time, the graph of PDL launches gives bit for bit what the same
    kernels give launched in plain order. A kernel reading its input before its wait would read the
    previous replay's (different) values."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h, inter, layers = 512, 1408, 6
    dt = torch.bfloat16
    monkeypatch.setattr(pdl, "TRIGGER", trigger)
    monkeypatch.setattr(pdl, "ENABLED", True)

    def w(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dt)

    W = [dict(qkv=w(h + 256, h), b=w(1, h + 256)[0], o=w(h, h), gu=w(2 * inter, h), down=w(h, inter),
              n1=1 + w(1, h)[0], n2=1 + w(1, h)[0]) for _ in range(layers)]
    x_in = torch.zeros(1, h, device="cuda", dtype=dt)
    r_in = torch.zeros(1, h, device="cuda", dtype=dt)
    assert pdl.enabled(x_in)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(x_in, r_in, W, h)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x_in, r_in, W, h)
    for i in range(20):
        x = torch.randn(1, h, device="cuda", generator=g).to(dt)
        r = torch.randn(1, h, device="cuda", generator=g).to(dt)
        x_in.copy_(x)
        r_in.copy_(r)
        graph.replay()
        got = out.clone()
        pdl.ENABLED = False
        want = _chain(x, r, W, h)
        pdl.ENABLED = True
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs sm_90 or later")
def test_engine_decodes_the_same_with_and_without_pdl(qwen2_vl_dir, monkeypatch):
    """Batch-1 decode from CUDA graphs in bf16 (only our kernels after the prompt): identical tokens
    with every step kernel launched with PDL and without. Speculation (a batch of two, K = 3,
    verify windows through cuBLAS and gemm_rows) in float32, where it must give plain decoding's
    tokens: bf16 speculation is not compared across engines, as its verify products may round
    differently from one engine to the next (cuBLAS's choice of kernel)."""
    import kernels.gemv as kg
    from docproc import LLM, SamplingParams

    reqs = [{"prompt": "<|im_start|>user\nthe quick brown fox"}, {"prompt": "<|im_start|>user\nnumbers 1 2 3"}]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    one = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        launched = []
        real = pdl.launch
        monkeypatch.setattr(pdl, "launch", lambda t, early=True: (launched.append(1), real(t, early))[1])
        llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
        assert llm.cache_info()["step_graphs"]
        one[on] = llm.generate(reqs[:1], sp)[0].outputs[0].token_ids
        assert launched
        monkeypatch.undo()
    assert one[True] == one[False], "bf16 batch-1 decode"
    monkeypatch.setattr(pdl, "ENABLED", False)
    plain = [o.outputs[0].token_ids for o in LLM(str(qwen2_vl_dir), device="cuda", dtype="float32",
                                                 kv_cache_memory_bytes=64 << 20).generate(reqs, sp)]
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(kg, "ROWS_MAX", 16)  # the verify windows through gemm_rows, a PDL kernel too
    spec = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
               speculative_model=str(qwen2_vl_dir), num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(reqs, sp)] == plain, "float32 speculation with PDL"
