"""Does the target read the currency code, and does its currency answer use what it read?

For every born-digital document in the --docs folder whose first page has a "Currency: XXX" row,
the page is rendered as `docproc run` renders it, scaled as the processor scales it, and the row
is cut out on the 28-pixel token grid (as the training's reading bands are). On that one crop, two next-token
distributions of the target (transformers' forward, float32, CPU):

- the answer to the currency query ("What is the currency code?"), over the six codes, each
  code's probability that of both spellings ("CHF", as runs 1-6 answered, plus " CHF", as the
  currency answer is trained since run 7, `train_tiny.py --spaced-answers currency`);
- reading: the band question ("Read the text in the image.") with the answer begun as
  "Currency:", over the codes as the text after that label tokenizes (" CHF", with the space).

    python scripts/probe_currency.py --model docproc/assets/models/target --docs sample_docs

Prints one line per document and, at the end, how often each distribution's top code is the
truth. First it prints the code tokens' rows of the (tied) embedding table: their norms against the
table's mean row norm and their cosines with each other, for the bare codes and for the spaced
ones (run 6's bare codes had collapsed: BENCHMARKS.md, run 7). Truth comes from the folder's truth.jsonl (the generator writes it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
CODES = ("EUR", "USD", "GBP", "CHF", "CAD", "SEK")


def next_token_probs(model, tok, proc, image, question: str, answer_prefix: str = "") -> torch.Tensor:
    from docproc.pipeline.queries import IMAGE_PLACEHOLDER, build_prompt

    pv = proc(images=[image], return_tensors="pt")
    grid = pv["image_grid_thw"]
    before, after = build_prompt(1, question).split(IMAGE_PLACEHOLDER)
    pads = "<|image_pad|>" * int(grid[0].prod() // 4)
    text = before + IMAGE_PLACEHOLDER.replace("<|image_pad|>", pads) + after + answer_prefix
    ids = torch.tensor([tok.encode(text)])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pv["pixel_values"], image_grid_thw=grid,
                       mm_token_type_ids=(ids == image_id).int(), attention_mask=torch.ones_like(ids)).logits
    return logits[0, -1].float().softmax(-1)


def main() -> None:
    import pymupdf
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    from fixtures.tiny_training import PAGE_DPI, READ_QUESTION, on_token_grid

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "docproc" / "assets" / "models" / "target"))
    ap.add_argument("--docs", default=str(ROOT / "sample_docs"))
    ap.add_argument("--json", help="write the per-document figures here")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = Qwen2VLForConditionalGeneration.from_pretrained(a.model, dtype=torch.float32).eval()
    proc = Qwen2VLImageProcessorPil.from_pretrained(a.model)
    answer_ids = {c: tok.encode(c) for c in CODES}
    read_ids = {c: tok.encode(" " + c) for c in CODES}
    if any(len(v) != 1 for v in list(answer_ids.values()) + list(read_ids.values())):
        raise SystemExit("this tokenizer does not spell every code as one token: the probe assumes it does")
    emb = model.get_input_embeddings().weight.float()
    mean_norm = emb.norm(dim=-1).mean().item()
    for label, ids in (("bare", answer_ids), ("spaced", read_ids)):
        rows = emb[[v[0] for v in ids.values()]]
        unit = torch.nn.functional.normalize(rows, dim=-1)
        cos = (unit @ unit.T)[~torch.eye(len(CODES), dtype=torch.bool)]
        print(f"embedding rows of the {label} codes: norm {rows.norm(dim=-1).min().item():.2f}-"
              f"{rows.norm(dim=-1).max().item():.2f} (table mean {mean_norm:.2f}); cosine with each other "
              f"{cos.min().item():.2f}-{cos.max().item():.2f}")
    truth = {json.loads(line)["file"]: json.loads(line) for line in open(Path(a.docs) / "truth.jsonl")}
    rows = []
    for name, t in sorted(truth.items()):
        if not name.endswith(".pdf"):
            continue
        page = pymupdf.open(Path(a.docs) / name)[0]
        hits = page.search_for("Currency:")
        if not hits:
            continue
        pix = page.get_pixmap(dpi=PAGE_DPI)
        img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        h, w = smart_resize(img.height, img.width, factor=28, min_pixels=proc.size["shortest_edge"],
                            max_pixels=proc.size["longest_edge"])
        img = img.resize((w, h), Image.BICUBIC)
        s = w / page.rect.width
        r = hits[0]
        crop = on_token_grid(img.crop(tuple(int(v * s) for v in (r.x0 - 4, r.y0 - 3, r.x1 + 40, r.y1 + 3))))
        qa = next_token_probs(model, tok, proc, crop, "What is the currency code?")
        read = next_token_probs(model, tok, proc, crop, READ_QUESTION, "Currency:")
        row = {"file": name, "truth": t["fields"]["currency"],
               "answer": {c: round(qa[answer_ids[c][0]].item() + qa[read_ids[c][0]].item(), 3) for c in CODES},
               "reading": {c: round(read[read_ids[c][0]].item(), 3) for c in CODES}}
        rows.append(row)
        print(f"{name}: truth {row['truth']}  answer {row['answer']}  reading after 'Currency:' {row['reading']}")
    if not rows:
        raise SystemExit(f"no PDF in {a.docs} has a 'Currency:' row")
    for kind in ("answer", "reading"):
        right = sum(max(r[kind], key=r[kind].get) == r["truth"] for r in rows)
        mean_p = sum(r[kind][r["truth"]] for r in rows) / len(rows)
        print(f"{kind}: top code right on {right} of {len(rows)}; mean probability of the truth {mean_p:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "docs": a.docs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
