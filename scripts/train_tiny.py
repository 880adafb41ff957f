"""Train the bundled default pair (target and draft) on synthetic documents, on the device GPU.

Runs in stages, each resumable across device calls (the device keeps nothing: carry WORK back
through $OUT and forward with `carry`); every stage stops by itself after --minutes.

    python scripts/train_tiny.py tokenizer --work WORK            # byte-level BPE + chat template
    python scripts/train_tiny.py target --work WORK --minutes 8   # again to continue (resumes)
    python scripts/train_tiny.py draft --work WORK --minutes 8    # distillation, trunk frozen
    python scripts/train_tiny.py export --work WORK --to docproc/assets/models

Recipe (see the issue's notes on the failed first attempt): examples are drawn by DataLoader
worker processes (render + augment + patchify on the CPU cores, batch-ready tensors out) so the
GPU is not starved; a curriculum starts with single text lines cut from the page ("read this
line", short images, strong gradient into the vision trunk) and moves to whole pages with one
query per field and an all-fields JSON query; answers are the values as printed. Every eval
reports answer accuracy (teacher-forced exact match of the whole answer) with the real image and
with the image of another document: the gap shows the image reaches the answer.
`--micro` shrinks everything to run a few steps on a CPU (the tests do).
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
SIZES = {  # (vision depth, width, heads), (LM hidden, layers, heads, kv heads, ffn), vocab
    "target": dict(vision=(6, 256, 4), text=(384, 6, 6, 2, 1024), vocab=4096),
    "draft": dict(vision=(6, 256, 4), text=(192, 4, 3, 1, 512), vocab=4096),
    "micro-target": dict(vision=(1, 32, 2), text=(64, 1, 2, 1, 128), vocab=512),
    "micro-draft": dict(vision=(1, 32, 2), text=(64, 1, 2, 1, 128), vocab=512),
}


# ---- tokenizer ------------------------------------------------------------------------------------
def corpus(n_docs: int, seed: int):
    from make_synthetic_docs import make_spec

    qs = load_queries()
    for i in range(n_docs):
        spec = make_spec(random.Random(f"tok:{seed}:{i}"), f"t{i}")
        yield " ".join(spec.printed[k] or "none" for k in spec.printed)
        yield json.dumps(answers_json(spec.printed))
        yield " ".join(f"{d} {q} {spec.amount(p)}" for d, q, p in spec.items)
    for q in qs.queries:
        yield q.question


def answers_json(printed: dict) -> dict:
    return {k: printed[k] for k in ("vendor", "invoice_number", "date", "due_date", "currency", "total")}


def train_tokenizer(work: Path, vocab: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(3000 if vocab > 1024 else 200, seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(work / "tokenizer"))


# ---- data ----------------------------------------------------------------------------------------------
class Examples(torch.utils.data.IterableDataset):
    """Endless (prompt, answer, images) examples, rendered in the worker that asks for them.
    stage "lines": one text line of a page, cropped; stage "pages": whole pages, every query."""

    def __init__(self, work: Path, stage: str, seed: int, scan_fraction: float = 0.5) -> None:
        self.work, self.stage, self.seed, self.scan_fraction = work, stage, seed, scan_fraction

    def __iter__(self):
        import pymupdf
        from PIL import Image
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from make_synthetic_docs import make_spec, render_pdf, scan_pages

        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tok = AutoTokenizer.from_pretrained(str(self.work / "tokenizer"))
        proc = Qwen2VLImageProcessorPil(**IMAGE)
        queries = load_queries().queries
        i = 0
        while True:
            rng = random.Random(f"train:{self.seed}:{wid}:{i}")
            i += 1
            spec = make_spec(rng, f"w{wid}_{i}", max_pages=1 if self.stage == "lines" else 2)
            pdf = render_pdf(spec)
            if rng.random() < self.scan_fraction:
                pages = scan_pages(pdf, rng)
            else:
                doc = pymupdf.open(stream=pdf, filetype="pdf")
                pages = []
                for page in doc:
                    pix = page.get_pixmap(dpi=rng.choice([100, 120, 144]))
                    pages.append(Image.frombytes("RGB", (pix.width, pix.height), pix.samples))
            if self.stage == "lines":
                doc = pymupdf.open(stream=pdf, filetype="pdf")
                page = doc[0]
                lines = [ln for b in page.get_text("dict")["blocks"] for ln in b.get("lines", [])]
                lines = [ln for ln in lines if "".join(s["text"] for s in ln["spans"]).strip()]
                for ln in rng.sample(lines, min(4, len(lines))):
                    text = "".join(s["text"] for s in ln["spans"]).strip()
                    x0, y0, x1, y1 = ln["bbox"]
                    sx, sy = pages[0].width / page.rect.width, pages[0].height / page.rect.height
                    crop = pages[0].crop((max(0, x0 * sx - 6), max(0, y0 * sy - 4), min(pages[0].width, x1 * sx + 6),
                                          min(pages[0].height, y1 * sy + 4)))
                    yield self._encode(tok, proc, [crop], "Read the text in the image.", text)
            else:
                for q in queries:
                    if q.type == "json":
                        answer = json.dumps(answers_json(spec.printed))
                    else:
                        answer = spec.printed.get(q.name) or "none"
                    yield self._encode(tok, proc, pages, q.question, answer)

    @staticmethod
    def _encode(tok, proc, images, question, answer):
        out = proc(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        prompt_ids = tok(build_prompt(len(images), question), add_special_tokens=False)["input_ids"]
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        ids = []
        n_img = iter((grid.prod(-1) // 4).tolist())
        for t in prompt_ids:
            ids.extend([pad] * next(n_img) if t == pad else [t])
        labels = [-100] * len(ids) + answer_ids
        return {"input_ids": ids + answer_ids, "labels": labels, "pixel_values": out["pixel_values"],
                "image_grid_thw": grid}


def collate(batch: list[dict], pad_id: int, image_id: int) -> dict:
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
        mask[i, : len(b["input_ids"])] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "mm_token_type_ids": (ids == image_id).int(),
            "pixel_values": torch.cat([b["pixel_values"] for b in batch]),
            "image_grid_thw": torch.cat([b["image_grid_thw"] for b in batch])}


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
    model.to(torch.bfloat16).save_pretrained(str(tmp), max_shard_size="15MB")  # $OUT takes files up to 16 MiB
    model.to(torch.float32)
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
def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of examples whose whole answer is right under teacher forcing."""
    pred = logits[:, :-1].argmax(-1)
    gold = labels[:, 1:]
    ok = ((pred == gold) | (gold == -100)).all(-1)
    return ok.float().mean().item()


def train(args, role: str) -> None:
    work = Path(args.work)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    size = ("micro-" if args.micro else "") + role
    model, tok = load_or_build(work, role, size, device)
    teacher = None
    if role == "draft":
        teacher, _ = load_or_build(work, "target", ("micro-" if args.micro else "") + "target", device)
        teacher.eval().requires_grad_(False)
        trunk = {k: v for k, v in teacher.model.visual.state_dict().items() if not k.startswith("merger.")}
        model.model.visual.load_state_dict(trunk, strict=False)  # the target's trunk, frozen
        for name, p in model.model.visual.named_parameters():
            p.requires_grad_(name.startswith("merger."))
    state_file = work / f"{role}_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {"step": 0, "log": []}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    stage = "lines" if role == "target" and state["step"] < args.line_steps else "pages"
    pad, image_id = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")

    def loader(stage_name, seed):
        ds = Examples(work, stage_name, seed)
        return iter(torch.utils.data.DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                                                collate_fn=lambda b: collate(b, pad, image_id),
                                                persistent_workers=args.workers > 0))

    data = loader(stage, args.seed + state["step"])
    held = collate([ex for _, ex in zip(range(2 * args.batch), Examples(work, "pages", 10_000 + args.seed))],
                   pad, image_id)
    t_end = time.time() + 60 * args.minutes
    t0, warm = time.time(), 0
    model.train()
    while time.time() < t_end and state["step"] < args.max_steps:
        if stage == "lines" and state["step"] >= args.line_steps:
            stage, data = "pages", loader("pages", args.seed + state["step"])
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data).items()}
        # a short warm-up at each (re)start: the optimizer state does not travel between calls
        lr = args.lr * min(1.0, (warm + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, state["step"] / args.max_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**batch)
            loss = out.loss
            if teacher is not None:  # distillation on the answer tokens
                with torch.no_grad():
                    t_logits = teacher(**{k: v for k, v in batch.items() if k != "labels"}).logits
                m = batch["labels"][:, 1:] != -100
                s_lp = torch.log_softmax(out.logits[:, :-1][m].float(), -1)
                t_lp = torch.log_softmax(t_logits[:, :-1][m].float(), -1)
                loss = torch.nn.functional.kl_div(s_lp, t_lp, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        warm += 1
        if state["step"] % args.eval_every == 0 or time.time() >= t_end:
            state["log"].append(evaluate(model, held, device, state["step"], stage, loss.item(), time.time() - t0))
            print(json.dumps(state["log"][-1]), flush=True)
            model.train()
    save(model, tok, work / role)
    state_file.write_text(json.dumps(state, indent=1))


@torch.no_grad()
def evaluate(model, held: dict, device, step: int, stage: str, loss: float, seconds: float) -> dict:
    model.eval()
    batch = {k: v.to(device) for k, v in held.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        acc = answer_accuracy(model(**batch).logits, batch["labels"])
        # the same questions with the pages of other documents: if the image reaches the answer,
        # accuracy must collapse
        n = batch["image_grid_thw"].shape[0]
        if n > 1:
            perm = torch.roll(torch.arange(n), 1)
            sizes = batch["image_grid_thw"].prod(-1)
            if bool((sizes == sizes[perm]).all()):
                chunks = list(torch.split(batch["pixel_values"], sizes.tolist()))
                swapped = dict(batch, pixel_values=torch.cat([chunks[i] for i in perm.tolist()]))
                acc_wrong = answer_accuracy(model(**swapped).logits, batch["labels"])
            else:
                acc_wrong = None
        else:
            acc_wrong = None
    return {"step": step, "stage": stage, "loss": round(loss, 4), "heldout_answer_acc": round(acc, 4),
            "heldout_answer_acc_other_image": None if acc_wrong is None else round(acc_wrong, 4),
            "seconds": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["tokenizer", "target", "draft", "export"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--to", default=str(ROOT / "docproc" / "assets" / "models"))
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--max-steps", type=int, default=30000)
    ap.add_argument("--line-steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=max(0, (os.cpu_count() or 2) - 2))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro", action="store_true", help="tiny sizes, for a CPU check")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.stage == "tokenizer":
        train_tokenizer(work, SIZES["micro-target" if a.micro else "target"]["vocab"], a.seed)
    elif a.stage in ("target", "draft"):
        train(a, a.stage)
    else:
        import shutil

        for role in ("target", "draft"):
            shutil.copytree(work / role, Path(a.to) / role, dirs_exist_ok=True)


if __name__ == "__main__":
    main()
