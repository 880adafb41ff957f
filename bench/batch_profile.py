"""Where an offline batch's GPU time goes: `bench_engine.py`'s part-b workload (fresh one-page
documents x queries x new tokens, greedy, ignore_eos) run once to warm up and once under
torch.profiler, every kernel put in one part by the engine call that launched it:

- vision: the tower (its attention, its products, the rest);
- prefill steps (any step with a prompt chunk) and decode steps (one token per row): their
  products (matmul kernels), their attention, the rest (norms, rotary, activations, quantization);
- lm_head (the logits product), sampling, grammar;
- idle: the wall time of the profiled batch with no kernel running (host work the GPU waited for).

Each part's share of its own roofline: products and the tower against the measured bf16 matmul
rate (FP8 products against the measured FP8 rate), decode products against the weight bytes a step
reads at the measured copy bandwidth where that bound is the larger, attention against its FLOPs
(prefill) or the KV bytes it reads (decode).

    python3 bench/batch_profile.py --geometry 7b [--quantization fp8] --json out.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
import bench_engine as be  # noqa: E402
from docproc import SamplingParams  # noqa: E402
from fixtures.checkpoints import make_model  # noqa: E402

PRODUCT = re.compile(r"nvjet|gemm|gemv|cutlass|sm90_xmma|_rows_fp8|scaled_mm|matmul|splitk|wgmma", re.I)
ATTENTION = re.compile(r"attn|attention|fmha|flash|sdpa|_combine_kernel", re.I)  # (matched first: cuDNN's
# attention kernels name wgmma too)


def fp8_rate(n: int = 8192) -> float:
    """FLOP/s of a square FP8 product (row-wise scales, bf16 out) through torch._scaled_mm."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    run = functools.partial(torch._scaled_mm, a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t0)


class Tally:
    """What the profiled batch asked of each part: tokens, steps, attention work."""

    def __init__(self, cfg, kv_bytes_per_token: int) -> None:
        self.cfg = cfg
        self.kv_bytes = kv_bytes_per_token
        self.c = collections.Counter()

    def step(self, scheduled) -> str:
        cfg = self.cfg
        qd = cfg.num_attention_heads * cfg.head_dim
        kind = "prefill" if any(s.end - s.start > 1 for s in scheduled) else "decode"
        self.c[f"{kind}_steps"] += 1
        for s in scheduled:
            q = s.end - s.start
            self.c[f"{kind}_tokens"] += q
            # causal attention: query i of the chunk sees start + i + 1 keys
            keys = q * s.start + q * (q + 1) // 2
            self.c[f"{kind}_attention_flops"] += 4 * cfg.num_hidden_layers * qd * keys
            self.c[f"{kind}_kv_bytes"] += s.end * self.kv_bytes
        return kind


def instrument(llm, tally: Tally) -> None:
    """record_function ranges around the engine's calls, named by part."""
    runner = llm.runner
    rf = torch.profiler.record_function

    def wrap(obj, name, label):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def run(*a, **kw):
            with rf(label(*a, **kw) if callable(label) else label):
                return fn(*a, **kw)
        setattr(obj, name, run)

    wrap(runner.model.vision, "encode", "part:vision")
    wrap(runner, "forward", lambda scheduled, *a, **kw: f"part:{tally.step(scheduled)}")
    wrap(runner, "logits", "part:lm_head")
    sampler = runner.sampler
    runner.sampler = lambda *a, **kw: _ranged(rf, "part:sampling", sampler, *a, **kw)
    if runner.grammar is not None:
        wrap(runner.grammar, "mask", "part:grammar")


def _ranged(rf, label, fn, *a, **kw):
    with rf(label):
        return fn(*a, **kw)


def attribute(trace: dict) -> tuple[dict, float, float]:
    """(device microseconds per (part, kind), busy microseconds, span microseconds) from a chrome
    trace: each kernel goes to the innermost part range around the call that launched it."""
    events = trace["traceEvents"]
    ranges = collections.defaultdict(list)  # tid -> [(start, end, part)]
    launches = {}  # correlation -> (tid, ts)
    kernels = []
    for e in events:
        cat = e.get("cat", "")
        if cat == "user_annotation" and e.get("name", "").startswith("part:"):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"][5:]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["tid"], e["ts"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    for r in ranges.values():
        r.sort()
    parts = collections.Counter()
    intervals = []
    for k in kernels:
        tid, ts = launches.get(k.get("args", {}).get("correlation"), (None, None))
        part = "unlabelled"
        if tid is not None:
            best = None
            for lo, hi, name in ranges.get(tid, ()):
                if lo <= ts <= hi and (best is None or hi - lo < best[1] - best[0]):
                    best = (lo, hi, name)
            if best is not None:
                part = best[2]
        name = k.get("name", "")
        kind = "copy" if k["cat"] != "kernel" else \
            "attention" if ATTENTION.search(name) else "products" if PRODUCT.search(name) else "other"
        parts[(part, kind)] += k["dur"]
        intervals.append((k["ts"], k["ts"] + k["dur"]))
    intervals.sort()
    busy, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in intervals:
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                busy += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        busy += cur_hi - cur_lo
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    return parts, busy, span


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7b")
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--layout", default="model", choices=("model", "block"),
                    help="block: FP8 weights in 128 x 128 blocks (as Qwen's FP8 checkpoints), drawn at load")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--page-w", type=int, default=868)
    ap.add_argument("--page-h", type=int, default=1092)
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 1280)
    ap.add_argument("--work", default="/tmp/docproc-profile")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    args.device, args.dtype, args.gpu_util, args.prefetch_workers = "cuda", "bfloat16", 0.85, None
    args.load_format = "dummy"
    folder = make_model(Path(args.work) / args.geometry, geometry=args.geometry, weights=False,
                        dtype=torch.bfloat16, device="cuda", max_pixels=args.max_pixels, init_std=None)
    if args.layout == "block":  # a block-wise FP8 checkpoint's config: the dummy weights are drawn so
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
        (folder / "config.json").write_text(json.dumps(cfg))
        args.quantization = None
    bw, bf16 = be.copy_bandwidth("cuda", 2048), be.matmul_rate("cuda", 8192)
    f8 = fp8_rate()
    llm = be.ours(folder, args, kv_cache_dtype=args.kv)
    d, q, n = args.docs, args.queries, args.new_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    warm = [be.request(8000 + i, be.QUESTIONS[j % 4], args) for i in range(d) for j in range(q)]
    llm.generate(warm, sp)  # every graph and kernel the batch uses, made
    fresh = [be.request(10000 + i, be.QUESTIONS[j % 4], args) for i in range(d) for j in range(q)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(fresh, sp)  # the same batch on other pages, not profiled: its wall time
    torch.cuda.synchronize()
    wall_plain = time.perf_counter() - t0
    reqs = [be.request(9000 + i, be.QUESTIONS[j % 4], args) for i in range(d) for j in range(q)]
    tally = Tally(llm.runner.text_config, llm.cache_info()["bytes_per_token"])
    instrument(llm, tally)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(reqs, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    parts, busy, span = attribute(trace)
    # the batch's work, counted
    grid = llm.processor.grid_thw(reqs[0]["multi_modal_data"]["image"][0])
    patches = grid[0] * grid[1] * grid[2]
    fl = be.flops(llm, patches // llm.processor.merge_size ** 2, patches, 0, 0, 0)  # vision per page
    head = llm.runner.model.text.lm_head.weight  # its own part (lm_head): not the layers' products
    lm_params = sum(p.numel() for p in be.lm_weights(llm)) - head.numel()
    step_bytes = be.lm_bytes_per_step(llm) - head.numel() * head.element_size()
    fp8 = args.quantization == "fp8" or args.layout == "block"
    peak_products = f8 if fp8 else bf16
    c = tally.c
    ms = {f"{p}/{k}": round(v / 1e3, 2) for (p, k), v in sorted(parts.items(), key=lambda kv: -kv[1])}

    def t(part, kind=None):
        return sum(v for (p, k), v in parts.items() if p == part and (kind is None or k == kind)) / 1e6

    def share(work_s, time_s):
        return round(work_s / time_s, 3) if time_s else None

    roof = {
        "vision": share(fl["vision"] * d / bf16, t("vision")),
        "prefill_products": share(2 * lm_params * c["prefill_tokens"] / peak_products, t("prefill", "products")),
        "prefill_attention": share(c["prefill_attention_flops"] / bf16, t("prefill", "attention")),
        "decode_products": share(max(step_bytes * c["decode_steps"] / bw,
                                     2 * lm_params * c["decode_tokens"] / peak_products), t("decode", "products")),
        "decode_attention": share(c["decode_kv_bytes"] / bw, t("decode", "attention")),
    }
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "args": vars(args), "machine": {"copy_GBps": round(bw / 1e9, 1), "bf16_TFLOPs": round(bf16 / 1e12, 1),
                                           "fp8_TFLOPs": round(f8 / 1e12, 1)},
           "wall_s": round(wall, 3), "pages_per_s_profiled": round(d / wall, 2),
           "wall_unprofiled_s": round(wall_plain, 3), "pages_per_s": round(d / wall_plain, 2),
           "kernel_span_s": round(span / 1e6, 3), "busy_s": round(busy / 1e6, 3),
           "idle_share_of_wall": round(1 - busy / 1e6 / wall, 3),
           "counts": dict(c), "ms_by_part": ms,
           "share_of_busy": {p: round(t(p) / (busy / 1e6), 3) for p in sorted({p for p, _ in parts})},
           "share_of_own_roofline": roof}
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
