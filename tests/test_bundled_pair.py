"""The bundled default pair (docproc/assets/models): both folders load in transformers and in our
engine and give the same greedy answers in float32 on CPU, on real sample pages; the draft's
vision trunk is the target's; `docproc run sample_docs` with no --model reads the documents.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from docproc import LLM, SamplingParams
from docproc.pipeline.ingest import discover, open_document
from docproc.pipeline.queries import build_prompt, load_queries

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "docproc" / "assets" / "models"
SAMPLES = ROOT / "sample_docs"


def first_page(name: str):
    c = next(c for c in discover([str(SAMPLES)]) if Path(c.path).name == name)
    return open_document(c).page(0).image


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.slow
def test_engine_and_transformers_give_the_same_greedy_answers(role):
    from transformers import Qwen2VLForConditionalGeneration

    folder = str(MODELS / role)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, device="cpu", dtype="float32")
    queries = {q.name: q.question for q in load_queries().queries}
    reqs = [{"prompt": build_prompt(1, queries[name]), "multi_modal_data": {"image": [first_page(doc)]}}
            for doc in ("doc_2026_00001.pdf", "doc_2026_00003.jpg") for name in ("total", "all_fields")]
    outs = llm.generate(reqs, SamplingParams(max_tokens=96))
    for req, out in zip(reqs, outs):
        ids = torch.tensor([out.prompt_token_ids])
        pv, grid = llm.processor.pixel_values(req["multi_modal_data"]["image"])
        with torch.no_grad():
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pv,
                              image_grid_thw=grid, max_new_tokens=96, do_sample=False,
                              mm_token_type_ids=(ids == llm.processor.image_token_id).int())[0, ids.shape[1]:].tolist()
        eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert out.outputs[0].token_ids == ref, (role, out.outputs[0].text)
    # a trained model: the all-fields answers are JSON objects with the six fields
    for out in outs[1::2]:
        if role == "target":
            assert set(json.loads(out.outputs[0].text)) == {"vendor", "invoice_number", "date", "due_date",
                                                            "currency", "total"}


def test_draft_shares_the_targets_trunk_and_is_four_times_cheaper():
    from safetensors.torch import load_file

    def weights(role):
        out = {}
        for f in sorted((MODELS / role).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    t, d = weights("target"), weights("draft")
    trunk = [k for k in t if "visual." in k and ".merger." not in k]
    assert trunk and all(torch.equal(t[k], d[k]) for k in trunk)

    def lm_params(w):
        # the LM's per-token matmuls: every weight outside the vision tower but the embedding table
        return sum(v.numel() for k, v in w.items() if "visual." not in k and "embed_tokens" not in k)

    assert lm_params(d) * 4 <= lm_params(t)
    assert sum(f.stat().st_size for f in MODELS.rglob("*.safetensors")) <= 60e6


@pytest.mark.slow
def test_docproc_run_reads_sample_documents_with_the_default_pair(tmp_path):
    """`docproc run` with no --model uses the bundled target (here with `--draft bundled`, which
    is the default on CUDA only) and reads the pages:
    on these three samples (a PDF and two scans) it measured 15 of 18 fields right (2026-11-29;
    all three misses are the currency), so a floor of 0.65 catches a broken model or pipeline."""
    import shutil
    import subprocess
    import sys

    names = ["doc_2026_00001.pdf", "doc_2026_00003.jpg", "doc_2026_00006.jpg"]
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in names:
        shutil.copy(SAMPLES / n, docs / n)
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(line for line in (SAMPLES / "truth.jsonl").read_text().splitlines(keepends=True)
                             if json.loads(line)["file"] in names))
    cli = [sys.executable, "-m", "docproc.cli"]
    subprocess.run([*cli, "run", str(docs), "--out", str(tmp_path / "out"), "--quiet", "--draft", "bundled"],
                   check=True, timeout=600)
    report = json.loads(subprocess.run([*cli, "eval", str(tmp_path / "out"), "--truth", str(truth), "--json"],
                                       check=True, capture_output=True, text=True).stdout)
    assert report["documents"] == 3 and report["overall_exact_match"] >= 0.65, report
    manifest = json.loads(next((tmp_path / "out" / "runs").glob("*/manifest.json")).read_text())
    assert manifest["model"]["path"].endswith("models/target") and manifest["draft"]["draft_model"].endswith("models/draft")
    assert manifest["acceptance_rate"] > 0.5 and manifest["draft"]["shared_vision_trunk"], manifest["draft"]


@pytest.mark.parametrize("kv", ["fp32", "fp4"])
@pytest.mark.slow
def test_speculation_with_the_bundled_pair_is_lossless(kv):
    """Greedy answers with the bundled draft are token-identical to the target's alone, in one
    batch with prefix-cache hits (each page's queries share it) and chunked prefill (512-token
    chunks), with the float32 and the FP4 KV cache (the draft verifies against FP4 KV as stored)."""
    queries = load_queries().queries
    page = first_page("doc_2026_00006.jpg")
    reqs = [{"prompt": build_prompt(1, q.question), "multi_modal_data": {"image": [page]}}
            for q in queries if q.name in ("total", "all_fields")]
    params = SamplingParams(max_tokens=48)
    common = dict(device="cpu", dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=512)
    plain = LLM(str(MODELS / "target"), **common).generate(reqs, params)
    llm = LLM(str(MODELS / "target"), **common, speculative_model=str(MODELS / "draft"), num_speculative_tokens=4)
    spec = llm.generate(reqs, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_cached_tokens for o in spec) > 0  # later queries hit the page's prefix
    info = llm.spec_info()
    assert info["shared_vision_trunk"] and info["draft_accepted"] > 0


def test_the_draft_is_opt_in():
    from docproc.cli import resolve_draft
    from docproc.pipeline.settings import bundled_model

    bundled = str(bundled_model("draft"))
    assert resolve_draft(None) is None  # it does not pay on CPU or on an H200 (BENCHMARKS.md)
    assert resolve_draft("bundled") == bundled and resolve_draft("none") is None and resolve_draft("NONE") is None
    assert resolve_draft("/my/draft") == "/my/draft"
