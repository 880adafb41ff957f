"""The training script end to end at micro scale on CPU: tokenizer, joint training (both
curriculum phases), resume, draft distillation with the target's frozen trunk, export; the result loads in
transformers and in our engine, which detects the shared trunk."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from docproc import LLM, SamplingParams
from docproc.pipeline.queries import build_prompt

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    """scripts/train_tiny.py's command line, in this process: each stage in a process of its own paid
    transformers' modeling import again (8 s each on two cores)."""
    from fixtures.tiny_training import main

    with mock.patch.object(sys, "argv", ["train_tiny.py", *map(str, args)]):
        main()


@pytest.mark.slow
def test_micro_training_pipeline(tmp_path, monkeypatch):
    work, dest = tmp_path / "work", tmp_path / "models"
    common = ["--work", work, "--micro", "--batch", "2", "--band-batch", "3", "--workers", "0", "--eval-every", "2",
              "--eval-docs", "1", "--region-share", "0.5", "--distill-steps", "2"]
    run("tokenizer", "--work", work, "--micro")
    tok = json.loads((work / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|image_pad|>" in json.dumps(tok)
    run("train", *common, "--max-steps", "4", "--distill-steps", "0")
    state = json.loads((work / "state.json").read_text())
    assert state["step"] == 4 and {e["phase"] for e in state["log"]} == {"bands", "mixed"}
    assert 0 <= state["log"][-1]["acc_total"] <= 1 and 0 <= state["log"][-1]["bands_draft_agreement"] <= 1
    assert 0 <= state["log"][-1]["anchored_acc"] <= 1  # held-out PDFs with their anchor text
    run("train", *common, "--max-steps", "6", "--answer-weight", "currency=4",  # resumes, then distils the draft
        "--field-share", "0.5", "--spaced-answers", "currency", "--distill-weight", "currency=6",
        "--distill-bands", "2", "--scan-share", "0.7", "--receipt-share", "0.5")
    state = json.loads((work / "state.json").read_text())
    assert state["step"] == 6 and state["distill_step"] == 2 and state["log"][-1]["phase"] == "distill"
    assert 0 <= state["log"][-1]["fields_acc"] <= 1 and "fields_acc_currency" in state["log"][-1]
    assert [c["from_step"] for c in state["calls"]] == [0, 4] and "--field-share" in state["calls"][1]["argv"]
    run("export", "--work", work, "--to", dest)
    from transformers import Qwen2VLForConditionalGeneration

    for role in ("target", "draft"):
        from safetensors import safe_open

        for f in (dest / role).glob("*.safetensors"):  # exported in bf16, every tensor
            with safe_open(str(f), "pt") as st:
                assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
        assert all(f.stat().st_size < 16 << 20 for f in (dest / role).glob("*.safetensors"))
    t = {k: v for k, v in Qwen2VLForConditionalGeneration.from_pretrained(str(dest / "target")).model.visual
         .state_dict().items() if not k.startswith("merger.")}
    d = Qwen2VLForConditionalGeneration.from_pretrained(str(dest / "draft")).model.visual.state_dict()
    assert all(torch.equal(v, d[k]) for k, v in t.items())  # the draft's trunk is the target's
    # the evaluation script that produces the model card's figures, on the micro pair
    report_file = tmp_path / "report.json"
    evaluate_pair = [str(ROOT / "scripts" / "evaluate_pair.py"), "--target", str(dest / "target"),
                    "--draft", str(dest / "draft"), "--count", "1", "--seed", "3", "--work", str(tmp_path / "ep"),
                    "--json", str(report_file), "--device", "cpu", "--kv", "fp32,fp4",
                    "--card", str(tmp_path / "MODEL_CARD.md"), "--state", str(work / "state.json"), "--anchor-text", "--spec-docs", "1",
                    "--speed", "--speed-docs", "1", "--speed-repeats", "1", "--speed-batches", "4"]
    monkeypatch.chdir(ROOT)
    # (in this process, as the stages above; a script's own folder is first on the path)
    with mock.patch.object(sys, "argv", evaluate_pair), mock.patch.object(sys, "path", [str(ROOT / "scripts"), *sys.path]):
        runpy.run_path(evaluate_pair[0], run_name="__main__")
    report = json.loads(report_file.read_text())
    names = {"vendor", "invoice_number", "date", "due_date", "currency", "total", "all_fields"}
    assert set(report["eval"]) == {"fp32", "fp4"} and report["eval"]["fp32"]["documents"] == 1
    assert 0 <= report["eval"]["fp4"]["overall_exact_match"] <= 1
    assert 0 <= report["kv_comparison"]["identical_answers"] <= 1
    assert report["speculation"]["answers_identical_to_plain"] is True  # greedy speculation is lossless
    assert report["speculation"]["documents"] == 1  # --spec-docs 1: the speculation checks on the first one
    assert set(report["speculation"]["acceptance_per_query"]) == names
    assert set(report["draft_agreement"]["per_query"]) == names
    assert all(0 <= v["agreement"] <= 1 and v["tokens"] > 0 for v in report["draft_agreement"]["per_query"].values())
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "byte for byte the target's: True" in card and "steps: target 6, draft distillation 2" in card
    assert f"Overall field exact match {report['eval']['fp32']['overall_exact_match']:.3f}" in card
    assert report["eval_anchor_text"]["documents"] == 1 and "With `--anchor-text`" in card
    # the speed workload: every configuration alternated with plain, a second plain engine as the
    # noise floor, paired ratios; greedy answers identical in every configuration
    rows = report["speed"]["configs"]
    assert {f"{c}_batch{b}" for c in ("plain", "plain_again", "draft_adaptive", "draft_k4", "draft_text_only_adaptive")
            for b in (4,)} == set(rows)
    assert all(r["answers_identical_to_plain"] for r in rows.values())
    assert all(r["speedup_paired_range"][0] <= r["speedup_paired_median"] <= r["speedup_paired_range"][1]
               for name, r in rows.items() if not name.startswith("plain_batch"))

    llm = LLM(str(dest / "target"), device="cpu", speculative_model=str(dest / "draft"), num_speculative_tokens=2)
    from PIL import Image

    out = llm.generate([{"prompt": build_prompt(1, "What is the total?"),
                         "multi_modal_data": {"image": [Image.new("RGB", (200, 260), "white")]}}],
                       SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.spec_info()["shared_vision_trunk"]


def test_dense_reading_targets_follow_the_processor_patch_order():
    """The trunk's per-patch character targets must land on the patch the processor puts the
    glyph in (2x2 merge blocks row-major, then row-major inside), in the right half-patch slot."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import fixtures.tiny_training as T

    proc = Qwen2VLImageProcessorPil(**T.IMAGE)
    for w, h, x0, y0, slot in [(280, 112, 98, 42, 0), (280, 112, 245, 84, 1), (560, 84, 490, 14, 0)]:
        a = np.full((h, w, 3), 255, np.uint8)
        a[y0:y0 + 14, x0:x0 + 7] = 0  # a dark half-patch where the "glyph" is
        pv = proc(images=[Image.fromarray(a)], return_tensors="pt")["pixel_values"]
        dark = (pv.view(pv.shape[0], 3, 2, 14, 14).mean((1, 2, 3, 4)) < 1.0).nonzero().flatten().tolist()
        targets = T.char_targets([(x0 + 3.5, y0 + 7, 5)], w, h, lambda x, y: (x, y))
        assert targets.shape == (pv.shape[0], 2)
        hit = (targets > 0).any(-1).nonzero().flatten().tolist()
        assert hit == dark and len(hit) == 1
        assert targets[hit[0], slot] == 5 and targets[hit[0], 1 - slot] == 0
        # merged image tokens: token k is patches 4k..4k+3; four 7-pixel columns per token
        tokens = T.char_targets([(x0 + 3.5, y0 + 7, 5)], w, h, lambda x, y: (x, y), merged=True)
        assert tokens.shape == (pv.shape[0] // 4, 4)
        tok_hit = (tokens > 0).any(-1).nonzero().flatten().tolist()
        assert tok_hit == [dark[0] // 4] and tokens[tok_hit[0]].tolist().index(5) == (x0 % 28) // 7


def test_bands_sit_on_the_token_grid_so_the_processor_keeps_their_scale():
    from PIL import Image

    import fixtures.tiny_training as T

    for w, h in [(600, 40), (30, 20), (812, 141)]:
        c = T.on_token_grid(Image.new("RGB", (w, h), "black"))
        assert c.width % 28 == 0 and c.height % 28 == 0 and c.width >= w and c.height >= h
        assert T.inference_size(c.height, c.width) == (c.height, c.width)  # no rescaling
        assert c.getpixel((w - 1, h - 1)) == (0, 0, 0) and c.getpixel((c.width - 1, c.height - 1)) == (255, 255, 255)


def test_page_reading_targets_land_on_ink_for_clean_and_rotated_scans():
    """The text layer's character positions, mapped through the render DPI and the scan's rotation,
    fall on patches that hold ink; shifted by a few patches they mostly do not."""
    import random

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import fixtures.tiny_training as T
    from fixtures.documents import draw_pdf, make_spec, scan_pages

    proc = Qwen2VLImageProcessorPil(**T.IMAGE)
    spec = make_spec(random.Random(4), "x", kind="invoice", max_pages=1)
    doc = draw_pdf(spec)
    info: list[dict] = []
    scans = scan_pages(doc, random.Random(9), info=info)
    pix = doc[0].get_pixmap(dpi=120)
    clean = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
    chars = T.page_chars(doc[0])
    for img, made in ((clean, {"dpi": 120, "angle": 0.0}), (scans[0], info[0])):
        if made is info[0]:
            assert abs(made["angle"]) > 0.01  # this scan is rotated
        pv = proc(images=[img], return_tensors="pt")["pixel_values"]
        ink = pv.view(pv.shape[0], 3, 2, 14, 14).amin((1, 2, 3, 4)) < 0.0  # some dark pixel in the patch
        f = T.page_to_pixels(made["dpi"], made["angle"], img.width, img.height)
        targets = T.char_targets(chars, img.width, img.height, f)
        labelled = (targets > 0).any(-1)
        assert labelled.sum() > 100 and ink[labelled].float().mean() > 0.97, (labelled.sum(), ink[labelled].float().mean())
        shifted = T.char_targets(chars, img.width, img.height, lambda x, y: (f(x, y)[0], f(x, y)[1] + 40))
        assert ink[(shifted > 0).any(-1)].float().mean() < ink[labelled].float().mean() - 0.2


@pytest.mark.slow
def test_shared_feature_forward_equals_transformers_forward(tmp_path):
    """Training encodes a document's pages once and scatters the features into each query's row,
    with M-RoPE positions from get_rope_index; the answer logits must be those of transformers'
    own forward on each row with its own pixels (float32)."""
    import fixtures.tiny_training as T

    run("tokenizer", "--work", tmp_path, "--micro")
    torch.manual_seed(0)
    target, tok = T.build(tmp_path, "micro-target")
    draft, _ = T.build(tmp_path, "micro-draft")
    target.eval()
    pad, image_id = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")
    docs = [ex for _, ex in zip(range(3), T.Examples(tmp_path, "pages", 5, tag="check", page_aux=False))]
    b = T.collate(docs, pad)
    step = T.Step(target, draft, image_id)
    with torch.no_grad():
        feats, _ = step.features(b)
        logits, _, sel = step.logits(target, b, feats, step.positions(b))
        offsets = [0] + b["image_grid_thw"].prod(-1).cumsum(0).tolist()
        k = 0
        for r in range(b["input_ids"].shape[0]):
            first, last = b["doc_images"][b["row_doc"][r]].tolist()
            n = int(b["attention_mask"][r].sum())
            ids = b["input_ids"][r:r + 1, :n]
            ref = target(input_ids=ids, pixel_values=b["pixel_values"][offsets[first]:offsets[last]],
                         image_grid_thw=b["image_grid_thw"][first:last], mm_token_type_ids=(ids == image_id).int(),
                         attention_mask=torch.ones_like(ids)).logits[0, :-1][sel[r, :n - 1]]
            assert torch.allclose(ref, logits[k:k + len(ref)], atol=1e-5), r
            k += len(ref)
    assert k == logits.shape[0] and b["input_ids"].shape[0] == 3 * 7


def test_training_anchor_text_is_the_pipelines(tmp_path):
    """A document trained with anchor text sees exactly the anchor `docproc run --anchor-text`
    builds from the PDF file on disk."""
    import random

    import fixtures.tiny_training as T
    from fixtures.documents import draw_pdf, make_spec

    from docproc.pipeline.ingest import discover, open_document
    from docproc.pipeline.documents import window_anchor

    spec = make_spec(random.Random(5), "a5", max_pages=3)
    doc = draw_pdf(spec)
    path = tmp_path / "a5.pdf"
    doc.save(str(path))
    opened = open_document(discover([str(tmp_path)])[0], with_text=True)
    want = window_anchor([opened.page(i) for i in range(opened.num_pages)])
    assert want and "Page size:" in want and T.doc_anchor(doc) == want


def test_distill_weights_scale_their_rows_tokens_and_the_reading_question_weighs_one():
    from fixtures.tiny_training import distill_loss

    torch.manual_seed(0)
    labels = torch.full((3, 5), -100)
    labels[0, 1:3] = 1  # the reading question (query -1): 2 tokens
    labels[1, 2:5] = 2  # query 0: 3 tokens
    labels[2, 4] = 3  # query 1: 1 token
    t, d = torch.randn(6, 7), torch.randn(6, 7)
    kl = torch.nn.functional.kl_div(torch.log_softmax(d, -1), torch.log_softmax(t, -1), log_target=True,
                                    reduction="none").sum(-1)
    batch = {"labels": labels, "row_query": torch.tensor([-1, 0, 1])}
    even = distill_loss(d, t, batch, torch.ones(3))
    assert torch.allclose(even, torch.nn.functional.kl_div(torch.log_softmax(d, -1), torch.log_softmax(t, -1),
                                                           log_target=True, reduction="batchmean"))
    heavy = distill_loss(d, t, batch, torch.tensor([1.0, 6.0, 1.0]))  # query 1 weighs 6
    assert torch.allclose(heavy, (kl[:5].sum() + 6 * kl[5]) / 11)


def test_answer_weights_scale_their_rows_tokens():
    from fixtures.tiny_training import answer_loss

    torch.manual_seed(0)
    labels = torch.full((2, 6), -100)
    labels[0, 2:4] = torch.tensor([1, 2])  # row 0 answers with 2 tokens, row 1 with 3
    labels[1, 3:6] = torch.tensor([3, 4, 5])
    sel = labels[:, 1:] != -100
    gold = labels[:, 1:][sel]
    logits = torch.randn(len(gold), 8)
    ce = torch.nn.functional.cross_entropy(logits, gold, reduction="none")
    even = answer_loss(logits, gold, {"labels": labels, "row_weight": torch.tensor([1.0, 1.0])})
    assert torch.allclose(even, ce.mean())
    heavy = answer_loss(logits, gold, {"labels": labels, "row_weight": torch.tensor([4.0, 1.0])})
    assert torch.allclose(heavy, (4 * ce[:2].sum() + ce[2:].sum()) / 11)


@pytest.mark.slow
def test_saving_keeps_the_float32_weights_and_a_same_step_resume_restores_them(tmp_path):
    """Checkpoints are bf16, but saving must not round the live float32 weights, and a resume
    from the same step (on the machine that trained) continues from the float32 weights."""
    import fixtures.tiny_training as T

    run("tokenizer", "--work", tmp_path, "--micro")
    torch.manual_seed(0)
    target, tok = T.build(tmp_path, "micro-target")
    draft, _ = T.build(tmp_path, "micro-draft")
    with torch.no_grad():
        for p in list(target.parameters()) + list(draft.parameters()):
            p.add_(torch.randn_like(p) * 1e-4)  # values bf16 cannot hold
    before = {k: v.clone() for k, v in target.state_dict().items()}
    step_fn = T.Step(target, draft, tok.convert_tokens_to_ids("<|image_pad|>"))
    step_fn.heads = torch.nn.ModuleDict({"x": torch.nn.Linear(2, 2)})
    state = {"step": 7, "distill_step": 0, "log": []}
    T.save_all(tmp_path, step_fn, tok, {}, state)
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the live weights are untouched
    loaded, _ = T.load_or_build(tmp_path, "target", "micro-target", torch.device("cpu"))
    loaded_d, _ = T.load_or_build(tmp_path, "draft", "micro-draft", torch.device("cpu"))
    assert not all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())  # bf16 on disk
    assert not T.load_fp32(tmp_path, {"step": 8, "distill_step": 0}, loaded, loaded_d)  # another step
    assert T.load_fp32(tmp_path, state, loaded, loaded_d)
    assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())


@pytest.mark.slow
def test_field_crops_ask_only_what_they_show_and_spaced_answers_keep_the_value(tmp_path):
    """A field crop asks a field's query only when the crop's own text (its reading answer) shows
    the field's value; currency answers can be spelled as read (" CHF"); every field is found."""
    import random

    import fixtures.tiny_training as T
    from fixtures.documents import draw_pdf, make_spec
    from transformers import AutoTokenizer

    from docproc.pipeline.queries import load_queries

    spec = make_spec(random.Random(11), "f11", kind="invoice", max_pages=1)
    rows = T.text_rows(draw_pdf(spec)[0])
    holds = T.field_rows(spec, rows)
    assert all(holds[f] for f in ("vendor", "invoice_number", "date", "currency", "total"))
    assert all(spec.printed[f] in rows[i][4] for f, idx in holds.items() for i in idx)
    assert len(holds["currency"]) == 2  # the "Currency:" row and the total's "(CHF)"

    work = tmp_path / "w"
    (work / "tokenizer").parent.mkdir(parents=True)
    AutoTokenizer.from_pretrained(str(ROOT / "docproc" / "assets" / "models" / "target")).save_pretrained(str(work / "tokenizer"))
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    queries = load_queries().queries
    ds = T.Examples(work, "bands", 3, field_share=1.0, spaced=("currency",), page_aux=False)
    asked = 0
    for ex, _ in zip(ds, range(24)):
        assert len(ex["rows"]) == len(ex["row_query"]) and ex["row_query"][0] == -1
        answers = [tok.decode([t for t in lab if t != -100 and t != end]) for _, lab in ex["rows"]]
        for qi, ans in zip(ex["row_query"][1:], answers[1:]):
            asked += 1
            assert ans.strip() and ans.strip() in answers[0]  # the crop shows the value it is asked for
            assert ans.startswith(" ") == (queries[qi].name == "currency")
    assert asked >= 24  # every crop asks at least one field's query

    pages = T.Examples(work, "pages", 3, spaced=("currency",), page_aux=False, max_pages=1)
    ex = next(iter(pages))
    cur = [q.name for q in queries].index("currency")
    assert tok.decode([t for t in ex["rows"][cur][1] if t != -100 and t != end]) == " " + \
        tok.decode([t for t in ex["rows"][-1][1] if t != -100]).split('"currency": "')[1][:3]

    # --receipt-share picks the document kind: receipts have no due date ("none")
    due = [q.name for q in queries].index("due_date")
    for share, receipt in ((1.0, True), (0.0, False)):
        mixed = T.Examples(work, "pages", 3, page_aux=False, max_pages=1, receipt_share=share)
        for ex, _ in zip(mixed, range(3)):
            ans = tok.decode([t for t in ex["rows"][due][1] if t != -100 and t != end])
            assert (ans == "none") == receipt, (share, ans)


def test_repair_gives_collapsed_tokens_their_spaced_twins_embedding():
    import fixtures.tiny_training as T
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "docproc" / "assets" / "models" / "target"))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(len(tok), 8)

        def get_input_embeddings(self):
            return self.e

    torch.manual_seed(0)
    m = M()
    codes = ["EUR", "CHF"]
    ids = [tok.convert_tokens_to_ids(c) for c in codes]
    with torch.no_grad():
        m.e.weight[ids] = torch.tensor([1.0] * 8)  # collapsed: identical rows
    other = m.e.weight.clone()
    cos = T.repair_tokens(tok, (m,), codes)
    assert cos == {"EUR": 1.0, "CHF": 1.0}
    for c, i in zip(codes, ids):
        assert torch.equal(m.e.weight[i], other[tok.convert_tokens_to_ids("\u0120" + c)])
    keep = torch.ones(len(tok), dtype=torch.bool)
    keep[ids] = False
    assert torch.equal(m.e.weight[keep], other[keep])
