"""A request's answer does not depend on the requests beside it: the bundled target, greedy, alone
and inside batches of other pages' requests (in the middle of 4, last of 8), with a token budget
per step that cuts prompts into chunks at other places, with FP4 KV (the format whose answers moved
with the schedule on the GPU; float32 alone and among concurrent requests: tests/test_serve.py).
Prefix caching is off, so every pass computes its prompt. The GPU's side of this (kernels whose
reduction order follows the batch) is measured by bench/batch_invariance.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from docproc import LLM, SamplingParams
from docproc.pipeline.ingest import discover, open_document
from docproc.pipeline.queries import build_prompt, load_queries

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docproc" / "assets" / "models" / "target"


def page_requests() -> list[dict]:
    """Each image sample's first page asked each default query (the first: the probe's page)."""
    questions = {q.name: q.question for q in load_queries().queries}
    images = [c for c in discover([str(ROOT / "sample_docs")]) if Path(c.path).suffix == ".jpg"]
    reqs = []
    for c in images[:3]:
        img = open_document(c).page(0).image
        for name in ("all_fields", "total", "vendor", "date"):
            reqs.append({"prompt": build_prompt(1, questions[name]), "multi_modal_data": {"image": [img]}})
    return reqs


@pytest.mark.slow  # (18 s on a core: FP4's CPU path; float32's alone-against-concurrent check is test_serve's)
@pytest.mark.parametrize("kv", ["fp4"])
def test_a_request_gives_the_same_tokens_alone_and_inside_batches_of_others(kv):
    reqs = page_requests()
    probe, others = reqs[0], reqs[1:]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    # 200 tokens a step: the probe's prompt is cut into chunks at other places alone and in a batch
    llm = LLM(str(TARGET), device="cpu", kv_cache_dtype=kv, enable_prefix_caching=False,
              max_num_batched_tokens=200)
    alone = llm.generate([probe], params)[0].outputs[0].token_ids
    assert len(alone) > 8
    for n, where in ((4, 2), (8, 7)):  # in the middle of 4, last of 8
        batch = others[: n - 1]
        batch = batch[:where] + [probe] + batch[where:]
        got = llm.generate(batch, params)[where].outputs[0].token_ids
        assert got == alone, (kv, n, where)
    llm.close()


@pytest.mark.slow  # (8 s: an engine on the graphs' padded path, its attention in Triton's interpreter)
def test_the_batch_invariant_mode_reaches_every_plan_product_and_page(qwen2_vl_dir, monkeypatch):
    """LLM(batch_invariant=True): every attention plan, eager and on the graphs' padded path, is the
    invariant one; each page is encoded in a call of its own; products on CUDA go through
    kernels/matmul.py (the tensor on CPU is F.linear's: checked at the routing); the engine reports
    the mode, keeps it fixed, and refuses it with tensor parallelism. The kernels' invariance
    itself: tests/test_batch_invariant_kernels.py."""
    import docproc.engine.model_runner as model_runner
    import docproc.layers.attention as attention
    from test_fp4_engine import IMG, page

    from docproc.config import EngineConfig
    from kernels import gemv
    from kernels.options import KernelOptions

    plans = []
    real = attention.plan_tiles

    def spy(*a, **kw):
        plan = real(*a, **kw)
        plans.append(plan.invariant)
        return plan

    with monkeypatch.context() as m:
        m.setattr(model_runner, "resolve_step_graphs", lambda config, device: "static")  # Triton on CPU
        m.setattr(attention, "plan_tiles", spy)
        llm = LLM(str(qwen2_vl_dir), device="cpu", max_num_seqs=8, batch_invariant=True)
        calls = []
        encode = llm.runner.model.vision.encode
        m.setattr(llm.runner.model.vision, "encode", lambda p, g: calls.append(len(g)) or encode(p, g))
        two = [{"prompt": "<|im_start|>user\n" + IMG + IMG + "Totals?", "multi_modal_data": {"image": [page(1), page(2)]}},
               {"prompt": "<|im_start|>user\n" + IMG + "Number?", "multi_modal_data": {"image": [page(3)]}}]
        out = llm.generate(two, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert plans and all(plans) and llm.runner.graphs.invariant and llm.runner.graphs.num_replays > 0
    assert calls == [1, 1, 1]  # three pages in one step, one call each
    assert llm.cache_info()["batch_invariant"] is True
    with pytest.raises(ValueError, match="fixed when the engine is built"):
        llm.runner.set_kernel_options(KernelOptions())
    llm.close()
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model=str(qwen2_vl_dir), batch_invariant=True, tensor_parallel_size=2)
    # the routing of a product on CUDA (a CPU tensor that says it is one)
    seen = []
    monkeypatch.setattr(gemv, "matmul", lambda x, w, b=None: seen.append(x.shape[0]) or w)

    class Cuda(torch.Tensor):
        is_cuda = True

    x = torch.randn(1, 8).as_subclass(Cuda)
    gemv.linear(x, torch.randn(4, 8), opts=KernelOptions(batch_invariant=True))
    gemv.linear(torch.cat([x] * 3), torch.randn(4, 8), opts=KernelOptions(batch_invariant=True))
    assert seen == [1, 3]  # one row too: not the one-row kernel
