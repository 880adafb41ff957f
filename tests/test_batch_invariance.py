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
