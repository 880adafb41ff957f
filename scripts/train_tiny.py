"""Train the bundled default pair (target and draft) on synthetic documents, on the device GPU.

    python scripts/train_tiny.py tokenizer --work WORK
    python scripts/train_tiny.py train --work WORK --minutes 9 --target-minutes 22   # again to resume
    python scripts/train_tiny.py export --work WORK --to docproc/assets/models

One process trains both models. Every step encodes each document's pages once with the target's
vision tower and trains the target on all of the document's queries (the rows share the image
features, as the engine's prefix cache shares them at inference). The draft learns in the same
step from the target's trunk output, detached (its trunk is the target's and never receives a
gradient): its own merger and small LM, on the answers' cross-entropy. After the target's last
step the target is frozen and the draft is distilled from it (KL on the answer positions).

Curriculum: the first --region-share of the target's steps read bands of 1 to 5 text rows cut
from a page at exactly the scale the page has at inference ("Read the text in the image.",
answer = the rows' text layer); afterwards whole documents with every query of the default set,
with one band batch in four to keep the reading signal. Half of all images are "scans"
(rotation, blur, noise, JPEG); --anchor-share of the born-digital documents carry their text
layer in the prompt exactly as `docproc run --anchor-text` builds it. Examples are drawn by DataLoader workers on the CPU cores.

Dense reading losses (training-only linear heads, not saved in the checkpoints): from each band's
text layer, the character centred in each half of every 14x14 patch (on the trunk's output) and in
each 7-pixel column of every merged 28x28 image token (on the target's and the draft's merger
outputs, which is what their LMs read). Without them nothing learned to read in 8 minutes; with
the trunk's, glyph accuracy reached 0.76 in 6 minutes (BENCHMARKS.md). Bands have at most
--first-band-rows rows during the bands-only phase, then up to 5; a band sits on a white canvas of
whole 28-pixel tokens, so the processor keeps its glyphs at their page scale. Whole pages get the
same dense targets (--page-aux; a scan's rotation is applied to the text layer's positions), about
five times the glyphs of a band batch per step.

Field crops (--field-share): that share of the text bands is cut around the row of one field
(currency three times as often as each other field) and asks, besides the reading question, the
query of every field the band shows with its label, as the default query set asks it: the
question's path gets a signal concentrated on a few image tokens. --spaced-answers trains the
named queries' answers with a leading space (" CHF", the token read after "Currency:"); the
pipeline's parser strips it. --repair-tokens gives tokens whose tied embedding collapsed while
their answer was unpredictable the embedding of their spaced twin, once (run 7 in BENCHMARKS.md:
the currency query went from chance to 0.92 teacher-forced with these three).

Every eval reports, on held-out documents, the target's teacher-forced whole-answer accuracy per
query and on bands, the same with each document's features swapped for another document's (it
must collapse if the image reaches the answer), the draft's top-1 agreement with the target, and the dense heads' glyph accuracy on bands.
Each stage resumes from WORK (weights, optimizer state, step): on a warm device the optimizer
state and the float32 weights are there; carried back through $OUT only the bf16 weights travel
(the optimizer restarts, with a short warm-up). Raising --target-minutes after a finished plan
trains the target again and then distils the draft again. `--micro` shrinks everything to run a
few steps on a CPU (the tests do).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from docproc.pipeline.queries import build_prompt, load_queries  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2, merge_size=2,
             image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
PAGE_DPI = 120  # `docproc run`'s default render resolution
READ_QUESTION = "Read the text in the image."
SIZES = {  # (vision depth, width, heads), (LM hidden, layers, heads, kv heads, ffn), vocab
    "target": dict(vision=(6, 256, 4), text=(384, 6, 6, 2, 1024), vocab=4096),
    "draft": dict(vision=(6, 256, 4), text=(192, 4, 3, 1, 512), vocab=4096),
    "micro-target": dict(vision=(1, 32, 2), text=(64, 1, 2, 1, 128), vocab=512),
    "micro-draft": dict(vision=(1, 32, 2), text=(64, 1, 2, 1, 128), vocab=512),
}


# ---- tokenizer ------------------------------------------------------------------------------------
def answers_json(printed: dict) -> dict:
    return {k: printed[k] for k in ("vendor", "invoice_number", "date", "due_date", "currency", "total")}


def corpus(n_docs: int, seed: int):
    """The text layers of generated documents, their answers, and every prompt string."""
    from make_synthetic_docs import draw_pdf, make_spec

    from docproc.pipeline.queries import SYSTEM_PROMPT

    for q in load_queries().queries:
        yield q.question
    yield SYSTEM_PROMPT
    yield READ_QUESTION
    for i in range(n_docs):
        spec = make_spec(random.Random(f"tok:{seed}:{i}"), f"t{i}")
        doc = draw_pdf(spec)
        yield "\n".join(row for _, _, _, _, row in text_rows(doc[0]))
        yield json.dumps(answers_json(spec.printed))
        if i % 4 == 0:  # the anchor text's "[x,y]" lines, as --anchor-text prompts carry them
            yield doc_anchor(doc)


def train_tokenizer(work: Path, vocab: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits one by one (as they are drawn, glyph by glyph), then byte-level BPE
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(400 if vocab > 1024 else 40, seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(work / "tokenizer"))


# ---- data ----------------------------------------------------------------------------------------------
def doc_anchor(doc) -> str | None:
    """The anchor text `docproc run --anchor-text` puts in the prompt of a document's window of
    these pages (the pipeline's own functions, so training sees exactly the inference prompt)."""
    from types import SimpleNamespace

    from docproc.pipeline.ingest import anchor_text
    from docproc.pipeline.run import window_anchor

    return window_anchor([SimpleNamespace(index=i, text=anchor_text(page)) for i, page in enumerate(doc)])


def text_rows(page) -> list[tuple[float, float, float, float, str]]:
    """The page's text layer as rows (x0, y0, x1, y1, text) top-down: lines whose vertical centres
    are within 3 pt are one row, read left to right."""
    from docproc.pipeline.ingest import text_lines

    lines = text_lines(page)
    lines.sort(key=lambda t: ((t[1] + t[3]) / 2, t[0]))
    rows: list[list] = []
    for ln in lines:
        if rows and abs((ln[1] + ln[3]) / 2 - (rows[-1][0][1] + rows[-1][0][3]) / 2) < 3:
            rows[-1].append(ln)
        else:
            rows.append([ln])
    out = []
    for r in rows:
        r.sort(key=lambda t: t[0])
        out.append((min(t[0] for t in r), min(t[1] for t in r), max(t[2] for t in r), max(t[3] for t in r),
                    " ".join(t[4] for t in r)))
    return out


AUX_CLASSES = 97  # 0: no glyph centre here; 1..95: printable ASCII; 96: any other character


def page_chars(page) -> list[tuple[float, float, int]]:
    """Every drawn character's centre (page points) and class, from the text layer."""
    out = []
    for b in page.get_text("rawdict")["blocks"]:
        for ln in b.get("lines", []):
            for sp in ln["spans"]:
                for ch in sp["chars"]:
                    if ch["c"].strip():
                        x0, y0, x1, y1 = ch["bbox"]
                        o = ord(ch["c"])
                        out.append(((x0 + x1) / 2, (y0 + y1) / 2, o - 31 if 32 < o < 127 else 96))
    return out


def char_targets(chars, width: int, height: int, to_pixels, merged: bool = False) -> torch.Tensor:
    """Dense reading targets, for the image as the processor resizes it: the class of the
    character whose centre falls in each slot (0 if none). Patch level (the trunk's output): each
    14x14 patch has a left and a right half, in the processor's patch order (2x2 merge blocks
    row-major, then row-major inside). merged=True (the LM's image tokens): each 28x28 token has
    four 7-pixel columns, in token order (row-major)."""
    rh, rw = inference_size(height, width)
    fx, fy = rw / width, rh / height
    cell, slots = (28, 4) if merged else (14, 2)
    gh, gw = rh // cell, rw // cell
    grid = torch.zeros((gh, gw, slots), dtype=torch.long)
    for cx, cy, cls in chars:
        px, py = to_pixels(cx, cy)
        px, py = px * fx, py * fy
        if 0 <= px < rw and 0 <= py < rh:
            grid[int(py // cell), int(px // cell), int((px % cell) * slots // cell)] = cls
    if merged:
        return grid.reshape(-1, slots)
    return grid.reshape(gh // 2, 2, gw // 2, 2, 2).permute(0, 2, 1, 3, 4).reshape(-1, 2)


def page_to_pixels(dpi: float, angle: float, width: int, height: int):
    """Page points -> pixels of a page rendered at dpi and then rotated counter-clockwise by angle
    degrees about the image centre (as `degrade` does)."""
    s, t = dpi / 72.0, math.radians(angle)
    cos, sin, cx, cy = math.cos(t), math.sin(t), width / 2, height / 2

    def to_pixels(x: float, y: float) -> tuple[float, float]:
        px, py = x * s - cx, y * s - cy
        return cx + px * cos + py * sin, cy - px * sin + py * cos

    return to_pixels


def on_token_grid(crop):
    """The crop on a white canvas whose sides are whole 28-pixel image tokens (and at least the
    processor's minimum area), so that the processor does not rescale it: a band's glyphs keep
    exactly the size they have on the page at inference (the processor would otherwise stretch a
    40-pixel band to 28 or 56)."""
    from PIL import Image

    w, h = -(-crop.width // 28) * 28, -(-crop.height // 28) * 28
    while w * h < IMAGE["min_pixels"]:
        w += 28
    canvas = Image.new("RGB", (w, h), (255, 255, 255))
    canvas.paste(crop, (0, 0))
    return canvas


def inference_size(h: int, w: int) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(h, w, factor=28, min_pixels=IMAGE["min_pixels"], max_pixels=IMAGE["max_pixels"])


def field_rows(spec, rows) -> dict[str, list[int]]:
    """For each single-value field, the indices of the text rows that show it with its label (a
    crop of those rows answers the field's query): the vendor's name row, the "Invoice no." /
    "Receipt no.", "Date", "Due date" and "Currency" rows, the total's row ("Total (CHF) 1,234.56",
    which shows the currency too)."""
    p = spec.printed
    label = "Invoice no." if spec.kind == "invoice" else "Receipt no."
    total_row = f"{spec.total_label} ({p['currency']})"
    tests = {"vendor": lambda t: t == p["vendor"] or t.startswith(p["vendor"] + " "),
             "invoice_number": lambda t: f"{label}: {p['invoice_number']}" in t
             or (f"{label}:" in t and t.endswith(" " + p["invoice_number"])),
             "date": lambda t: f"Date: {p['date']}" in t,
             "due_date": lambda t: bool(p["due_date"]) and f"Due date: {p['due_date']}" in t,
             "currency": lambda t: f"Currency: {p['currency']}" in t or total_row in t,
             "total": lambda t: total_row in t and t.endswith(p["total"])}
    return {name: [i for i, r in enumerate(rows) if test(r[4])] for name, test in tests.items()}


class Examples(torch.utils.data.IterableDataset):
    """Endless documents, each {"pixel_values", "image_grid_thw", "rows": [(ids, labels)]}, drawn in
    the worker that asks. kind "bands": one band of text rows per item, one row; kind "pages": a
    whole document, one row per query of the default set."""

    def __init__(self, work: Path, kind: str, seed: int, scan_fraction: float = 0.5, max_pages: int = 3,
                 tag: str = "train", band_rows: int = 5, page_aux: bool = True, anchor_share: float = 0.0,
                 answer_weights: dict[str, float] | None = None, field_share: float = 0.0,
                 spaced: tuple[str, ...] = (), receipt_share: float | None = None) -> None:
        self.work, self.kind, self.seed, self.scan_fraction, self.max_pages = work, kind, seed, scan_fraction, max_pages
        self.tag, self.band_rows, self.page_aux, self.anchor_share = tag, band_rows, page_aux, anchor_share
        self.answer_weights = answer_weights or {}
        self.field_share, self.spaced = field_share, tuple(spaced)
        self.receipt_share = receipt_share  # None: the generator's own mix (a third receipts)

    def answer(self, q, printed: dict) -> str:
        """The trained answer of a single-field query: the printed value, with a leading space for
        the queries in `spaced` (spelled as it is read after its label, e.g. " CHF" after
        "Currency:"; the pipeline's parser strips it)."""
        v = printed.get(q.name)
        return "none" if not v else (" " + v if q.name in self.spaced else v)

    def __iter__(self):
        import numpy as np
        from PIL import Image
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from make_synthetic_docs import degrade, draw_pdf, make_spec, scan_pages

        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tok = AutoTokenizer.from_pretrained(str(self.work / "tokenizer"))
        proc = Qwen2VLImageProcessorPil(**IMAGE)
        queries = load_queries().queries
        i = 0
        while True:
            rng = random.Random(f"{self.tag}:{self.kind}:{self.seed}:{wid}:{i}")
            nrng = np.random.default_rng(rng.randrange(2**32))
            i += 1
            scan = rng.random() < self.scan_fraction
            kind = None if self.receipt_share is None else \
                ("receipt" if rng.random() < self.receipt_share else "invoice")
            spec = make_spec(rng, f"w{wid}_{i}", kind=kind, max_pages=self.max_pages if self.kind == "pages" else 1)
            doc = draw_pdf(spec)
            if self.kind == "bands":
                page = doc[0]
                pix = page.get_pixmap(dpi=rng.choice([100, PAGE_DPI, PAGE_DPI, 144]))
                img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
                h, w = inference_size(img.height, img.width)
                img = img.resize((w, h), Image.BICUBIC)  # the scale this page has at inference
                sx, sy = w / page.rect.width, h / page.rect.height
                rows = text_rows(page)
                chars = page_chars(page)
                holds = field_rows(spec, rows)
                fields = [q for q in queries if holds.get(q.name)]
                for _ in range(4):
                    asked = []
                    if fields and rng.random() < self.field_share:
                        # a field crop: a band around one field's row (currency three times as
                        # often), asked that field's query and any other field's it shows
                        q = rng.choices(fields, [3.0 if q.name == "currency" else 1.0 for q in fields])[0]
                        j = rng.choice(holds[q.name])
                        n = rng.randint(1, self.band_rows)
                        a = rng.randint(max(0, j - n + 1), j)
                        asked = [q for q in fields if any(a <= k < a + n for k in holds[q.name])]
                    else:
                        a, n = rng.randrange(len(rows)), rng.randint(1, self.band_rows)
                    sel = rows[a: a + n]
                    m = rng.uniform(2, 10)
                    box = (max(0, min(r[0] for r in sel) * sx - m), max(0, sel[0][1] * sy - m),
                           min(w, max(r[2] for r in sel) * sx + m), min(h, max(r[3] for r in sel) * sy + m))
                    ibox = tuple(int(round(v)) for v in box)
                    crop = on_token_grid(img.crop(ibox))
                    if scan:
                        crop = degrade(crop, rng, nrng, max_angle=0.3)
                    ex = self._encode(tok, proc, [crop], [(READ_QUESTION, "\n".join(r[4] for r in sel))]
                                      + [(q.question, self.answer(q, spec.printed)) for q in asked])
                    ex["row_query"] = [-1] + [queries.index(q) for q in asked]
                    to_px = lambda x, y: (x * sx - ibox[0], y * sy - ibox[1])  # noqa: E731
                    ex["aux"] = char_targets(chars, crop.width, crop.height, to_px)
                    ex["aux_tok"] = char_targets(chars, crop.width, crop.height, to_px, merged=True)
                    yield ex
            else:
                if scan:
                    made: list[dict] = []
                    pages = scan_pages(doc, rng, info=made)
                else:
                    dpi = rng.choice([100, PAGE_DPI, PAGE_DPI, 144])
                    pages, made = [], []
                    for page in doc:
                        pix = page.get_pixmap(dpi=dpi)
                        pages.append(Image.frombytes("RGB", (pix.width, pix.height), pix.samples))
                        made.append({"dpi": dpi, "angle": 0.0})
                qa = []
                for q in queries:
                    if q.type == "json":
                        qa.append((q.question, json.dumps(answers_json(spec.printed))))
                    else:
                        qa.append((q.question, self.answer(q, spec.printed)))
                # born-digital PDFs: with --anchor-share, the text layer goes in the prompt as
                # `docproc run --anchor-text` puts it there (scans never have one)
                anchor = doc_anchor(doc) if not scan and rng.random() < self.anchor_share else None
                ex = self._encode(tok, proc, pages, qa, anchor)
                ex["row_weights"] = [self.answer_weights.get(q.name, 1.0) for q in queries]
                ex["row_query"] = list(range(len(queries)))
                if self.page_aux:  # the dense reading targets of every page, rotated like the scan
                    maps = [page_to_pixels(m["dpi"], m["angle"], img.width, img.height) for m, img in zip(made, pages)]
                    chars = [page_chars(page) for page in doc]
                    ex["aux"] = torch.cat([char_targets(c, img.width, img.height, f)
                                           for c, img, f in zip(chars, pages, maps)])
                    ex["aux_tok"] = torch.cat([char_targets(c, img.width, img.height, f, merged=True)
                                               for c, img, f in zip(chars, pages, maps)])
                yield ex

    @staticmethod
    def _encode(tok, proc, images, qa, anchor=None):
        out = proc(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        end = tok.convert_tokens_to_ids("<|im_end|>")
        rows = []
        for question, answer in qa:
            prompt_ids = tok(build_prompt(len(images), question, anchor), add_special_tokens=False)["input_ids"]
            answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [end]
            ids, n_img = [], iter((grid.prod(-1) // 4).tolist())
            for t in prompt_ids:
                ids.extend([pad] * next(n_img) if t == pad else [t])
            rows.append((ids + answer_ids, [-100] * len(ids) + answer_ids))
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid, "rows": rows}


def collate(docs: list[dict], pad_id: int) -> dict:
    rows = [(r, d) for d, doc in enumerate(docs) for r in doc["rows"]]
    n = max(len(ids) for (ids, _), _ in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, ((r_ids, r_labels), _) in enumerate(rows):
        ids[i, : len(r_ids)] = torch.tensor(r_ids)
        labels[i, : len(r_labels)] = torch.tensor(r_labels)
        mask[i, : len(r_ids)] = 1
    bounds, k = [], 0
    for doc in docs:
        bounds.append((k, k + doc["image_grid_thw"].shape[0]))
        k = bounds[-1][1]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat([d["pixel_values"] for d in docs]),
            "image_grid_thw": torch.cat([d["image_grid_thw"] for d in docs]),
            "row_doc": torch.tensor([d for _, d in rows]), "doc_images": torch.tensor(bounds),
            "row_weight": torch.tensor([w for doc in docs for w in doc.get("row_weights", [1.0] * len(doc["rows"]))]),
            "row_query": torch.tensor([q for doc in docs for q in doc.get("row_query", [-1] * len(doc["rows"]))]),
            "aux": torch.cat([d["aux"] if "aux" in d else
                              torch.full((d["pixel_values"].shape[0], 2), -100, dtype=torch.long) for d in docs]),
            "aux_tok": torch.cat([d["aux_tok"] if "aux_tok" in d else
                                  torch.full((d["pixel_values"].shape[0] // 4, 4), -100, dtype=torch.long)
                                  for d in docs])}


# ---- models --------------------------------------------------------------------------------------------
def build(work: Path, size: str):
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    s = SIZES[size]
    depth, width, vheads = s["vision"]
    hidden, layers, heads, kv, ffn = s["text"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    head_dim = hidden // heads
    sec = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
    sec[0] += head_dim // 2 - sum(sec)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": sec},
                         eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"], tie_word_embeddings=True),
        vision_config=dict(depth=depth, embed_dim=width, hidden_size=hidden, num_heads=vheads, mlp_ratio=4,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    return Qwen2VLForConditionalGeneration(cfg), tok


def save(model, tok, folder: Path) -> None:
    import shutil

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # saved in bf16; the live float32 weights are put back exactly afterwards (converting to bf16
    # and back alone would round them at every save; a deepcopy fails on the tied, shared trunk)
    exact = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(str(tmp), max_shard_size="15MB")  # $OUT takes files up to 16 MiB
    model.to(torch.float32)
    model.load_state_dict(exact)
    tok.save_pretrained(str(tmp))
    Qwen2VLImageProcessorPil(**IMAGE).save_pretrained(str(tmp))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_or_build(work: Path, name: str, size: str, device):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    folder = work / name
    if (folder / "config.json").is_file():
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(folder))
    else:
        model, tok = build(work, size)
    return model.to(device), tok


# ---- training --------------------------------------------------------------------------------------------
class Step:
    """One batch through the target (and the draft): image features once per document."""

    def __init__(self, target, draft, image_id: int) -> None:
        self.target, self.draft, self.image_id = target, draft, image_id
        self._trunk = None
        target.model.visual.merger.register_forward_hook(self._grab)

    def _grab(self, module, inputs, output):
        self._trunk = inputs[0]

    def features(self, batch, swap: list[int] | None = None, with_draft: bool = True):
        feats = self.target.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        self._merged = torch.cat(feats)
        t_docs = self._per_doc(feats, batch, swap)
        return t_docs, (self.draft_features(batch, swap) if with_draft else None)

    def draft_features(self, batch, swap: list[int] | None = None):
        """The draft's merger over the target's trunk output of the last `features` call, detached."""
        sizes = (batch["image_grid_thw"].prod(-1) // 4).tolist()
        self._d_merged = self.draft.model.visual.merger(self._trunk.detach())
        return self._per_doc(torch.split(self._d_merged, sizes), batch, swap)

    def sync_trunk(self) -> None:
        """The draft's trunk becomes the target's, byte for byte (its merger stays its own)."""
        sd = self.draft.model.visual.state_dict()
        sd.update({k: v for k, v in self.target.model.visual.state_dict().items() if not k.startswith("merger.")})
        self.draft.model.visual.load_state_dict(sd)

    @staticmethod
    def _per_doc(feats, batch, swap):
        docs = [torch.cat(feats[a:b]) for a, b in batch["doc_images"].tolist()]
        if swap is not None:
            docs = [docs[j] for j in swap]
        return docs

    def logits(self, model, batch, docs, positions):
        ids = batch["input_ids"]
        emb = model.model.get_input_embeddings()(ids)
        img = torch.cat([docs[d] for d in batch["row_doc"].tolist()]).to(emb.dtype)
        emb = emb.masked_scatter((ids == self.image_id)[..., None].expand_as(emb), img)
        h = model.model.language_model(inputs_embeds=emb, position_ids=positions,
                                       attention_mask=batch["attention_mask"]).last_hidden_state
        sel = batch["labels"][:, 1:] != -100
        return model.lm_head(h[:, :-1][sel]).float(), batch["labels"][:, 1:][sel], sel

    def aux_logits(self, batch, which: str):
        """Dense reading logits and targets of the last features call: "trunk" (the target's
        trunk, per half-patch), "tokens" / "draft_tokens" (the target's / draft's merged image
        tokens, per 7-pixel column)."""
        key, x, slots = {"trunk": ("aux", self._trunk, 2), "tokens": ("aux_tok", self._merged, 4),
                         "draft_tokens": ("aux_tok", self._d_merged, 4)}[which]
        sel = batch[key] != -100
        if not bool(sel.any()):
            return None, None
        logits = self.heads[which](x).float().view(-1, slots, AUX_CLASSES)
        return logits[sel], batch[key][sel]

    def aux_loss(self, batch, which: str):
        logits, gold = self.aux_logits(batch, which)
        if logits is None:
            return torch.zeros((), device=batch["aux"].device)
        weight = torch.ones(AUX_CLASSES, device=logits.device)
        weight[0] = 0.1  # most of a page is blank
        return torch.nn.functional.cross_entropy(logits, gold, weight=weight)

    def positions(self, batch):
        ids = batch["input_ids"]
        grids = torch.cat([batch["image_grid_thw"][slice(*batch["doc_images"][d].tolist())]
                           for d in batch["row_doc"].tolist()])
        pos, _ = self.target.model.get_rope_index(ids, mm_token_type_ids=(ids == self.image_id).int(),
                                                  image_grid_thw=grids, attention_mask=batch["attention_mask"])
        return pos


def row_weighted_mean(per_token: torch.Tensor, batch: dict, row_weights: torch.Tensor) -> torch.Tensor:
    """Mean of a per-answer-token loss, each token weighted by its row's weight (row_weights: one
    per row of the batch): the plain mean when every weight is 1."""
    rows = (batch["labels"][:, 1:] != -100).nonzero()[:, 0]
    w = row_weights.to(per_token.device, torch.float32)[rows.to(per_token.device)]
    return (per_token * w).sum() / w.sum()


def answer_loss(logits: torch.Tensor, gold: torch.Tensor, batch: dict) -> torch.Tensor:
    """Cross-entropy over the answer tokens, each weighted by its row's --answer-weight (1 unless
    set for its query): the mean when every weight is 1."""
    ce = torch.nn.functional.cross_entropy(logits, gold, reduction="none")
    return row_weighted_mean(ce, batch, batch["row_weight"])


def distill_loss(d_logits: torch.Tensor, t_logits: torch.Tensor, batch: dict, weights: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per answer token, averaged with each token weighted by its row's
    query weight (weights: one per query, then 1 for the reading question, row_query -1;
    --distill-weight; the plain mean over tokens when every weight is 1)."""
    t_log = torch.log_softmax(t_logits, -1)
    kl = (t_log.exp() * (t_log - torch.log_softmax(d_logits, -1))).sum(-1)
    return row_weighted_mean(kl, batch, weights[batch["row_query"].to(weights.device)])


def row_correct(pred: torch.Tensor, gold: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Per row: is every answer token right (teacher-forced)?"""
    ok = torch.ones(sel.shape, dtype=torch.bool, device=sel.device)
    ok[sel] = pred == gold
    return ok.all(-1)


@torch.no_grad()
def repair_tokens(tok, models, tokens: list[str]) -> dict:
    """Give collapsed tokens back a distinct embedding: each token X's (tied) embedding row becomes
    a copy of the row of " X" (the same word after a space). A token whose answer the model could
    not yet predict is pushed towards one shared output vector; with tied embeddings it then reads
    as the same input too (run 6: the six bare currency codes at cosine 0.62-0.85 and a third of
    the mean norm, as `probe_currency.py` prints; even "Total (SEK)" in the prompt's anchor text
    could not be copied). Done once per training (the state records it). Returns {token: cosine to the nearest other repaired
    token before the repair}."""
    out = {}
    ids = [tok.convert_tokens_to_ids(t) for t in tokens]
    spaced = [tok.convert_tokens_to_ids("\u0120" + t) for t in tokens]
    if any(i is None or i == tok.unk_token_id for i in ids + spaced):
        raise SystemExit(f"--repair-tokens: every token and its spaced form must be one token: {tokens}")
    for model in models:
        emb = model.get_input_embeddings().weight
        before = torch.nn.functional.normalize(emb[ids].float(), dim=-1)
        cos = before @ before.T - 2 * torch.eye(len(ids), device=emb.device)
        if model is models[0]:
            out = {t: round(c, 3) for t, c in zip(tokens, cos.max(-1).values.tolist())}
        emb[ids] = emb[spaced]
    return out


def save_all(work: Path, step_fn, tok, opts: dict, state: dict) -> None:
    target, draft = step_fn.target, step_fn.draft
    step_fn.sync_trunk()
    save(target, tok, work / "target")
    save(draft, tok, work / "draft")
    torch.save(step_fn.heads.state_dict(), work / "aux_heads.pt")
    # float32 weights beside the optimizer state: a resume on the same machine continues exactly
    torch.save({"step": state["step"], "distill_step": state["distill_step"], "target": target.state_dict(),
                "draft": draft.state_dict()}, work / "fp32.pt.tmp")
    os.replace(work / "fp32.pt.tmp", work / "fp32.pt")
    torch.save({k: o.state_dict() for k, o in opts.items()}, work / "optim.pt.tmp")
    os.replace(work / "optim.pt.tmp", work / "optim.pt")
    (work / "state.json").write_text(json.dumps(state, indent=1))


def load_fp32(work: Path, state: dict, target, draft) -> bool:
    """Replace the bf16 checkpoint weights by the float32 ones saved with them, when those are
    from the same step (a resume on the machine that trained; carried through $OUT only the bf16
    folders travel, and a folder put back by hand is not overridden by an older file)."""
    f = work / "fp32.pt"
    if not f.is_file():
        return False
    saved = torch.load(f, map_location="cpu")
    if (saved["step"], saved["distill_step"]) != (state.get("step", 0), state.get("distill_step", 0)):
        return False
    target.load_state_dict(saved["target"])
    draft.load_state_dict(saved["draft"])
    return True


def progress_share(state: dict, args) -> float:
    """How far the target's plan is, in [0, 1] (by steps with --max-steps, else by time)."""
    if args.max_steps:
        return min(1.0, state.get("step", 0) / args.max_steps)
    return min(1.0, state.get("train_seconds", 0.0) / (60 * args.target_minutes))


def train(args) -> None:
    work = Path(args.work)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    pre = "micro-" if args.micro else ""
    target, tok = load_or_build(work, "target", pre + "target", device)
    draft, _ = load_or_build(work, "draft", pre + "draft", device)
    draft.model.visual.requires_grad_(False)
    draft.model.visual.merger.requires_grad_(True)
    state_file = work / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {"step": 0, "distill_step": 0, "log": []}
    if state.setdefault("max_pixels", IMAGE["max_pixels"]) != IMAGE["max_pixels"]:
        raise SystemExit(f"this training used --max-pixels {state['max_pixels']}: pass the same to resume it")
    # dense reading heads (training only, not part of the checkpoints)
    heads = torch.nn.ModuleDict({
        "trunk": torch.nn.Linear(target.config.vision_config.embed_dim, 2 * AUX_CLASSES),
        "tokens": torch.nn.Linear(target.config.text_config.hidden_size, 4 * AUX_CLASSES),
        "draft_tokens": torch.nn.Linear(draft.config.text_config.hidden_size, 4 * AUX_CLASSES)}).to(device)
    if (work / "aux_heads.pt").is_file():
        heads.load_state_dict(torch.load(work / "aux_heads.pt", map_location=device))
    load_fp32(work, state, target, draft)
    if args.repair_tokens and not state.get("repaired_tokens"):
        state["repaired_tokens"] = repair_tokens(tok, (target, draft), args.repair_tokens)
    opts = {"target": torch.optim.AdamW(list(target.parameters()) + list(heads["trunk"].parameters())
                                        + list(heads["tokens"].parameters()), lr=args.lr,
                                        betas=(0.9, 0.95), weight_decay=0.01),
            "draft": torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad]
                                       + list(heads["draft_tokens"].parameters()), lr=args.lr,
                                       betas=(0.9, 0.95), weight_decay=0.01)}
    warm = 0
    if (work / "optim.pt").is_file():
        for k, sd in torch.load(work / "optim.pt", map_location=device).items():
            opts[k].load_state_dict(sd)
        warm = 50  # the optimizer state came along: no new warm-up
    pad, image_id = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")
    step_fn = Step(target, draft, image_id)
    step_fn.heads = heads
    n_page, n_band = max(0, args.workers - args.workers // 3), args.workers // 3

    def loader(kind, batch, workers, band_rows=5):
        ds = Examples(work, kind, args.seed * 1000 + state["step"] + state["distill_step"], band_rows=band_rows,
                      scan_fraction=args.scan_share, receipt_share=args.receipt_share,
                      answer_weights=args.answer_weight, spaced=args.spaced_answers,
                      field_share=args.field_share if kind == "bands" else 0.0,
                      page_aux=args.page_aux, anchor_share=args.anchor_share if kind == "pages" else 0.0)
        return iter(torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers,
                                                collate_fn=lambda b: collate(b, pad), pin_memory=device.type == "cuda",
                                                persistent_workers=workers > 0, prefetch_factor=4 if workers else None))

    short_bands = progress_share(state, args) < args.region_share
    pages = loader("pages", args.batch, n_page)
    bands = loader("bands", args.band_batch, n_band, args.first_band_rows if short_bands else 5)
    sp = args.spaced_answers
    held = {"pages": collate([ex for _, ex in zip(range(args.eval_docs), Examples(work, "pages", args.seed, tag="heldout", spaced=sp))], pad),
            "bands": collate([ex for _, ex in zip(range(4 * args.eval_docs), Examples(work, "bands", args.seed, tag="heldout"))], pad)}
    if args.anchor_share > 0:  # born-digital documents with their anchor text in the prompt
        held["anchored"] = collate([ex for _, ex in zip(range(args.eval_docs), Examples(
            work, "pages", args.seed, tag="heldout-anchored", scan_fraction=0.0, anchor_share=1.0, spaced=sp))], pad)
    if args.field_share > 0:  # field crops (every held-out band is one)
        held["fields"] = collate([ex for _, ex in zip(range(2 * args.eval_docs), Examples(
            work, "bands", args.seed, tag="heldout-fields", field_share=1.0, spaced=sp))], pad)
    names = [q.name for q in load_queries().queries]
    # per query index, the weight of its answer tokens in the distillation loss (the reading
    # question, index -1, and unlisted queries weigh 1)
    distill_weights = torch.tensor([args.distill_weight.get(n, 1.0) for n in names] + [1.0], device=device)
    t_end = time.time() + 60 * args.minutes
    t0, last_save = time.time(), time.time()
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    state["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    # every call's command line, so that a checkpoint's recipe can be read back from its state
    state.setdefault("calls", []).append({"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"),
                                          "from_step": state["step"], "from_distill_step": state["distill_step"]})
    state.setdefault("train_seconds", 0.0)
    state.setdefault("distill_seconds", 0.0)
    target_resumes = state["step"] < args.max_steps if args.max_steps else state["train_seconds"] < 60 * args.target_minutes
    if target_resumes and state.get("distill_step", 0):  # a longer plan trains the target again: distil again after it
        state["earlier_distill_steps"] = state.get("earlier_distill_steps", 0) + state["distill_step"]
        state["earlier_distill_seconds"] = state.get("earlier_distill_seconds", 0.0) + state["distill_seconds"]
        state["distill_step"], state["distill_seconds"] = 0, 0.0

    def progress() -> tuple[bool, float]:
        """(distilling?, progress of the current phase in [0, 1]): by steps when --max-steps is
        given (an exact replay), else by training time against the planned minutes."""
        if args.max_steps:
            if state["step"] < args.max_steps:
                return False, state["step"] / args.max_steps
            return True, state["distill_step"] / args.distill_steps if args.distill_steps else 1.0
        if state["train_seconds"] < 60 * args.target_minutes:
            return False, state["train_seconds"] / (60 * args.target_minutes)
        return True, state["distill_seconds"] / (60 * args.distill_minutes) if args.distill_minutes else 1.0

    while time.time() < t_end:
        distill, p = progress()
        if distill and p >= 1:
            break
        if short_bands and (distill or p >= args.region_share):  # the bands-only phase is over
            short_bands, bands = False, loader("bands", args.band_batch, n_band)
        t_step = time.time()
        if distill:  # with --distill-bands N, every Nth distillation batch is text bands (field crops)
            band_step = bool(args.distill_bands) and state["distill_step"] % args.distill_bands == args.distill_bands - 1
        else:
            band_step = p < args.region_share or state["step"] % 4 == 3
        t_data = time.time()
        cpu_batch = next(bands if band_step else pages)
        state["data_wait_seconds"] = state.get("data_wait_seconds", 0.0) + time.time() - t_data
        batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items()}
        lr = args.lr * min(1.0, (warm + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))
        for opt in opts.values():
            for g in opt.param_groups:
                g["lr"] = lr
        target.train(not distill)
        with amp:
            pos = step_fn.positions(batch)
            if distill:
                with torch.no_grad():
                    t_docs, _ = step_fn.features(batch, with_draft=False)
                    t_logits, gold, _ = step_fn.logits(target, batch, t_docs, pos)
                d_logits, _, _ = step_fn.logits(draft, batch, step_fn.draft_features(batch), pos)
                loss_t = torch.zeros((), device=device)
                loss_d = distill_loss(d_logits, t_logits, batch, distill_weights)
            else:
                t_docs, d_docs = step_fn.features(batch)
                t_logits, gold, _ = step_fn.logits(target, batch, t_docs, pos)
                d_logits, _, _ = step_fn.logits(draft, batch, d_docs, pos)
                loss_t = answer_loss(t_logits, gold, batch)
                loss_d = answer_loss(d_logits, gold, batch)
                loss_t = loss_t + args.aux_weight * step_fn.aux_loss(batch, "trunk") \
                    + args.token_aux_weight * step_fn.aux_loss(batch, "tokens")
                loss_d = loss_d + args.token_aux_weight * step_fn.aux_loss(batch, "draft_tokens")
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        (loss_t + loss_d).backward()
        # a non-finite loss or gradient skips that model's update (one bad batch must not turn
        # the weights into NaN); skips are counted in the log
        if not distill:
            norm = torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            if torch.isfinite(norm) and torch.isfinite(loss_t):
                opts["target"].step()
            else:
                state["skipped_target"] = state.get("skipped_target", 0) + 1
        norm_d = torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
        if torch.isfinite(norm_d) and torch.isfinite(loss_d):
            opts["draft"].step()
        else:
            state["skipped_draft"] = state.get("skipped_draft", 0) + 1
        state["distill_step" if distill else "step"] += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        state["distill_seconds" if distill else "train_seconds"] += time.time() - t_step
        warm += 1
        done = progress()[0] and progress()[1] >= 1
        if (state["step"] + state["distill_step"]) % args.eval_every == 0 or time.time() >= t_end or done:
            rec = evaluate(step_fn, held, names, device)
            rec.update(step=state["step"], distill_step=state["distill_step"],
                       phase="distill" if distill else ("bands" if band_step and p < args.region_share else "mixed"),
                       loss_target=round(loss_t.item(), 4), loss_draft=round(loss_d.item(), 4),
                       skipped=[state.get("skipped_target", 0), state.get("skipped_draft", 0)], lr=round(lr, 6),
                       train_seconds=round(state["train_seconds"] + state["distill_seconds"], 1),
                       data_wait_seconds=round(state.get("data_wait_seconds", 0.0), 1),
                       seconds=round(time.time() - t0, 1))
            state["log"].append(rec)
            print(json.dumps(rec), flush=True)
        if time.time() - last_save > 60 * args.save_minutes:
            save_all(work, step_fn, tok, opts, state)
            last_save = time.time()
    save_all(work, step_fn, tok, opts, state)


@torch.no_grad()
def evaluate(step_fn: Step, held: dict, names: list[str], device) -> dict:
    """Teacher-forced whole-answer accuracy of the target per query and on bands, the same with
    other documents' images, and the draft's top-1 agreement with the target's argmax."""
    step_fn.target.eval()
    step_fn.draft.eval()
    out = {}
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for kind, cpu_batch in held.items():
        batch = {k: v.to(device) for k, v in cpu_batch.items()}
        with amp:
            pos = step_fn.positions(batch)
            t_docs, d_docs = step_fn.features(batch)
            t_logits, gold, sel = step_fn.logits(step_fn.target, batch, t_docs, pos)
            d_logits, _, _ = step_fn.logits(step_fn.draft, batch, d_docs, pos)
            t_pred, d_pred = t_logits.argmax(-1), d_logits.argmax(-1)
            ok = row_correct(t_pred, gold, sel)
            # every document's image features replaced by those of a document with the same grids
            grids = [tuple(map(tuple, batch["image_grid_thw"][a:b].tolist())) for a, b in batch["doc_images"].tolist()]
            swap = list(range(len(grids)))
            for i, g in enumerate(grids):
                j = next((j for j in list(range(i + 1, len(grids))) + list(range(i)) if grids[j] == g), i)
                swap[i] = j
            has_partner = torch.tensor([swap[d] != d for d in batch["row_doc"].tolist()], device=device)
            o_logits, _, _ = step_fn.logits(step_fn.target, batch, [t_docs[j] for j in swap], pos)
            ok_other = row_correct(o_logits.argmax(-1), gold, sel)
        agree = (d_pred == t_pred).float()
        row_of_tok = sel.nonzero()[:, 0]
        if kind == "bands":
            with amp:  # the heads read the outputs of this batch's one features call above
                for which, name in (("trunk", "bands_char_acc"), ("tokens", "bands_token_char_acc"),
                                    ("draft_tokens", "bands_draft_token_char_acc")):
                    a_logits, a_gold = step_fn.aux_logits(batch, which)
                    glyph = a_gold > 0
                    out[name] = round((a_logits.argmax(-1)[glyph] == a_gold[glyph]).float().mean().item(), 4)
            out["bands_acc"] = round(ok.float().mean().item(), 4)
            out["bands_draft_agreement"] = round(agree.mean().item(), 4)
            continue
        if kind == "fields":  # field crops: each field's query asked of a band that shows it
            rq = batch["row_query"]
            for qi, name in enumerate(names):
                if bool((rq == qi).any()):
                    out[f"fields_acc_{name}"] = round(ok[rq == qi].float().mean().item(), 4)
            out["fields_acc"] = round(ok[rq >= 0].float().mean().item(), 4)
            continue
        q_of_row = torch.arange(sel.shape[0], device=device) % len(names)
        pre = "" if kind == "pages" else f"{kind}_"
        for qi, name in enumerate(names):
            rows = q_of_row == qi
            out[f"{pre}acc_{name}"] = round(ok[rows].float().mean().item(), 4)
            out[f"{pre}agree_{name}"] = round(agree[rows[row_of_tok]].mean().item(), 4)
        out[f"{kind}_acc"] = round(ok.float().mean().item(), 4)
        out[f"{kind}_acc_other_image"] = round(ok_other[has_partner].float().mean().item(), 4) if has_partner.any() else None
        out[f"{kind}_draft_agreement"] = round(agree.mean().item(), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["tokenizer", "train", "export"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--to", default=str(ROOT / "docproc" / "assets" / "models"))
    ap.add_argument("--minutes", type=float, default=9.0, help="stop (and save) after this long; run again to resume")
    ap.add_argument("--target-minutes", type=float, default=12.0, help="planned training time of the target "
                    "(joint with the draft); the LR schedule and curriculum follow the share of it spent")
    ap.add_argument("--distill-minutes", type=float, default=3.0, help="planned draft distillation time after it")
    ap.add_argument("--max-steps", type=int, default=0, help="plan by steps instead (exact replay): target steps")
    ap.add_argument("--distill-steps", type=int, default=0, help="with --max-steps: distillation steps")
    ap.add_argument("--region-share", type=float, default=0.2, help="share of the target's plan on text bands only")
    ap.add_argument("--batch", type=int, default=8, help="documents per page batch (x7 query rows)")
    ap.add_argument("--band-batch", type=int, default=48, help="text bands per band batch")
    ap.add_argument("--workers", type=int, default=max(0, (os.cpu_count() or 2) - 1))
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the trunk's dense reading loss")
    ap.add_argument("--token-aux-weight", type=float, default=1.0,
                    help="weight of the dense reading loss on the merged image tokens (target and draft)")
    ap.add_argument("--max-pixels", type=int, default=IMAGE["max_pixels"],
                    help="the image processor's pixel cap (saved with the models): higher gives bigger glyphs "
                         "and more image tokens; keep it fixed across the calls of one training")
    ap.add_argument("--page-aux", type=int, default=1, help="1: whole pages get the dense reading targets too")
    ap.add_argument("--anchor-share", type=float, default=0.5,
                    help="share of the born-digital documents trained with their anchor text in the prompt (--anchor-text)")
    ap.add_argument("--first-band-rows", type=int, default=2,
                    help="bands have at most this many rows in the bands-only phase (then up to 5)")
    ap.add_argument("--answer-weight", default="", help="weights of some queries' answer tokens in the target's "
                    "and draft's loss, e.g. currency=4 (a single-token answer the model left at its prior)")
    ap.add_argument("--field-share", type=float, default=0.0,
                    help="share of the text bands cut around a field's row and asked that field's query too "
                         "(currency three times as often as each other field)")
    ap.add_argument("--spaced-answers", default="", help="single-field queries whose answer is trained with a "
                    "leading space, as the value is read after its label (e.g. currency: ' CHF'); the parser strips it")
    ap.add_argument("--repair-tokens", default="", help="tokens whose embedding row becomes that of the token "
                    "with a leading space, once per training, e.g. EUR,USD,GBP,CHF,SEK,CAD")
    ap.add_argument("--distill-weight", default="", help="weights of some queries' answer tokens in the draft's "
                    "distillation loss, e.g. currency=6 (default 1 each)")
    ap.add_argument("--distill-bands", type=int, default=0, help="every Nth distillation batch is text bands "
                    "(field crops with --field-share) instead of pages; 0: pages only")
    ap.add_argument("--scan-share", type=float, default=0.5, help="share of training documents and bands that are "
                    "scans (held-out sets keep 0.5)")
    ap.add_argument("--receipt-share", type=float, default=None, help="share of training documents and bands that "
                    "are receipts (default: the generator's mix, a third; held-out sets keep it)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-docs", type=int, default=24)
    ap.add_argument("--save-minutes", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro", action="store_true", help="tiny sizes, for a CPU check")
    a = ap.parse_args()
    a.answer_weight = {k: float(v) for k, v in (x.split("=") for x in a.answer_weight.split(",") if x)}
    a.distill_weight = {k: float(v) for k, v in (x.split("=") for x in a.distill_weight.split(",") if x)}
    a.spaced_answers = tuple(x for x in a.spaced_answers.split(",") if x)
    a.repair_tokens = [x for x in a.repair_tokens.split(",") if x]
    for flag, names in (("--answer-weight", set(a.answer_weight)), ("--spaced-answers", set(a.spaced_answers)),
                        ("--distill-weight", set(a.distill_weight))):
        unknown = names - {q.name for q in load_queries().queries}
        if unknown:
            ap.error(f"{flag}: no query named {', '.join(sorted(unknown))}")
    IMAGE["max_pixels"] = a.max_pixels  # read by the data workers (forked after this) and by save()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.stage == "tokenizer":
        if not (work / "tokenizer" / "tokenizer.json").is_file():
            train_tokenizer(work, SIZES["micro-target" if a.micro else "target"]["vocab"], a.seed)
    elif a.stage == "train":
        train(a)
    else:
        import shutil

        for role in ("target", "draft"):
            shutil.rmtree(Path(a.to) / role, ignore_errors=True)
            shutil.copytree(work / role, Path(a.to) / role)


if __name__ == "__main__":
    main()
