"""Engine benchmarks for the device (issue #7), against transformers and against the rooflines.

Random-weight models with Qwen2-VL-2B / -7B geometry are built from config (no download); pages are
synthetic 868x1092 images (about 1,200 image tokens each). Every part writes its figures into one
JSON file; a part that fails records its error and the others still run.

    python scripts/bench_engine.py --parts a,c --json bench/results/DATE_engine_ac.json   # 7B / 2B
    python scripts/bench_engine.py --parts b,d --json bench/results/DATE_engine_bd.json   # 2B
    python scripts/bench_engine.py --geometry tiny --draft-geometry tiny-draft --device cpu --small \
        --kv fp32,fp4 --json /tmp/b.json   # CPU check (tests/test_bench_engine.py)

On the device so far (2026-11-30): every part, several times (BENCHMARKS.md); part d only at 4 GiB,
256 requests x 64 tokens, before its decode-only figure existed.

(a) batch-1 decode: tokens/s of ours and of transformers' `generate` on the same weights and
    prompt (one page + a question), and the bandwidth roofline: (LM weight bytes + KV bytes of
    the context) per step over the copy bandwidth measured in the same run.
(b) offline batch: D documents x Q queries, one page each, N new tokens (ignore_eos): pages/s and
    tokens/s of ours with bf16 and FP4 KV, of transformers at each batch size tried (it recomputes
    the page for every query), and the compute roofline: FLOPs of the vision tower once per page +
    prefill of the unique prompt tokens + decode, over the bf16 matmul rate measured in the run.
(c) speculation with acceptance controlled: the real draft forwards run, then at verification each
    proposal counts as the target's own greedy token with probability a (else as one it rejects);
    speedup over no draft at each a, batch size and K, next to E(a,K)/(1+Kc) with c = draft
    forward time / target step time measured by the engine in the run (and with r, the target's
    extra cost per verified position). Each pass draws a new acceptance pattern; the acceptance
    the passes realized is recorded, and each K's speedups are interpolated in it at
    --spec-interpolate-at (between the --accept cells whose realized acceptance brackets it).
(d) memory: at one fixed KV budget, the most sequences running at once (measured in the
    scheduler) for bf16 and FP4 KV, with 1 query per page and with 4 queries per page, and the
    tokens/s of the steps that only decoded (the memory-bound phase; the whole run's tokens/s is
    dominated by the page encodes and prefills).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # fixtures: random checkpoints

import kernels.pdl as kernels_pdl  # noqa: E402
from docproc import LLM, SamplingParams  # noqa: E402
from docproc.models.quant import Fp8Weight  # noqa: E402
from docproc.engine.spec.policy import expected_tokens  # noqa: E402
from docproc.pipeline.queries import build_prompt  # noqa: E402
from fixtures.checkpoints import make_model, share_vision_trunk  # noqa: E402

QUESTIONS = ["What is the vendor name?", "What is the total amount?", "What is the document date?",
             "Return vendor, invoice_number, date, due_date, currency and total as a JSON object."]


# ---- measurements of the machine --------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - t0)


def matmul_rate(device: str, n: int) -> float:
    """FLOP/s of a square bf16 matmul (fp32 on CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


@functools.lru_cache(maxsize=16)
def page(seed: int, w: int, h: int) -> Image.Image:
    """A page-sized image, different for every seed (so no two documents share a prefix). The
    queries of one document get the same image object, which the engine hashes once per call, as
    `docproc run` hashes each rendered page once (it passes the SHA-256 along)."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 255, np.uint8)
    for y in range(40, h - 40, 24):  # text-like rows of dark specks
        n = int(rng.integers(20, 80))
        xs = rng.integers(40, w - 40, n)
        img[y:y + 10, :][:, xs] = rng.integers(0, 120, (10, n, 1), dtype=np.uint8)
    return Image.fromarray(img)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- model arithmetic ---------------------------------------------------------------------------------
def lm_weights(llm: LLM) -> list[torch.Tensor]:
    """The language-model weights one decode step reads: all but the embedding table (one row is
    gathered), the LM head included (the embedding table itself when tied). A product held in FP8
    (not a parameter: the loader sets it beside its module) counts its codes; lm_scales() has its
    scales."""
    text = llm.runner.model.text
    out = [p for name, p in text.named_parameters() if not name.startswith("embed_tokens")]
    fused = [w for layer in text.layers for w in layer_products(layer)]
    # a bf16 product's fused weight is a view of its modules' parameters (already counted) only if
    # it shares their storage; a fused copy or an FP8 weight is counted here
    params = {p.untyped_storage().data_ptr() for p in out}
    for w in fused:
        t = w.data if isinstance(w, Fp8Weight) else w
        if t.untyped_storage().data_ptr() not in params:
            out.append(t)
    if text.lm_head.weight is text.embed_tokens.weight:
        out.append(text.lm_head.weight)
    return out


def layer_products(layer) -> list:
    return [layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight]


def lm_scales(llm: LLM) -> list[torch.Tensor]:
    return [w.scale for layer in llm.runner.model.text.layers for w in layer_products(layer)
            if isinstance(w, Fp8Weight)]


def lm_bytes_per_step(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in [*lm_weights(llm), *lm_scales(llm)])


def flops(llm: LLM, image_tokens: int, patches: int, prompt_tokens: int, new_tokens: int, queries: int) -> dict:
    """Forward FLOPs for one page asked `queries` questions with the prefix computed once:
    2 x params per token for the matmuls, plus attention (4 x context x head_dim x heads)."""
    cfg = llm.runner.text_config
    lm_params = sum(p.numel() for p in lm_weights(llm))
    vis = llm.runner.model.vision
    vis_params = sum(p.numel() for p in vis.parameters())
    vc = llm.runner.hf_config.vision_config
    vis_dim = getattr(vc, "embed_dim", None) or vc.hidden_size
    vision = 2 * vis_params * patches + 4 * patches * patches * vis_dim * vc.depth
    q_dim = cfg.num_attention_heads * cfg.head_dim
    question = prompt_tokens - image_tokens
    prefill_tokens = image_tokens + queries * question
    prefill = 2 * lm_params * prefill_tokens + 2 * cfg.num_hidden_layers * q_dim * (
        image_tokens**2 + queries * question * (2 * image_tokens + question))
    ctx_mean = prompt_tokens + new_tokens / 2
    decode = queries * new_tokens * (2 * lm_params + 4 * cfg.num_hidden_layers * q_dim * ctx_mean)
    return {"vision": vision, "prefill": prefill, "decode": decode, "total": vision + prefill + decode}


# ---- ours and transformers ----------------------------------------------------------------------------
def ours(folder: Path, args, **kw) -> LLM:
    # --quantization applies to the target (the engine leaves a draft in its checkpoint's format);
    # --load-format dummy draws every model's weights from its config.json (sizes no disk holds)
    kw = {"quantization": args.quantization, "load_format": args.load_format,
          "batch_invariant": args.batch_invariant, **kw}
    return LLM(str(folder), device=args.device, dtype=args.dtype, gpu_memory_utilization=args.gpu_util,
               max_num_batched_tokens=args.batched_tokens, image_prefetch_workers=args.prefetch_workers, **kw)


def request(seed: int, question: str, args) -> dict:
    return {"prompt": build_prompt(1, question), "multi_modal_data": {"image": [page(seed, args.page_w, args.page_h)]}}


def hf_model(folder: Path, args):
    from transformers import Qwen2VLForConditionalGeneration

    dtype = getattr(torch, args.dtype)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    return model.to(args.device).eval()


def hf_batch(llm: LLM, reqs: list[dict], device: str) -> dict:
    """transformers inputs for a batch of one-image prompts (left padding, as generate wants)."""
    proc = llm.processor
    rows, images = [], []
    for r in reqs:
        ids, _, loaded = proc.process(r["prompt"], None, r["multi_modal_data"]["image"])
        rows.append(ids)
        images.extend(im.image for im in loaded)
    n = max(len(r) for r in rows)
    pad = proc.tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r)
        mask[i, n - len(r):] = 1
    pv, grid = proc.pixel_values(images)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "pixel_values": pv.to(device),
            "image_grid_thw": grid.to(device), "mm_token_type_ids": (ids == proc.image_token_id).int().to(device)}


@torch.inference_mode()
def hf_generate(model, inputs: dict, new_tokens: int, device: str) -> float:
    """Seconds for generate() of exactly new_tokens tokens per row, greedy."""
    sync(device)
    t0 = time.perf_counter()
    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=inputs["input_ids"][0, 0].item())
    sync(device)
    return time.perf_counter() - t0


# ---- parts ---------------------------------------------------------------------------------------------
def part_a(folder: Path, args, env: dict) -> dict:
    """Batch-1 decode."""
    n = args.new_tokens
    req = request(1, QUESTIONS[1], args)
    llm = ours(folder, args)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate([request(99, QUESTIONS[0], args)], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up

    def decode_tps():
        m = llm.generate([req], sp)[0].metrics  # the prompt is prefix-cached after the first call
        return (n - 1) / (m.total_time - m.time_to_first_token), m

    graphs = llm.runner.graphs
    runs = [decode_tps() for _ in range(3)]  # the best of three: noise only slows
    ours_tps, m = max(runs, key=lambda r: r[0])
    # the same engine reading every step's tokens before launching the next (no overlapped decode)
    llm.overlap.enabled = False
    no_overlap_tps = max(decode_tps()[0] for _ in range(3))
    llm.overlap.enabled = True
    overlapped = llm.num_overlapped_steps
    def without(**off) -> float:
        """tokens/s with the engine's kernel options `off` (KernelOptions fields set to False); then
        as before again, graphs recaptured by a warm-up pass."""
        with kernels_off(llm, **off):
            tps = max(decode_tps()[0] for _ in range(3))
        decode_tps()
        return tps

    # cuBLAS for the one-row products; every kernel in plain stream order (no programmatic dependent launch)
    opts = llm.runner.kernel_options
    no_gemv_tps = without(one_row=False) if graphs is not None and opts.one_row else None
    no_pdl_tps = (without(pdl=False) if graphs is not None and kernels_pdl.enabled_on(llm.runner.device, opts.pdl)
                  else None)
    eager_tps = None
    if graphs is not None:  # the same engine with its CUDA graphs switched off
        llm.runner.graphs = None
        eager_tps = max(decode_tps()[0] for _ in range(2))
        llm.runner.graphs = graphs
    ctx = m.num_prompt_tokens + n // 2
    info = llm.cache_info()
    profile = profile_decode(llm, req, args) if args.profile_steps else None
    step_bytes = lm_bytes_per_step(llm) + ctx * info["bytes_per_token"]
    roofline_tps = env["copy_bandwidth"] / step_bytes
    inputs = hf_batch(llm, [req], args.device) if not args.no_transformers else None
    del llm
    free()
    hf_tps = None
    if inputs is not None:
        model = hf_model(folder, args)
        hf_generate(model, inputs, 4, args.device)  # warm-up
        t1 = min(hf_generate(model, inputs, 1, args.device) for _ in range(3))  # the best of three: noise only adds
        tn = min(hf_generate(model, inputs, n, args.device) for _ in range(3))
        hf_tps = (n - 1) / (tn - t1)
        del model
        free()
    return {"new_tokens": n, "prompt_tokens": m.num_prompt_tokens, "ours_tokens_per_s": round(ours_tps, 2),
            "ours_eager_tokens_per_s": eager_tps and round(eager_tps, 2), "step_graphs": info["step_graphs"],
            "ours_no_overlap_tokens_per_s": round(no_overlap_tps, 2), "overlapped_steps": overlapped,
            "ours_cublas_one_row_tokens_per_s": no_gemv_tps and round(no_gemv_tps, 2),
            "ours_no_pdl_tokens_per_s": no_pdl_tps and round(no_pdl_tps, 2),
            "ours_ttft_s": round(runs[0][1].time_to_first_token, 4),  # the first run: prompt not yet cached
            "transformers_tokens_per_s": hf_tps and round(hf_tps, 2),
            "speedup_vs_transformers": hf_tps and round(ours_tps / hf_tps, 2), "bytes_per_step": step_bytes,
            "roofline_tokens_per_s": round(roofline_tps, 2), "share_of_roofline": round(ours_tps / roofline_tps, 3),
            **({"profile": profile} if profile else {})}


def profile_summary(fn, device: str) -> dict:
    """Run fn under torch.profiler: wall seconds, device-busy seconds (the sum of every device
    op's own time; less than the wall time when the device waited for the host), and the top 20
    operators by device time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    ka = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    # device time is listed twice: under the operator that launched a kernel (its self device time)
    # and as the kernel itself. Busy time and the device table count the kernels (and copies) only;
    # until the eleventh session both were summed, up to twice the true busy time.
    on_dev = [e for e in ka if getattr(e, "device_type", None) == DeviceType.CUDA]
    busy_us = sum(getattr(e, dev_key, 0) for e in on_dev) if device == "cuda" else 0.0
    rows = lambda evs, key: [{"op": e.key, "calls": e.count, "self_us": round(getattr(e, key), 1)}  # noqa: E731
                             for e in sorted(evs, key=lambda e: -getattr(e, key))[:20]]
    ops = [e for e in ka if getattr(e, "device_type", None) != DeviceType.CUDA]
    return {"wall_s": round(wall, 4), "device_busy_s": round(busy_us / 1e6, 4),
            "top_device": rows(on_dev, dev_key) if device == "cuda" else [],
            "top_ops_by_device_time": rows(ops, dev_key) if device == "cuda" else [],
            "top_host": rows(ops, "self_cpu_time_total")}


def host_profile(fn, top: int = 40) -> dict:
    """Run fn under cProfile: where the host's time goes, by function (the Python side of the
    engine: scheduler, input preparation, launches, waits on the device). cProfile adds its own
    cost per Python call, so shares, not absolute seconds, are the figures to read."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)

    def rows(key: int) -> list[dict]:
        items = sorted(st.stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"fn": f"{Path(f).name}:{line}({name})", "calls": nc, "tottime_s": round(tt, 4),
                 "cumtime_s": round(ct, 4)} for (f, line, name), (cc, nc, tt, ct, _) in items]

    return {"wall_s": round(wall, 4), "by_tottime": rows(2), "by_cumtime": rows(3)}


@contextlib.contextmanager
def kernels_off(llm, **off):
    """The engine's kernel options with the fields `off` set to False inside, restored after; the
    step graphs (if any) are dropped on both sides so that they are captured anew with the options
    as they are (a new memory pool too: capturing into one whose graphs are gone fails)."""
    graphs = llm.runner.graphs

    def drop():
        if graphs is not None:
            graphs.graphs.clear()
            graphs.pool = None

    was = llm.runner.kernel_options
    llm.runner.set_kernel_options(dataclasses.replace(was, **{k: False for k in off}))
    drop()
    try:
        yield
    finally:
        llm.runner.set_kernel_options(was)
        drop()


def profile_decode(llm, req, args) -> dict:
    """Where a batch-1 decode step's time goes: profile_summary over --profile-steps decode steps
    (after a prefix-cached prompt), per step."""
    n = args.profile_steps
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # with programmatic dependent launch a kernel's time includes its wait for the one before
    # (kernels/pdl.py), so the profile runs with it off, the step graphs captured anew
    with kernels_off(llm, pdl=False):
        llm.generate([req], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # prompt now cached
        prof = profile_summary(lambda: llm.generate([req], sp), args.device)
    return {"steps": n, "pdl": False, "wall_s": prof["wall_s"], "wall_ms_per_step": round(1e3 * prof["wall_s"] / n, 3),
            "device_busy_ms_per_step": round(1e3 * prof["device_busy_s"] / n, 3),
            "top_device": prof["top_device"], "top_host": prof["top_host"]}


def vision_backends(llm: LLM, args, vision_flops: float, pages: int = 4, repeats: int = 3) -> dict:
    """The vision tower alone on fresh pages with each SDPA backend torch offers for its per-image
    attention (head dim 80 at Qwen2-VL's geometry; torch's default is cuDNN's flash kernel on the
    H200): ms per page (best of `repeats`) and TFLOP/s on the tower's FLOPs, or the backend's
    error where it cannot run these shapes (on a CPU, those it has no CPU kernel for)."""
    from torch.nn.attention import SDPBackend

    vision = llm.runner.model.vision
    pv, grid = llm.processor.pixel_values([page(9000 + i, args.page_w, args.page_h) for i in range(pages)])
    pv = pv.to(args.device)
    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    res: dict = {"pages": pages, "fast_path": bool(vision.fast_attention and args.device == "cuda")}
    try:
        for name in ("default", *names):
            vision.sdpa_backends = None if name == "default" else [names[name]]
            try:
                vision.encode(pv, grid)  # warm: this backend's kernels loaded
                sync(args.device)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    vision.encode(pv, grid)
                    sync(args.device)
                    best = min(best, time.perf_counter() - t0)
                res[name] = {"ms_per_page": round(1e3 * best / pages, 3),
                             "tflops": round(vision_flops * pages / best / 1e12, 1)}
            except RuntimeError as e:
                res[name] = f"error: {str(e)[:200]}"
    finally:
        vision.sdpa_backends = None
    return res


def first_use_costs(before: dict, after: dict) -> dict:
    """One-off costs paid inside a timed run, from two cache_info() readings: CUDA graphs
    captured (each the first step of its batch/window/split shape) and Triton kernel variants
    compiled (none, if the engine's warm-up covered every launch)."""
    return {"graph_captures": after["num_cuda_graphs"] - before["num_cuda_graphs"],
            "graph_capture_seconds": round(after["cuda_graph_capture_seconds"] - before["cuda_graph_capture_seconds"], 3),
            "kernel_compiles": after["kernel_compiles_after_warmup"] - before["kernel_compiles_after_warmup"],
            "kernel_compile_seconds": round(after["kernel_compile_seconds_after_warmup"]
                                            - before["kernel_compile_seconds_after_warmup"], 3)}


def part_b(folder: Path, args, env: dict) -> dict:
    """Offline batch: D documents x Q queries."""
    d, q, n = args.docs, args.queries, args.new_tokens
    reqs = [request(1000 + i, QUESTIONS[j % len(QUESTIONS)], args) for i in range(d) for j in range(q)]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    res: dict = {"documents": d, "queries_per_document": q, "new_tokens": n}
    # --b-weights model,fp8: the checkpoint's weights and FP8 quantized at load, each with every KV format
    runs = [(w, kv) for w in args.b_weights for kv in args.kv]
    for w, kv in runs:
        llm = ours(folder, args, kv_cache_dtype=kv, **({"quantization": "fp8"} if w == "fp8" else {}))
        key = kv if w == "model" else f"fp8w_{kv}"
        llm.generate([request(7, QUESTIONS[0], args)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        sync(args.device)
        before = llm.cache_info()
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp)
        sync(args.device)
        dt = time.perf_counter() - t0
        first_use = first_use_costs(before, llm.cache_info())
        # the same batch again on fresh pages (nothing cached from the first pass): what a long run
        # gets once every CUDA graph it needs is captured
        reqs2 = [request(3000 + i, QUESTIONS[j % len(QUESTIONS)], args) for i in range(d) for j in range(q)]
        before = llm.cache_info()
        t1 = time.perf_counter()
        llm.generate(reqs2, sp)
        sync(args.device)
        dt2 = time.perf_counter() - t1
        second = {"seconds": round(dt2, 3), "pages_per_s": round(d / dt2, 3),
                  "first_use": first_use_costs(before, llm.cache_info()),
                  "overlapped_steps": llm.num_overlapped_steps}
        if args.overlap_ablation:  # once more on fresh pages, every step's tokens read before the next
            reqs3 = [request(4000 + i, QUESTIONS[j % len(QUESTIONS)], args) for i in range(d) for j in range(q)]
            llm.overlap.enabled = False
            t3 = time.perf_counter()
            llm.generate(reqs3, sp)
            sync(args.device)
            dt3 = time.perf_counter() - t3
            llm.overlap.enabled = True
            second["no_overlap"] = {"seconds": round(dt3, 3), "pages_per_s": round(d / dt3, 3)}
        m = outs[0].metrics
        grid = llm.processor.grid_thw(reqs[0]["multi_modal_data"]["image"][0])
        patches = grid[0] * grid[1] * grid[2]
        image_tokens = patches // llm.processor.merge_size ** 2
        f = flops(llm, image_tokens, patches, m.num_prompt_tokens, n, q)
        roofline_pages = env["matmul_flops"] / f["total"]
        res[f"ours_{key}"] = {"seconds": round(dt, 3), "pages_per_s": round(d / dt, 3),
                             "tokens_per_s": round(d * q * n / dt, 1),
                             "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outs),
                             "preemptions": llm.cache_info()["num_preemptions"],
                             "share_of_compute_roofline": round(d / dt / roofline_pages, 3),
                             "image_prefetch": {"workers": llm.runner.prefetcher.workers,
                                                "prefetched": llm.runner.prefetcher.num_prefetched,
                                                "inline": llm.runner.prefetcher.num_inline},
                             "first_use": first_use, "second_pass": second,
                             "kernel_warmup_seconds": before["kernel_warmup_seconds"],
                             "kernel_warmup_compiles": before["kernel_warmup_compiles"],
                             "weights_fp8": before["weights_fp8"], "weight_bytes": before["weight_bytes"]}
        res["flops_per_page"] = f
        res["compute_roofline_pages_per_s"] = round(roofline_pages, 3)
        first = (w, kv) == runs[0]
        if first and not args.no_vision_backends:
            res["vision_tower_sdpa_backends"] = vision_backends(llm, args, f["vision"], pages=1 if args.small else 4,
                                                                repeats=1 if args.small else 3)
        if args.profile_docs and first:
            # where the offline batch's time goes: fresh documents (nothing cached), profiled
            preqs = [request(5000 + i, QUESTIONS[j % len(QUESTIONS)], args)
                     for i in range(args.profile_docs) for j in range(q)]
            res[f"profile_{kv}"] = {"documents": args.profile_docs,
                                    **profile_summary(lambda: llm.generate(preqs, sp), args.device)}
        if args.host_profile_docs and first:
            hreqs = [request(7000 + i, QUESTIONS[j % len(QUESTIONS)], args)
                     for i in range(args.host_profile_docs) for j in range(q)]
            res[f"host_profile_{kv}"] = {"documents": args.host_profile_docs,
                                         **host_profile(lambda: (llm.generate(hreqs, sp), sync(args.device)))}
        if first and not args.no_transformers:
            inputs_all = [hf_batch(llm, reqs[i:i + b], args.device) for b in args.hf_batches for i in [0]]
        del llm
        free()
    if "fp8" in args.b_weights and "model" in args.b_weights:
        for kv in args.kv:
            res[f"fp8w_vs_model_{kv}_pages_per_s"] = round(res[f"ours_fp8w_{kv}"]["second_pass"]["pages_per_s"]
                                                            / res[f"ours_{kv}"]["second_pass"]["pages_per_s"], 3)
    if args.no_transformers:
        return res
    model = hf_model(folder, args)
    best = None
    for b, inputs in zip(args.hf_batches, inputs_all):
        if b > len(reqs):
            continue
        try:
            hf_generate(model, inputs, 2, args.device)  # warm-up
            dt = hf_generate(model, inputs, n, args.device)
        except torch.OutOfMemoryError:
            free()
            res[f"transformers_batch_{b}"] = "out of memory"
            continue
        tps = b * n / dt
        res[f"transformers_batch_{b}"] = {"seconds": round(dt, 3), "tokens_per_s": round(tps, 1),
                                           "pages_per_s": round(b / q / dt, 3)}
        if best is None or tps > best[1]:
            best = (b, tps)
    del model
    free()
    if best:
        res["transformers_best"] = {"batch": best[0], "tokens_per_s": round(best[1], 1)}
        for w, kv in runs:
            r = res[f"ours_{kv}" if w == "model" else f"ours_fp8w_{kv}"]
            r["speedup_vs_transformers_best"] = round(r["tokens_per_s"] / best[1], 2)
    return res


class ControlledAcceptance:
    """Benchmark-only: the real draft forwards run, then at verification each proposal counts as
    the target's own greedy token with probability a, else as a token the target surely rejects.
    Acceptance is then exactly controlled whatever bf16 near-ties in random weights do to greedy
    continuations, the step costs are the real ones, and the emitted tokens are the target's."""

    def __init__(self, a: float, seed: int) -> None:
        import docproc.engine.spec.rejection as rejection

        self.mod, self.real, self.a, self.rng = rejection, rejection.accept_greedy, a, random.Random(seed)
        self.tried = self.passed = 0  # positions decided (up to the first rejection) and accepted
        rejection.accept_greedy = self.accept

    def accept(self, top, draft_tokens):
        toks = [top[i] if self.rng.random() < self.a else -1 for i in range(len(draft_tokens))]
        emitted, j = self.real(top, toks)
        self.passed += j
        self.tried += j + (1 if j < len(toks) else 0)
        return emitted, j

    def close(self) -> None:
        self.mod.accept_greedy = self.real


def timed(llm: LLM, reqs: list, sp: SamplingParams, device: str) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, sp)
    sync(device)
    return time.perf_counter() - t0, outs


def paired(plain_s: list[float], spec_s: list[float]) -> dict:
    """Speedup figures from alternated passes: the best of each (as before the seventh session),
    and the median and range of the per-repeat ratios (each pair ran back to back, so a slow
    stretch of the machine hits both sides of a ratio)."""
    ratios = sorted(p / q for p, q in zip(plain_s, spec_s))
    return {"speedup": round(min(plain_s) / min(spec_s), 3),
            "speedup_paired_median": round(statistics.median(ratios), 3),
            "speedup_paired_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            "paired_seconds": [[round(p, 6), round(q, 6)] for p, q in zip(plain_s, spec_s)]}


@contextlib.contextmanager
def draft_detached(llm: LLM):
    """The speculative engine as a plain one: the same target runner, graphs and KV pool, its
    draft out of every step (for targets two copies of which do not fit the device)."""
    spec, llm.speculator = llm.speculator, None
    try:
        yield llm
    finally:
        llm.speculator = spec


def set_k(llm: LLM, k) -> None:
    """A fixed K (at most the engine's k_max of 8) or the adaptive policy, on one engine."""
    pol = llm.speculator.policy
    pol.fixed, pol.k_max = (False, 8) if k == "auto" else (True, int(k))


def interpolate(runs: list[dict], at: list[float]) -> list[dict]:
    """Each (batch, K)'s speedups at the acceptances `at`, linear in the acceptance the passes
    realized between the two cells whose realized acceptance brackets it (none where no two do)."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("acceptance_realized") is not None:
            groups.setdefault((r["batch"], str(r["k"]), r.get("draft_chain")), []).append(r)
    for (b, k, chain), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["acceptance_realized"])
        for target in at:
            for lo, hi in zip(rows, rows[1:]):
                x0, x1 = lo["acceptance_realized"], hi["acceptance_realized"]
                if x0 <= target <= x1 and x1 > x0:
                    f = (target - x0) / (x1 - x0)
                    out.append({"batch": b, "k": k, "draft_chain": chain, "a": target,
                                "between": [x0, x1],
                                **{key: round(lo[key] + f * (hi[key] - lo[key]), 3)
                                   for key in ("speedup", "speedup_paired_median")}})
                    break
    return out


def part_c(folder: Path, draft: Path, args, env: dict) -> dict:
    """Speculation with controlled acceptance. The plain engine stays loaded beside each
    speculative engine (one per K) and the two alternate, pass by pass, for every batch size and
    a: the device's slow and fast stretches (several % between calls) then hit both sides of each
    ratio. Both engines get the same KV budget (--spec-kv-bytes), both are warmed on each batch
    (graphs captured, prompts cached) before any pass is timed."""
    n = args.spec_new_tokens
    res: dict = {"new_tokens": n, "repeats": args.spec_repeats, "baselines": {}, "runs": []}
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    warm = [request(5, QUESTIONS[0], args)]
    batches = {b: [request(2000 + i, QUESTIONS[i % len(QUESTIONS)], args) for i in range(b)] for b in args.spec_batches}
    one = args.spec_one_engine
    if one:
        if any(k != "auto" and k > 8 for k in args.spec_k):
            raise ValueError("--spec-one-engine takes fixed K values up to 8 (the adaptive engine's k_max)")
        res["baseline"] = "the speculative engine with its draft detached (one target on the device)"
        shared = ours(folder, args, speculative_model=str(draft), num_speculative_tokens="auto",
                      kv_cache_memory_bytes=args.spec_kv_bytes)
        res["engine"] = {k: v for k, v in shared.cache_info().items()
                         if k in ("weights_fp8", "weight_bytes", "load_seconds", "kernel_warmup_seconds")}
        plain_cm = draft_detached(shared)
        plain = plain_cm.__enter__()
    else:
        plain = ours(folder, args, kv_cache_memory_bytes=args.spec_kv_bytes)
    plain.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    base_all: dict[int, list[float]] = {b: [] for b in batches}
    for reqs in batches.values():
        plain.generate(reqs, sp)  # prompts cached, graphs of every batch size captured
    if one:
        plain_cm.__exit__(None, None, None)
    for k in args.spec_k:
        if one:
            llm = shared
            set_k(llm, k)
        else:
            llm = ours(folder, args, speculative_model=str(draft), num_speculative_tokens=k,
                       kv_cache_memory_bytes=args.spec_kv_bytes)
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
        for b, reqs in batches.items():
            llm.generate(reqs, SamplingParams(max_tokens=2, ignore_eos=True))  # prompts cached, as for plain
            for a, chain in ((a, chain) for a in args.accept for chain in args.spec_chain):
                # greedy draft rounds chained on the device (Proposer.chain_greedy) or one sync per
                # round: the same engine, switched, so the two are compared on one machine
                llm.speculator.chain_greedy = chain == "on"
                chained_before = llm.spec_info()["draft_chained_rounds"]
                seed = int(a * 1000) + (k if isinstance(k, int) else 0)
                if args.spec_reset_acceptance:
                    # what the adaptive policy learned on earlier passes (the warm-ups run the
                    # random draft uncontrolled: it is never accepted) is forgotten; the untimed
                    # pass below teaches it this a, as a fresh engine's first requests would
                    llm.speculator.policy.reset_acceptance()
                llm.speculator.policy.batch = b
                policy_before = llm.speculator.policy.state()  # catch-up priced for 1,024 tokens
                skips_before = llm.spec_info()["catch_up_skips"]
                ctl = ControlledAcceptance(a, seed=seed)
                try:
                    llm.generate(reqs, sp)  # untimed: this (b, a)'s verify graphs captured
                finally:
                    ctl.close()
                plain_s, spec_s = [], []
                tried = passed = 0
                k_hist_before = dict(llm.spec_info()["k_histogram"])
                for rep in range(args.spec_repeats):
                    if one:
                        with draft_detached(llm):
                            plain_s.append(timed(llm, reqs, sp, args.device)[0])
                    else:
                        plain_s.append(timed(plain, reqs, sp, args.device)[0])
                    # a new acceptance pattern each pass: one seed's luck (a few dozen
                    # verifications a pass at batch 1) would otherwise repeat in every pass
                    ctl = ControlledAcceptance(a, seed=seed + 7919 * (rep + 1))
                    try:
                        dt, outs = timed(llm, reqs, sp, args.device)
                    finally:
                        ctl.close()
                    tried, passed = tried + ctl.tried, passed + ctl.passed
                    spec_s.append(dt)
                k_hist = {int(kk): n - k_hist_before.get(kk, 0)
                          for kk, n in llm.spec_info()["k_histogram"].items() if n - k_hist_before.get(kk, 0)}
                base_all[b].extend(plain_s)
                prop = sum(o.metrics.draft_proposed for o in outs)
                acc = sum(o.metrics.draft_accepted for o in outs)
                pol = llm.speculator.policy
                pol.batch = b
                c, r = pol.cost_ratio, pol.verify_cost  # measured by the engine on this run's steps
                row = {"batch": b, "k": k, "a": a, "seconds": round(min(spec_s), 3),
                       "baseline_seconds": round(min(plain_s), 3), **paired(plain_s, spec_s),
                       "acceptance_rate": round(acc / prop, 4) if prop else None,
                       # the per-position acceptance the timed passes drew (a of E(a, K)), and the
                       # K each verification used (the adaptive policy's choices)
                       "acceptance_realized": round(passed / tried, 4) if tried else None,
                       "k_histogram": k_hist,
                       "cost_ratio_c": round(c, 4), "verify_cost_r": round(r, 4), "draft_chain": chain,
                       "overlap_ratio": round(pol.overlap_ratio, 4),
                       "draft_chained_rounds": llm.spec_info()["draft_chained_rounds"] - chained_before,
                       "bypassed_steps": sum(o.metrics.draft_bypassed_steps for o in outs),
                       # the adaptive policy's beliefs before this (b, a)'s passes and after them
                       "catch_up_skips": llm.spec_info()["catch_up_skips"] - skips_before,
                       "policy_before": policy_before, "policy_after": pol.state()}
                if k != "auto":  # the adaptive policy picks K per step: no single analytic figure
                    row["analytic_speedup"] = round(expected_tokens(a, k) / (1 + k * c), 3)
                    row["analytic_speedup_with_r"] = round(expected_tokens(a, k) / (1 + k * (c + r)), 3)
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
        if not one:
            del llm
            free()
    res["interpolated"] = interpolate(res["runs"], args.spec_interpolate_at)
    for b, times in base_all.items():
        if times:
            best = min(times)
            res["baselines"][str(b)] = {"seconds": round(best, 3), "median_seconds": round(statistics.median(times), 3),
                                        "tokens_per_s": round(b * n / best, 1)}
    if one:
        del shared
    del plain
    free()
    return res


def part_d(folder: Path, args, env: dict) -> dict:
    """Most sequences running at once at one KV budget."""
    res: dict = {"kv_cache_memory_bytes": args.kv_budget, "new_tokens": args.mem_new_tokens}
    sp = SamplingParams(temperature=0.0, max_tokens=args.mem_new_tokens, ignore_eos=True)
    for kv in args.kv:
        for q in (1, 4):
            llm = ours(folder, args, kv_cache_dtype=kv, kv_cache_memory_bytes=args.kv_budget,
                       max_num_seqs=1024)
            docs = max(1, args.mem_requests // q)
            reqs = [request(3000 + i, QUESTIONS[j], args) for i in range(docs) for j in range(q)]
            llm.generate(reqs[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # kernels compiled
            sync(args.device)
            t0 = time.perf_counter()
            llm.generate(reqs, sp)
            sync(args.device)
            dt = time.perf_counter() - t0
            info = llm.cache_info()
            # tokens/s at this KV budget: with one query per page the pool, not the batch limit,
            # bounds how many sequences decode together (the memory-bound configuration)
            res[f"{kv}_q{q}"] = {"requests": len(reqs), "max_running": llm.scheduler.max_running,
                                 "seconds": round(dt, 3), "tokens_per_s": round(len(reqs) * args.mem_new_tokens / dt, 1),
                                 "num_blocks": info["num_blocks"], "bytes_per_token": info["bytes_per_token"],
                                 "preemptions": info["num_preemptions"],
                                 # steps that only decoded: the memory-bound phase, without the page
                                 # encodes and prefills that dominate `seconds`
                                 "decode_steps": llm.num_decode_steps,
                                 "decode_tokens_per_s": round(llm.num_decode_step_tokens
                                                              / max(llm.decode_step_seconds, 1e-9), 1),
                                 "mean_decode_batch": round(llm.num_decode_step_tokens
                                                            / max(llm.num_decode_steps, 1), 1),
                                 # the figure is the memory's limit only if the pool was the constraint
                                 "capacity_bound": info["num_preemptions"] > 0
                                 or llm.scheduler.max_running < len(reqs)}
            del llm
            free()
    for kv in args.kv:
        one, four = res[f"{kv}_q1"]["max_running"], res[f"{kv}_q4"]["max_running"]
        res[f"{kv}_sharing_gain"] = round(four / max(one, 1), 2)
    if len(args.kv) > 1:
        a, b = args.kv[0], args.kv[1]
        res[f"{b}_vs_{a}_q1"] = round(res[f"{b}_q1"]["max_running"] / max(1, res[f"{a}_q1"]["max_running"]), 2)
        res[f"{b}_vs_{a}_q1_tokens_per_s"] = round(res[f"{b}_q1"]["tokens_per_s"] / res[f"{a}_q1"]["tokens_per_s"], 3)
        res[f"{b}_vs_{a}_q1_decode_tokens_per_s"] = round(
            res[f"{b}_q1"]["decode_tokens_per_s"] / res[f"{a}_q1"]["decode_tokens_per_s"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c,d")
    ap.add_argument("--json", required=True)
    ap.add_argument("--work", default="/tmp/docproc-bench", help="where the random model folders go")
    ap.add_argument("--geometry", default="7b", help="target geometry for a, c (random_models.GEOMETRIES)")
    ap.add_argument("--batch-geometry", default="2b", help="geometry for b and d")
    ap.add_argument("--draft-geometry", default="2b", help="draft geometry for c")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--page-w", type=int, default=868)
    ap.add_argument("--page-h", type=int, default=1092)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--kv", default="bf16,fp4")
    ap.add_argument("--hf-batches", default="4,16,64")
    ap.add_argument("--spec-batches", default="1,8,32")
    ap.add_argument("--spec-k", default="4,auto", help="fixed K values and/or auto (the adaptive policy)")
    ap.add_argument("--accept", default="0.5,0.7,0.9")
    ap.add_argument("--spec-chain", default="on",
                    help="part c: greedy draft rounds chained on the device (on), a sync per round (off), "
                         "or both, alternated on the same engine (on,off)")
    ap.add_argument("--spec-new-tokens", type=int, default=128)
    ap.add_argument("--spec-one-engine", action="store_true",
                    help="part c: one speculative engine for every K, its baseline the same engine with the draft "
                         "detached (a 72B target fits the device once)")
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"), help="the target's weights (parts a-d)")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: every model's weights drawn from its config.json (no checkpoint written)")
    ap.add_argument("--spec-reset-acceptance", action="store_true",
                    help="part c: the adaptive policy forgets the acceptance it saw before each (batch, a)")
    ap.add_argument("--spec-interpolate-at", default="0.8",
                    help="part c: acceptances to interpolate each K's speedup at (between the --accept cells "
                         "whose realized acceptance brackets them)")
    ap.add_argument("--spec-repeats", type=int, default=5,
                    help="part c: alternated plain/speculative pass pairs per figure")
    ap.add_argument("--spec-kv-bytes", type=int, default=8 << 30,
                    help="part c: KV cache bytes of each engine (the plain and the speculative one are loaded together)")
    # part d: a 1 GiB pool holds ~27 one-query bf16 sequences of a 1,300-token page at 2B geometry, so
    # every configuration but FP4 with 4 queries a page is capacity-bound with 256 requests (at
    # 4 GiB and 256 requests only bf16 with one query was; 512 x 256 tokens did not finish in 160 s)
    ap.add_argument("--kv-budget", type=int, default=1 << 30)
    ap.add_argument("--mem-requests", type=int, default=256)
    ap.add_argument("--mem-new-tokens", type=int, default=64)
    ap.add_argument("--prefetch-workers", type=int, default=None,
                    help="image preprocessing threads (default: the engine's: up to 8 beside a GPU; 0: inline)")
    ap.add_argument("--profile-steps", type=int, default=0, help="part a: also profile this many decode steps")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library for every matmul of the run")
    ap.add_argument("--overlap-ablation", action="store_true",
                    help="part b: a third pass on fresh pages with overlapped decode off")
    ap.add_argument("--host-profile-docs", type=int, default=0,
                    help="part b: also run this many fresh documents under cProfile (first KV format)")
    ap.add_argument("--profile-docs", type=int, default=0,
                    help="part b: also profile a pass over this many fresh documents (first KV format)")
    ap.add_argument("--max-pixels", type=int, default=28 * 28 * 1280,
                    help="the random checkpoints' image pixel cap (1,280 tokens a page by default); with a larger "
                         "--page-w/--page-h, a long context (part a at 28*28*16384 and a 3584x3584 page: 16k tokens)")
    ap.add_argument("--no-transformers", action="store_true", help="parts a, b: ours only (no transformers run)")
    ap.add_argument("--batch-invariant", action="store_true", help="every engine in the batch-invariant mode "
                    "(LLM(batch_invariant=True))")
    ap.add_argument("--b-weights", default="model",
                    help="part b: model (the checkpoint's weights, or --quantization), fp8 (quantized at load), or both")
    ap.add_argument("--no-vision-backends", action="store_true", help="part b: skip the vision tower's SDPA probe")
    ap.add_argument("--small", action="store_true", help="CPU check: tiny sizes everywhere")
    a = ap.parse_args()
    a.kv = a.kv.split(",")
    a.b_weights = a.b_weights.split(",")
    if not set(a.b_weights) <= {"model", "fp8"}:
        ap.error(f"--b-weights takes model, fp8 or model,fp8, not {a.b_weights}")
    a.hf_batches = [int(x) for x in a.hf_batches.split(",")]
    a.spec_batches = [int(x) for x in a.spec_batches.split(",")]
    a.spec_k = [x if x == "auto" else int(x) for x in a.spec_k.split(",")]
    a.accept = [float(x) for x in a.accept.split(",")]
    a.spec_interpolate_at = [float(x) for x in a.spec_interpolate_at.split(",")] if a.spec_interpolate_at else []
    a.spec_chain = a.spec_chain.split(",")
    if not set(a.spec_chain) <= {"on", "off"}:
        ap.error(f"--spec-chain takes on, off or on,off, not {a.spec_chain}")
    if a.small:
        a.dtype, a.page_w, a.page_h, a.new_tokens, a.docs, a.spec_new_tokens = "float32", 448, 560, 6, 3, 8
        a.hf_batches, a.spec_batches, a.kv_budget, a.mem_requests, a.mem_new_tokens = [2, 4], [1, 2], 1 << 20, 24, 16
        a.batch_geometry = a.geometry
        a.spec_kv_bytes, a.spec_repeats = 4 << 20, 2
    work = Path(a.work)
    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    a.device = dev
    if a.blas != "default" and dev == "cuda":
        torch.backends.cuda.preferred_blas_library(a.blas)
    mk = dict(dtype=getattr(torch, a.dtype), device=dev, max_pixels=a.max_pixels,
              init_std=0.08 if a.small else None)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "args": {k: v for k, v in vars(a).items()}}
    env = {"copy_bandwidth": copy_bandwidth(dev, 64 if a.small else 2048),
           "matmul_flops": matmul_rate(dev, 512 if a.small else 8192)}
    result["machine"] = {"copy_bandwidth_GBps": round(env["copy_bandwidth"] / 1e9, 1),
                         "matmul_TFLOPs": round(env["matmul_flops"] / 1e12, 1)}
    print(json.dumps(result["machine"]), flush=True)
    parts = a.parts.split(",")
    folders = {}

    def model(geometry: str, seed: int = 0) -> Path:
        if geometry not in folders:
            folders[geometry] = make_model(work / geometry, geometry=geometry, seed=seed,
                                           weights=a.load_format != "dummy", **mk)
            free()
        return folders[geometry]

    for p in parts:
        t0 = time.perf_counter()
        try:
            if p == "a":
                result["a_batch1_decode"] = part_a(model(a.geometry), a, env)
            elif p == "b":
                result["b_offline_batch"] = part_b(model(a.batch_geometry), a, env)
            elif p == "c":
                target, draft = model(a.geometry), model(a.draft_geometry, seed=1)
                # (a 7B target and a 2B draft have embedding tables of different sizes: the engine
                # handles that, as it must for the published pair)
                if a.small:
                    share_vision_trunk(target, draft)
                result["c_speculation"] = part_c(target, draft, a, env)
            elif p == "d":
                result["d_memory"] = part_d(model(a.batch_geometry), a, env)
        except Exception as e:  # one failed part must not lose the others
            result[f"{p}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result[f"{p}_seconds"] = round(time.perf_counter() - t0, 1)
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: v for k, v in result.items() if k.startswith(p)}, default=str), flush=True)


if __name__ == "__main__":
    main()
