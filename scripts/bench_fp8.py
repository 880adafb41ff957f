"""FP8 weights on the GPU: batch-1 decode at 7B (bf16 against FP8 in one run) and at 72B geometry
(FP8; its bf16 weights do not fit one H200), each against the bandwidth roofline of its step
(the weight bytes a step reads, all but the embedding table, + the KV bytes it reads, over the
copy bandwidth measured in the same run),
and the relative error of FP8 logits against bf16 on the same weights. Random weights from
config.json alone (load_format="dummy"): no checkpoint on disk.

    python3 scripts/bench_fp8.py --json fp8.json [--cases 7b:bf16,7b:fp8,72b:fp8]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from docproc import LLM, SamplingParams  # noqa: E402
from docproc.models.quant import quantize  # noqa: E402
from fixtures.checkpoints import make_model  # noqa: E402


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * 4 * (1 << 30) / best / 1e9  # GB/s, read + write


def prompt(n_words: int) -> str:
    return "<|im_start|>user\n" + " ".join(["invoice total amount due"] * (n_words // 4)) + "<|im_end|>\n"


def decode(llm: LLM, text: str, new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm.generate([text], SamplingParams(max_tokens=4, ignore_eos=True))  # graphs captured, kernels loaded
    runs = []
    for _ in range(3):
        m = llm.generate([text], sp)[0].metrics
        runs.append((new_tokens - 1) / (m.total_time - m.time_to_first_token))
    return {"tokens_per_s": round(max(runs), 2), "runs": [round(r, 2) for r in runs], "prompt_tokens": m.num_prompt_tokens}


def quantize_in_place(llm: LLM) -> None:
    """The loaded bf16 model's products as per-channel FP8 of the same weights (for the logit error)."""
    for layer in llm.runner.model.text.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_weight, a.o_weight = quantize(a.qkv_weight), quantize(a.o_weight)
        m.gate_up_weight, m.down_weight = quantize(m.gate_up_weight), quantize(m.down_weight)


@torch.no_grad()
def last_logits(llm: LLM, texts: list[str]) -> torch.Tensor:
    rows = []

    def hook(seqs, logits):
        rows.extend(logits.float().cpu())

    llm.runner.logits_hook = hook
    try:
        llm.generate(texts, SamplingParams(max_tokens=1))
    finally:
        llm.runner.logits_hook = None
    return torch.stack(rows)


def read_bytes(llm: LLM, held: int) -> int:
    """The weight bytes a decode step reads: all the language model holds but the embedding
    table, of which one row is gathered (unless the LM head is that table, tied)."""
    text = llm.runner.model.text
    emb = text.embed_tokens.weight
    return held if text.lm_head.weight is emb else held - emb.numel() * emb.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--cases", default="7b:bf16,7b:fp8,72b:fp8")
    ap.add_argument("--work", default="/tmp/docproc-fp8")
    ap.add_argument("--prompt-words", type=int, default=1200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--logit-prompts", type=int, default=8)
    a = ap.parse_args()
    bw = copy_bandwidth()
    report: dict = {"copy_bandwidth_GBps": round(bw, 1), "device": torch.cuda.get_device_name(), "cases": {}}
    print(json.dumps(report), flush=True)
    text = prompt(a.prompt_words)
    for case in a.cases.split(","):
        geo, fmt = case.split(":")
        folder = Path(a.work) / geo
        if not (folder / "config.json").is_file():
            make_model(folder, geometry=geo, weights=False, dtype=torch.bfloat16, max_pixels=28 * 28 * 1280)
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
                  quantization="fp8" if fmt == "fp8" else None, max_model_len=4096, gpu_memory_utilization=0.9,
                  enable_prefix_caching=False)  # (the logit passes must recompute every token)
        start = time.perf_counter() - t0
        info = llm.cache_info()
        r = decode(llm, text, a.new_tokens)
        ctx = r["prompt_tokens"] + a.new_tokens // 2  # the mean context of the timed steps
        read = read_bytes(llm, info["weight_bytes"])
        step_bytes = read + ctx * info["bytes_per_token"]
        roof = bw * 1e9 / step_bytes
        r.update(weight_bytes=info["weight_bytes"], weight_bytes_read_per_step=read,
                 kv_bytes_per_token=info["bytes_per_token"],
                 step_bytes=step_bytes, roofline_tokens_per_s=round(roof, 2),
                 share_of_roofline=round(r["tokens_per_s"] / roof, 3), start_seconds=round(start, 2),
                 load_seconds=round(llm.runner.load_seconds, 2), warmup_seconds=info["kernel_warmup_seconds"],
                 graph_capture_seconds=info["cuda_graph_capture_seconds"], weights_fp8=info["weights_fp8"],
                 kernel_compiles_after_warmup=info["kernel_compiles_after_warmup"])
        if fmt == "bf16" and a.logit_prompts:
            texts = [prompt(40 + 37 * i) + f" case {i}" for i in range(a.logit_prompts)]
            llm.runner.graphs = None  # captured graphs would keep reading the bf16 weights
            ref = last_logits(llm, texts)
            quantize_in_place(llm)
            got = last_logits(llm, texts)
            rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1))
            r["fp8_logits_relative_error"] = {"mean": round(rel.mean().item(), 4), "max": round(rel.max().item(), 4),
                                              "top1_agreement": round((got.argmax(-1) == ref.argmax(-1)).float()
                                                                      .mean().item(), 3)}
        report["cases"][case] = r
        print(json.dumps({case: r}), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    c = report["cases"]
    if "7b:bf16" in c and "7b:fp8" in c:
        report["7b_fp8_over_bf16"] = round(c["7b:fp8"]["tokens_per_s"] / c["7b:bf16"]["tokens_per_s"], 3)
    Path(a.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}))


if __name__ == "__main__":
    main()
