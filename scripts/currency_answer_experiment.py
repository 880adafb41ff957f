"""A CPU experiment on the bundled target: can its currency answer learn to use the image, and
does spelling the answer as it is read (" CHF", the token after "Currency:") make that easier
than the bare code ("CHF", what the default query set's answers are)?

    python scripts/currency_answer_experiment.py TRAIN_CROPS VARIANT STEPS [LR]
    python scripts/currency_answer_experiment.py 300 space 100    # and: 300 plain 100

Invoices from the generator (seed strings "curexp:train:i" / "curexp:test:i"), page 1 rendered
as `docproc run` does and scaled as the processor scales it; the crop runs from the info box's
"Invoice no" row to its "Currency:" row (4 text rows, ~56 image tokens). The target's vision
tower is frozen (its features computed once); its LM trains on the currency query alone (AdamW,
batch 16, LR 1e-4). Every 25 steps: the share of 120 held-out crops whose first answer token
(teacher-forced) is the right code. Not a training recipe: a probe of where the currency answer
gets stuck (BENCHMARKS.md, run 6).
"""
import random
import sys
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fixtures.tiny_training as T
from fixtures.documents import make_spec, draw_pdf
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
torch.manual_seed(0); torch.set_num_threads(2)
Q = "What is the currency code?"
proc = Qwen2VLImageProcessorPil(**T.IMAGE)
def make(n, tag):
    out = []
    i = 0
    while len(out) < n:
        rng = random.Random(f"curexp:{tag}:{i}"); i += 1
        spec = make_spec(rng, f"c{i}", kind="invoice", max_pages=1)
        page = draw_pdf(spec)[0]
        cur = page.search_for("Currency:")
        top = page.search_for("Invoice no") or page.search_for("Invoice")
        if not cur or not top: continue
        pix = page.get_pixmap(dpi=T.PAGE_DPI); img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        h, w = T.inference_size(img.height, img.width); img = img.resize((w, h), Image.BICUBIC); s = w / page.rect.width
        y0 = min(r.y0 for r in top if r.y0 <= cur[0].y0) if any(r.y0 <= cur[0].y0 for r in top) else cur[0].y0
        box = (cur[0].x0 - 12, y0 - 8, cur[0].x0 + 250, cur[0].y1 + 8)
        crop = T.on_token_grid(img.crop(tuple(int(v * s) for v in box)))
        out.append((crop, spec.printed["currency"]))
    return out
t0 = time.time()
train, test = make(int(sys.argv[1]), "train"), make(120, "test")
print("made", len(train), len(test), round(time.time() - t0), "s; crop", train[0][0].size, flush=True)
variant = sys.argv[2]
target, tok = T.load_or_build(Path(__file__).resolve().parent.parent / "docproc" / "assets" / "models", "target", "target", torch.device("cpu"))
pad, image_id = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")
step_fn = T.Step(target, target, image_id)
def enc(ex):
    crop, cur = ex
    return T.Examples._encode(tok, proc, [crop], [(Q, (" " + cur) if variant == "space" else cur)])
E_train, E_test = [enc(e) for e in train], [enc(e) for e in test]
with torch.no_grad():
    F_train = [target.model.get_image_features(e["pixel_values"], e["image_grid_thw"]).pooler_output[0] for e in E_train]
    F_test = [target.model.get_image_features(e["pixel_values"], e["image_grid_thw"]).pooler_output[0] for e in E_test]
target.model.visual.requires_grad_(False)
params = [p for p in target.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=float(sys.argv[4]) if len(sys.argv) > 4 else 1e-4, betas=(0.9, 0.95), weight_decay=0.01)
def run(E, F, idx, train_mode):
    b = T.collate([E[i] for i in idx], pad)
    pos = step_fn.positions(b)
    logits, gold, sel = step_fn.logits(target, b, [F[i] for i in idx], pos)
    first = torch.zeros_like(sel); first[torch.arange(sel.shape[0]), sel.float().argmax(-1)] = True
    fsel = first[sel]
    return logits, gold, fsel
def evaluate():
    target.eval()
    with torch.no_grad():
        logits, gold, fsel = run(E_test, F_test, list(range(len(E_test))), False)
    target.train()
    return round((logits[fsel].argmax(-1) == gold[fsel]).float().mean().item(), 3)
print(variant, "step 0 held-out code right:", evaluate(), flush=True)
rng = random.Random(0)
for step in range(1, int(sys.argv[3]) + 1):
    idx = rng.sample(range(len(E_train)), 16)
    logits, gold, fsel = run(E_train, F_train, idx, True)
    loss = torch.nn.functional.cross_entropy(logits, gold)
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
    if step % 25 == 0:
        print(variant, "step", step, "loss", round(loss.item(), 3), "held-out code right:", evaluate(), round(time.time() - t0), "s", flush=True)
