"""Programmatic dependent launch (kernels/pdl.py): when it is used, and that a chain of kernels
launched with it computes exactly what plain stream order computes (GPU, sm_90+)."""
from __future__ import annotations

import pytest
import torch

import kernels.pdl as pdl


def test_pdl_launch_arguments():
    """Off on CPU and when turned off; on CUDA sm_90+ the trigger placement of each call site."""
    if _hopper():
        x = torch.zeros(1, device="cuda")
        assert pdl.launch(x) == {"PDL": 1, "launch_pdl": True}
        assert pdl.launch(x, early=False) == {"PDL": 2, "launch_pdl": True}
        assert pdl.attention_launch(x) == {"PDL": 1, "launch_pdl": True}
    assert pdl.launch(torch.zeros(1)) == {"PDL": 0}
    assert not pdl.enabled(torch.zeros(1)) and not pdl.enabled_on("cpu")
    if _hopper():
        assert pdl.enabled_on("cuda") and pdl.enabled_on(torch.device("cuda", 0))
    assert not pdl.enabled_on("cuda", on=False)
    if torch.cuda.is_available():
        assert pdl.launch(torch.zeros(1, device="cuda"), on=False) == {"PDL": 0}
        assert pdl.attention_launch(torch.zeros(1, device="cuda"), on=False) == {"PDL": 0}


@pytest.mark.slow
def test_each_engine_keeps_its_own_kernel_choices(qwen2_vl_dir):
    """cache_info()["pdl"] (and so a run's manifest) says whether the decode kernels use PDL: never
    on CPU. The engine's kernel options (pdl, one_row_kernels, fp4_gluon) are its own, held by its
    model's modules and its attention backend: a second engine in the process does not change the
    first's."""
    from docproc.engine.llm import LLM
    from kernels.options import KernelOptions

    off = LLM(str(qwen2_vl_dir), device="cpu", pdl=False, one_row_kernels=False, fp4_gluon=False)
    on = LLM(str(qwen2_vl_dir), device="cpu")
    assert on.cache_info()["pdl"] is False and off.cache_info()["pdl"] is False
    for llm, want in ((off, KernelOptions(one_row=False, pdl=False, fp4_gluon=False)), (on, KernelOptions())):
        runner = llm.runner
        assert runner.kernel_options == want and runner.backend.kernels is runner.kernel_options
        text = runner.model.text
        holders = [text, text.norm] + [m for layer in text.layers
                                       for m in (layer.self_attn, layer.mlp, layer.input_layernorm,
                                                 layer.post_attention_layernorm)]
        assert all(m.kernels is runner.kernel_options for m in holders)
    switched = KernelOptions(pdl=False)  # what benches do (their graphs dropped)
    on.runner.set_kernel_options(switched)
    assert on.runner.backend.kernels is switched and on.runner.model.text.layers[0].mlp.kernels is switched
    assert off.runner.kernel_options.pdl is False and off.runner.model.text.norm.kernels.one_row is False
    with pytest.raises(ValueError, match="fp4_gluon is fixed"):  # the plans were made for it
        on.runner.set_kernel_options(KernelOptions(fp4_gluon=False))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _chain(x, r, W, h, on: bool = True):
    """A decode step's layer kernels without attention, each reading the one before (on: launched
    with PDL)."""
    from functools import partial

    from kernels.fused import add_rms_norm
    from kernels.gemv import gemv

    gemv = partial(gemv, pdl_on=on)
    for L in W:
        hh, r = add_rms_norm(x, r, L["n1"], 1e-6, pdl_on=on)
        qkv = gemv(hh, L["qkv"], L["b"])
        o = gemv(qkv[:, :h], L["o"])
        hh, r = add_rms_norm(o, r, L["n2"], 1e-6, pdl_on=on)
        x = gemv(gemv(hh, L["gu"]), L["down"], gated=True)
        x = gemv(torch.cat([x, r])[:1].contiguous(), L["o"])  # a torch kernel (cat) between two of ours
    return x


@pytest.mark.gpu
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
    real = pdl.launch  # every kernel's trigger at the start, or every one at the end
    monkeypatch.setattr(pdl, "launch", lambda t, early=True, on=True: real(t, early=trigger == "start", on=on))

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
        want = _chain(x, r, W, h, on=False)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs sm_90 or later")
def test_engine_decodes_the_same_with_and_without_pdl(qwen2_vl_dir, monkeypatch):
    """Batch-1 decode from CUDA graphs in bf16 (only our kernels after the prompt): identical tokens
    with every step kernel launched with PDL and without. Speculation (a batch of two, K = 3,
    verify windows through cuBLAS) in float32, where it must give plain decoding's
    tokens: bf16 speculation is not compared across engines, as its verify products may round
    differently from one engine to the next (cuBLAS's choice of kernel)."""
    from docproc import LLM, SamplingParams

    reqs = [{"prompt": "<|im_start|>user\nthe quick brown fox"}, {"prompt": "<|im_start|>user\nnumbers 1 2 3"}]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    one = {}
    for on in (False, True):
        launched = []
        real = pdl.launch
        monkeypatch.setattr(pdl, "launch", lambda t, early=True, on=True: (launched.append(on), real(t, early, on))[1])
        llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, pdl=on)
        assert llm.cache_info()["step_graphs"]
        one[on] = llm.generate(reqs[:1], sp)[0].outputs[0].token_ids
        assert launched and set(launched) == {on}  # every launch of this engine's kernels asked as it says
        monkeypatch.undo()
    assert one[True] == one[False], "bf16 batch-1 decode"
    plain = [o.outputs[0].token_ids for o in LLM(str(qwen2_vl_dir), device="cuda", dtype="float32",
                                                 kv_cache_memory_bytes=64 << 20, pdl=False).generate(reqs, sp)]
    spec = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
               speculative_model=str(qwen2_vl_dir), num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(reqs, sp)] == plain, "float32 speculation with PDL"


# ---- the load order, from the compiled PTX (CPU: compiles for sm_90, no GPU needed) -----------------
def _ptx(fn, meta: dict, types: dict, **opts) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    sig, consts = {}, {}
    for name in fn.arg_names:
        if name in meta:
            sig[name], consts[name] = "constexpr", meta[name]
        else:
            sig[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, **opts}).asm["ptx"]


def _loads_before_wait(ptx: str, arg_names: list[str]) -> list[set[str]]:
    """The global loads (and asynchronous copies) of the PTX that some path from the kernel's entry
    reaches without passing a griddepcontrol.wait, each as the set of kernel arguments its address
    derives from (registers traced back through the instructions defining them, a loaded value
    deriving from its address, to the parameters read by ld.param). Paths follow the branches, so
    a wait that only some paths execute (one inside a loop's first iteration) does not count. The
    PTX is what runs: LLVM may move a load across the wait's inline assembly."""
    import re

    reg = re.compile(r"%[a-z]+\d+")
    label = re.compile(r"^(\$L__\w+):")
    insts: list[str] = []
    labels: dict[str, int] = {}
    for ln in ptx.splitlines():
        code = ln.split("//")[0].strip()
        m = label.match(code)
        if m:
            labels[m.group(1)] = len(insts)
            continue
        if not code or code.startswith((".", "{", "}")):
            continue
        insts.append(code.rstrip(";").strip())
    defs: dict[str, set] = {}
    for code in insts:
        body = re.sub(r"^@!?%p\d+\s+", "", code)
        op = body.split()[0]
        if op.startswith("ld.param"):
            m = re.search(r"_param_(\d+)", body)
            for r in reg.findall(body.split("[")[0]):
                defs.setdefault(r, set()).add(("param", int(m.group(1))))
        elif op.startswith(("ld.", "cp.", "atom.")):  # loaded registers derive from the address
            addr = reg.findall(body[body.index("["):]) if "[" in body else []
            for r in reg.findall(body.split("[")[0]):
                defs.setdefault(r, set()).update(addr)
        elif not op.startswith(("st.", "bra", "ret", "exit", "bar", "griddep", "fence", "membar")):
            regs = reg.findall(body)
            if regs:
                defs.setdefault(regs[0], set()).update(regs[1:])

    def roots(regs) -> set[str]:
        seen, todo, out = set(), list(regs), set()
        while todo:
            x = todo.pop()
            if isinstance(x, tuple):
                out.add(arg_names[x[1]])
            elif x not in seen:
                seen.add(x)
                todo.extend(defs.get(x, ()))
        return out

    assert any("griddepcontrol.wait" in c for c in insts), "no griddepcontrol.wait in the PTX"
    found, seen, todo = [], set(), [0]
    while todo:  # instructions reachable from the entry without passing a wait
        i = todo.pop()
        if i in seen or i >= len(insts):
            continue
        seen.add(i)
        code = insts[i]
        body = re.sub(r"^@!?%p\d+\s+", "", code)
        op = body.split()[0]
        if "griddepcontrol.wait" in body and not code.startswith("@"):
            continue
        if op.startswith(("ld.global", "cp.async")):
            found.append(roots(reg.findall(body[body.index("["):])))
        if op.startswith("bra"):
            todo.append(labels[body.split()[-1]])
            if not code.startswith("@"):
                continue
        if op in ("ret", "exit"):
            continue
        todo.append(i + 1)
    return found


@pytest.mark.parametrize("pdl_mode", [1, 2])
@pytest.mark.slow
def test_pdl_kernels_wait_before_reading_activations(pdl_mode):
    """Each PDL kernel as compiled for sm_90: every global load ahead of its wait reads a weight
    argument (the one-row products' first weight tile, the norm's weight), nothing an earlier kernel
    writes. Triton's software pipelining can hoist a loop's loads ahead of a wait placed inside it,
    so the check is on the compiled form, not the source. Runs in
    a subprocess: the suite's Triton interpreter (TRITON_INTERPRET=1) does not compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    code = (f"import runpy, sys; sys.path.insert(0, {str(root)!r}); "
            f"runpy.run_path({str(Path(__file__).resolve())!r})['_check_load_order']({pdl_mode})")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "checked 9 kernels" in res.stdout


def _check_load_order(pdl_mode: int) -> None:
    from kernels import fp8, fused, gemv, paged_attention as pa


    ints = {n: "*i32" for n in ("tile_seq_ptr", "tile_tok_ptr", "tile_nq_ptr", "tile_pos_ptr", "table_ptr")}
    ints.update(part_acc_ptr="*fp32", part_ml_ptr="*fp32", slot_ptr="*i64", eps="fp32", sm_scale_log2="fp32")
    cases = [  # kernel, compile-time arguments, the pointers it may read before the wait, stages
        (gemv._gemv_kernel, dict(GATED=False, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=512, EVEN_K=True), {"w_ptr"}, 3),
        (gemv._gemv_kernel, dict(GATED=True, HAS_BIAS=False, BLOCK_N=8, BLOCK_K=256, EVEN_K=False), {"w_ptr"}, 3),
        (fused._add_rms_norm_kernel, dict(HAS_RES=True, BLOCK=1024), {"w_ptr"}, 3),
        (fused._rotary_store_kernel, dict(HALF=64, BLOCK_H=32, BLOCK_KV=4, NORM=False), set(), 3),
        (fused._rotary_store_kernel, dict(HALF=64, BLOCK_H=32, BLOCK_KV=4, NORM=True), set(), 3),  # (Qwen3's)
        (pa._paged_attn_kernel, dict(GROUP=7, TOKENS=1, BLOCK_M=16, BLOCK_N=32, HALF=64, SPLIT=True, DOT_FP32=False),
         set(), 2),
        (pa._combine_kernel, dict(GROUP=7, TOKENS=1, BLOCK_M=16, HALF=64, BLOCK_D=32, CHUNK=8), set(), 3),
        # the FP8 one-row kernel: per-row scales, and group-wise (block-wise checkpoints) gated
        (fp8._gemv_fp8_kernel, dict(GATED=False, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=1024, GROUP_K=1024, PER_ROW=True,
                                    EVEN_K=True), {"w_ptr"}, 3, dict(w_ptr="*fp8e4nv", s_ptr="*fp32")),
        (fp8._gemv_fp8_kernel, dict(GATED=True, HAS_BIAS=False, BLOCK_N=4, BLOCK_K=256, GROUP_K=128, PER_ROW=False,
                                    EVEN_K=False), {"w_ptr", "s_ptr"}, 3, dict(w_ptr="*fp8e4nv", s_ptr="*fp32")),
    ]
    for fn, meta, weights, stages, *types in cases:
        ptx = _ptx(fn, {**meta, "PDL": pdl_mode}, {**ints, **(types[0] if types else {})}, num_stages=stages)
        params = [n for n in fn.arg_names if n not in meta and n != "PDL"]
        early = [{a for a in r if a.endswith("_ptr")} for r in _loads_before_wait(ptx, params)]  # pointers only
        assert all(r <= weights for r in early), (fn.__name__, meta, early)
        if weights:  # the weights do stream ahead of the wait
            assert any(r for r in early), (fn.__name__, "no weight load before the wait")
    print(f"checked {len(cases)} kernels")
