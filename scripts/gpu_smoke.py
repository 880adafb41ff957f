"""GPU smoke run for the engine core (device only).

Builds a random-weight model with Qwen2-VL-2B geometry from config (no download), runs our engine
and transformers' Qwen2VLForConditionalGeneration on the same prompts, and reports greedy-token
agreement: exact in float32 (TF32 off), and in bf16 the common prefix plus the teacher-forced top-1
agreement (bf16 rounding makes long greedy runs of two implementations drift apart eventually).

    python scripts/gpu_smoke.py --out /tmp/m2b --json result.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from docproc import LLM, SamplingParams  # noqa: E402
from fixtures.checkpoints import make_model  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def page(seed: int, w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def requests():
    return [
        {"prompt": "<|im_start|>user\n" + IMG + "What is the invoice total?<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [page(1, 448, 588)]}},
        {"prompt": "<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n"},
        {"prompt": "<|im_start|>user\n" + IMG + IMG + "Compare<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [page(2, 300, 200), page(3, 200, 420)]}},
    ]


def hf_inputs(llm, ids, images, device):
    t = torch.tensor([ids], device=device)
    kw = {"input_ids": t, "mm_token_type_ids": (t == llm.processor.image_token_id).int()}
    if images:
        pv, grid = llm.processor.pixel_values(images)
        kw.update(pixel_values=pv.to(device), image_grid_thw=grid.to(device))
    return kw


def compare(folder: Path, dtype: str, n_tokens: int, device: str) -> dict:
    from transformers import Qwen2VLForConditionalGeneration

    torch_dtype = getattr(torch, dtype)
    llm = LLM(str(folder), device=device, dtype=dtype, gpu_memory_utilization=0.5)
    reqs = requests()
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    llm.generate(reqs[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(reqs, sp)
    if device == "cuda":
        torch.cuda.synchronize()
    ours_s = time.perf_counter() - t0
    info = llm.cache_info()
    del llm.runner.kv_cache.layers[:]
    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch_dtype).to(device).eval()
    rows = []
    for req, out in zip(reqs, outs):
        images = (req.get("multi_modal_data") or {}).get("image", [])
        ours = out.outputs[0].token_ids
        with torch.no_grad():
            kw = hf_inputs(llm, out.prompt_token_ids, images, device)
            gen = hf.generate(**kw, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(out.prompt_token_ids):].tolist()
            full = hf_inputs(llm, out.prompt_token_ids + ours, images, device)
            logits = hf(**full).logits[0, len(out.prompt_token_ids) - 1: -1].float()
        prefix = next((i for i, (a, b) in enumerate(zip(ours, gen)) if a != b), len(ours))
        tf = (logits.argmax(-1).cpu() == torch.tensor(ours)).float().mean().item()
        rows.append({"prompt_tokens": len(out.prompt_token_ids), "images": len(images),
                     "generated": len(ours), "identical_prefix": prefix, "all_identical": ours == gen,
                     "teacher_forced_top1_agreement": round(tf, 4)})
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": dtype, "requests": rows, "ours_generate_seconds": round(ours_s, 3),
            "cache_info": {k: info[k] for k in ("kv_cache_dtype", "num_blocks", "bytes_per_token", "block_size")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/qwen2vl-2b-random")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--geometry", default="2b", help="2b on the device; tiny for a CPU dry run")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    folder = make_model(Path(a.out), "qwen2_vl", tie=True, naming="published", dtype=torch.bfloat16,
                        geometry=a.geometry, init_std=None, device=a.device, max_pixels=28 * 28 * 1280)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "geometry": a.geometry,
              "build_seconds": round(time.perf_counter() - t0, 1), "runs": []}
    for dtype in ("float32", "bfloat16"):
        result["runs"].append(compare(folder, dtype, a.tokens, a.device))
        print(json.dumps(result["runs"][-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
