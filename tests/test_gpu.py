"""GPU checks (skipped without CUDA): the engine on CUDA agrees with itself on CPU."""
from __future__ import annotations

import pytest
import torch

from docproc import LLM, SamplingParams
from test_parity import requests

pytestmark = pytest.mark.gpu


def test_cuda_float32_matches_cpu(qwen2_vl_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = LLM(str(qwen2_vl_dir), device="cpu").generate(requests(), sp)
    gpu_llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    gpu = gpu_llm.generate(requests(), sp)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    info = gpu_llm.cache_info()
    assert info["device"].startswith("cuda") and info["num_blocks"] > 1000


@pytest.mark.parametrize("model", ["qwen2_5_vl_dir", "qwen3_vl_dir"])
@pytest.mark.parametrize("kv", ["auto", "fp4"])
def test_cuda_float32_matches_cpu_for_qwen2_5_and_qwen3(request, model, kv):
    """Qwen2.5-VL (window attention) and Qwen3-VL (per-head q/k norms, DeepStack, its tower) on
    CUDA in float32, eager prefill and graph-captured decode, dense and FP4 KV: the CPU engine's
    tokens; with bf16 weights no kernel is compiled after warm-up."""
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = request.getfixturevalue(model)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = LLM(str(folder), device="cpu", kv_cache_dtype=kv).generate(requests(), sp)
    gpu = LLM(str(folder), device="cuda", dtype="float32", kv_cache_dtype=kv,
              gpu_memory_utilization=0.3).generate(requests(), sp)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    llm = LLM(str(folder), device="cuda", kv_cache_dtype="bf16" if kv == "auto" else kv, gpu_memory_utilization=0.2)
    llm.generate(requests() * 2, SamplingParams(max_tokens=12, ignore_eos=True))
    info = llm.cache_info()
    assert info["num_cuda_graphs"] > 0
    assert info["kernel_compiles_after_warmup"] == 0, (info["kernels_compiled_after_warmup"], info["kernel_variants_compiled_after_warmup"])


def test_cuda_bf16_pool_is_sized_from_memory_utilization(qwen2_vl_dir):
    llm = LLM(str(qwen2_vl_dir), device="cuda", gpu_memory_utilization=0.2)
    info = llm.cache_info()
    total = torch.cuda.get_device_properties(0).total_memory
    assert info["kv_cache_dtype"] == "bf16"
    assert 0.1 * total < info["allocated_bytes"] <= 0.2 * total
    out = llm.generate(requests()[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_cuda_fp4_matches_cpu_reference_path(qwen2_vl_dir):
    """The Triton FP4 store and attention kernels give the CPU torch-reference engine's tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    cpu = LLM(str(qwen2_vl_dir), device="cpu", kv_cache_dtype="fp4").generate(requests(), sp)
    gpu_llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", kv_cache_dtype="fp4",
                  gpu_memory_utilization=0.3)
    gpu = gpu_llm.generate(requests(), sp)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    assert gpu_llm.cache_info()["kernel_warmup_seconds"] > 0


@pytest.mark.parametrize("kv", ["bf16", "fp4"])
def test_no_kernel_compiles_after_warmup(qwen2_vl_dir, kv):
    """Warm-up compiles every kernel variant a step can launch: batches of several sizes (CUDA
    graphs captured on the way), prefill with and without prefix hits, and speculative verify
    windows compile nothing later."""
    llm = LLM(str(qwen2_vl_dir), device="cuda", kv_cache_dtype=kv, gpu_memory_utilization=0.2,
              speculative_model=str(qwen2_vl_dir), num_speculative_tokens=4)
    reqs = requests()
    llm.generate(reqs, SamplingParams(max_tokens=20, ignore_eos=True))
    llm.generate(reqs[:1], SamplingParams(max_tokens=7, ignore_eos=True))
    llm.generate(reqs * 3, SamplingParams(max_tokens=3, ignore_eos=True))
    info = llm.cache_info()
    assert info["num_cuda_graphs"] > 0
    assert info["kernel_compiles_after_warmup"] == 0, (info["kernels_compiled_after_warmup"], info["kernel_variants_compiled_after_warmup"])


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_no_kernel_compiles_after_warmup_with_masks_and_fp8_rows(qwen2_vl_dir, quantization):
    """Constrained rows (the grammar's mask kernel) and FP8 weights at 1, 2-15 and 16 rows (the
    few-row kernel, whose row count Triton specialises at 16) compile nothing after warm-up."""
    pytest.importorskip("xgrammar")
    from docproc import StructuredOutputsParams

    llm = LLM(str(qwen2_vl_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2,
              quantization=quantization)
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    reqs = requests()
    for n in (1, 3, 16):
        batch = (reqs * 16)[:n]
        llm.generate(batch, SamplingParams(max_tokens=12, structured_outputs=so))
        llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    info = llm.cache_info()
    assert info["kernel_compiles_after_warmup"] == 0, (info["kernels_compiled_after_warmup"], info["kernel_variants_compiled_after_warmup"])


def test_narrow_decode_in_the_engine(tmp_path):
    """Two KV heads, six sequences over > 4k keys: the decode steps' CUDA graphs take the dense
    kernel's narrow shape (64 keys a step, 32 splits; kernels/paged_attention.py,
    dense_narrow_decode), warm-up compiled it, and the tokens are those of each prompt run alone
    (batch 1: the wide shape)."""
    import json

    from fixtures.checkpoints import make_model

    folder = make_model(tmp_path / "m", "qwen2_vl", naming="new")  # tiny: 4 heads, 2 KV heads
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for c in (cfg, cfg.get("text_config", {})):
        if "max_position_embeddings" in c:
            c["max_position_embeddings"] = 8192
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(str(folder), device="cuda", gpu_memory_utilization=0.2)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 300, (4200 + 37 * i,), generator=g).tolist()} for i in range(6)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    info = llm.cache_info()
    assert info["kernel_compiles_after_warmup"] == 0, (info["kernels_compiled_after_warmup"], info["kernel_variants_compiled_after_warmup"])
    shapes = {key[3] for key in llm.runner.graphs.graphs}
    assert 64 in shapes, llm.runner.graphs.graphs.keys()
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert 128 in {key[3] for key in llm.runner.graphs.graphs}
    same = sum(a == b for x, y in zip(batch, alone) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in batch), (batch, alone)


def test_graph_captures_survive_threads_that_pin_memory(qwen2_vl_dir):
    """Graphs are captured lazily, mid-run, while the image-prefetch threads pin host memory: a
    capture must not be invalidated by another thread's CUDA calls (cudaErrorStreamCaptureInvalidated
    crashed `docproc run --draft bundled` on the H200). Here a thread pins memory without pause
    while batches of new sizes capture new graphs, with a draft capturing its own."""
    import threading

    stop = threading.Event()

    def pin():
        while not stop.is_set():
            torch.empty(1 << 18).pin_memory()

    llm = LLM(str(qwen2_vl_dir), device="cuda", gpu_memory_utilization=0.2, speculative_model=str(qwen2_vl_dir),
              num_speculative_tokens="auto")
    worker = threading.Thread(target=pin, daemon=True)
    worker.start()
    try:
        for n in (1, 2, 3, 5, 9, 17):  # each a new batch bucket: new graphs for target and draft
            out = llm.generate([r for r in requests() for _ in range(3)][:n], SamplingParams(max_tokens=12))
            assert all(o.error is None for o in out)
    finally:
        stop.set()
        worker.join()
    assert llm.cache_info()["num_cuda_graphs"] >= 4


def test_sampling_queues_without_waiting_for_the_forward():
    """Sampled rows (temperature, top-k/top-p, seeded and unseeded, beside greedy ones) are queued
    behind the work in flight: nothing of the sampler copies from pageable memory, which would make
    the host wait for the forward before the step's tokens can be read back."""
    from docproc.engine.sampler import Sampler, SamplingRow

    dev = torch.device("cuda")
    logits = torch.randn(4, 1000, device=dev)
    seeded = torch.Generator(device=dev)
    seeded.manual_seed(3)
    rows = [SamplingRow(0.7, 50, 0.9, None), SamplingRow(0.0, 0, 1.0, None), SamplingRow(1.0, 0, 1.0, seeded),
            SamplingRow(0.5, 0, 0.8, None)]
    sampler = Sampler(0, dev)
    sampler(logits, rows)  # (allocations and kernels' first use before the timed one)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the stream busy
    tokens = sampler(logits, rows)
    assert not torch.cuda.current_stream().query()  # the host came back while the stream was busy
    assert tokens.shape == (4,) and int(tokens[1]) == int(logits[1].argmax())
