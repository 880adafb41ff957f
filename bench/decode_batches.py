"""Plain decoding at several batch sizes against its bandwidth roofline: one-page requests (each
its own page, prompts cached by a first pass), greedy, ignore_eos, and per batch size the
decode tokens/s (the pass of N new tokens less the pass of one, best of --repeats) against the
bytes a step must read at the measured copy bandwidth: the language model's weights (FP8 codes
and scales where FP8) plus every row's KV cache at its mean context.

    python3 bench/decode_batches.py --geometry 72b --quantization fp8 --batches 8,32,64,128 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
import bench_engine as be  # noqa: E402
from docproc import SamplingParams  # noqa: E402
from fixtures.checkpoints import make_model  # noqa: E402


def timed(llm, reqs, n: int, device: str) -> float:
    be.sync(device)
    t0 = time.perf_counter()
    llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    be.sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7b")
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--batches", default="8,32,64,128")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--page-w", type=int, default=868)
    ap.add_argument("--page-h", type=int, default=1092)
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 1280)
    ap.add_argument("--work", default="/tmp/docproc-decode")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.dtype = "bfloat16" if cuda else "float32"
    args.gpu_util, args.prefetch_workers, args.batched_tokens, args.load_format = 0.85, None, 8192, "dummy"
    folder = make_model(Path(args.work) / args.geometry, geometry=args.geometry, weights=False,
                        dtype=getattr(torch, args.dtype), device=args.device, max_pixels=args.max_pixels,
                        init_std=None)
    bw = be.copy_bandwidth(args.device, 2048 if cuda else 64)
    llm = be.ours(folder, args)
    info = llm.cache_info()
    weight_bytes = be.lm_bytes_per_step(llm)
    n = args.new_tokens
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "args": vars(args), "copy_GBps": round(bw / 1e9, 1),
           "weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": info["bytes_per_token"],
           "weights_fp8": info.get("weights_fp8"), "pool_tokens": info["num_blocks"] * info["block_size"],
           "batches": {}}
    for b in [int(x) for x in args.batches.split(",")]:
        reqs = [be.request(3000 + i, be.QUESTIONS[i % len(be.QUESTIONS)], args) for i in range(b)]
        first = llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # cached, captured
        prompt = sum(o.metrics.num_prompt_tokens for o in first) / b
        timed(llm, reqs, n, args.device)  # every step's graph at this batch size
        best = 0.0
        for _ in range(args.repeats):
            one = timed(llm, reqs, 1, args.device)
            full = timed(llm, reqs, n, args.device)
            best = max(best, b * (n - 1) / max(full - one, 1e-9))
        step_bytes = weight_bytes + b * (prompt + n / 2) * info["bytes_per_token"]
        roof = b * bw / step_bytes
        out["batches"][b] = {"tokens_per_s": round(best, 1), "ms_per_step": round(1e3 * b / best, 3),
                             "roofline_tokens_per_s": round(roof, 1), "share_of_bandwidth_roofline": round(best / roof, 3),
                             "step_gb": round(step_bytes / 1e9, 3), "prompt_tokens": round(prompt),
                             # whether the batch's KV fits the pool at once (else rows wait: not a kernel figure)
                             "kv_tokens": round(b * (prompt + n)), "fits_pool": b * (prompt + n) <= out["pool_tokens"]}
        print(b, out["batches"][b], flush=True)
    late = llm.cache_info()
    out["kernels_compiled_after_warmup"] = late.get("kernels_compiled_after_warmup")
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
