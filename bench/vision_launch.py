"""Is the vision tower's encode bound by its launches? A tower of a geometry's shape (random
weights, bf16, CUDA) encodes pages of the e2e corpus's size; per case:

- gpu_ms: the encode's GPU time (CUDA events around it, launched into an idle stream and waited for);
- host_ms: the host's time to queue it (the call's return, the stream kept busy beforehand with
  a sleep kernel so no launch waits for the GPU);
- host_over_gpu: above 1, a step that encodes these pages starves the GPU however it overlaps.

--first-shapes N: also, per SDPA backend (torch's default, flash), N encodes of page sizes the
process has not seen before, each timed to its end (first_ms) and again at once (again_ms): what
a shape's first use costs (cuDNN builds an execution plan per attention shape).

    python3 bench/vision_launch.py --geometry 7b --pages 1,2,4 --json /tmp/vision_launch.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7b")
    ap.add_argument("--pages", default="1,2,4")
    ap.add_argument("--grid", default="92,56", help="patches per page (rows, columns): ~1,290 image tokens, the e2e corpus's pages")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--first-shapes", type=int, default=0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from fixtures.checkpoints import make_model

    from docproc.models.loader import build_vision, read_config

    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "m", geometry=args.geometry, weights=False)
        hf = read_config(folder)
    vision = build_vision(hf, dev, torch.bfloat16)
    with torch.no_grad():
        for p in vision.parameters():
            p.normal_(0, 0.02)
    vision.eval()
    vcfg = hf.vision_config
    per_patch = 3 * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    h, w = (int(x) for x in args.grid.split(","))
    report = {"geometry": args.geometry, "device": torch.cuda.get_device_name(), "grid": [h, w],
              "torch": torch.__version__, "cases": []}
    for pages in (int(x) for x in args.pages.split(",")):
        # pages of slightly different sizes, as a corpus has (one attention call each)
        grid = torch.tensor([[1, h - 2 * (i % 2), w] for i in range(pages)])
        px = torch.randn(int(grid.prod(-1).sum()), per_patch, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            vision.encode(px, grid)
        torch.cuda.synchronize()
        gpu, host = [], []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            vision.encode(px, grid)
            b.record()
            b.synchronize()
            gpu.append(a.elapsed_time(b))
            torch.cuda._sleep(int(2e9))  # ~1 s of the stream busy: no launch below waits for the GPU
            t0 = time.perf_counter()
            vision.encode(px, grid)
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        g, hm = statistics.median(gpu), statistics.median(host)
        case = {"pages": pages, "patches": int(grid.prod(-1).sum()), "gpu_ms": round(g, 3), "host_ms": round(hm, 3),
                "host_over_gpu": round(hm / g, 3)}
        print(json.dumps(case), flush=True)
        report["cases"].append(case)
    if args.first_shapes:
        report["first_shapes"] = first_shapes(vision, per_patch, h, w, args)
    Path(args.json).write_text(json.dumps(report, indent=1))


def first_shapes(vision, per_patch: int, h: int, w: int, args) -> dict:
    from torch.nn.attention import SDPBackend

    dev = torch.device("cuda")
    out = {}
    fresh = iter(range(1, 10_000))
    for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION])):
        vision.sdpa_backends = backends
        rows = []
        for pages in (int(x) for x in args.pages.split(",")):
            for _ in range(args.first_shapes):
                k = next(fresh)
                grid = torch.tensor([[1, h - 2 * k, w] for _ in range(pages)])
                px = torch.randn(int(grid.prod(-1).sum()), per_patch, device=dev, dtype=torch.bfloat16)
                times = []
                for _ in range(2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    vision.encode(px, grid)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                rows.append({"pages": pages, "grid": [h - 2 * k, w], "first_ms": round(times[0], 2),
                             "again_ms": round(times[1], 2)})
        vision.sdpa_backends = None
        extra = [r["first_ms"] - r["again_ms"] for r in rows]
        out[name] = {"median_first_extra_ms": round(statistics.median(extra), 2), "rows": rows}
        print(name, json.dumps(out[name]["median_first_extra_ms"]), flush=True)
    return out


if __name__ == "__main__":
    main()
