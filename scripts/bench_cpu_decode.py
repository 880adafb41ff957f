"""Decode tokens/s of the bundled target on this machine's CPU: the default queries on the first
page of the first --docs documents (greedy, natural answer lengths, the page SHA-256 passed as
`docproc run` passes it), prefix cache warm, best of --repeats, at each batch size and KV format.

    python scripts/bench_cpu_decode.py --docs .work/speed_docs --kv auto,fp4 --texts /tmp/texts.json

--texts writes every answer, so two commits can be compared for identical output.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from docproc import LLM  # noqa: E402
from workloads import first_page_queries  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="docproc/assets/models/target")
    ap.add_argument("--docs", required=True, help="a folder of documents (e.g. from make_synthetic_docs.py)")
    ap.add_argument("--num-docs", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--texts", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    reqs, params, _ = first_page_queries(a.docs, a.num_docs)
    texts = {}
    for kv in a.kv.split(","):
        for b in map(int, a.batches.split(",")):
            llm = LLM(a.model, device="cpu", max_num_seqs=b, kv_cache_dtype=kv)
            llm.generate(reqs, params)  # fills the prefix cache
            best = float("inf")
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(reqs, params)
                best = min(best, time.perf_counter() - t0)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            texts[f"{kv}_batch{b}"] = [o.outputs[0].text for o in outs]
            print(json.dumps({"kv": kv, "batch": b, "requests": len(reqs), "tokens": tokens,
                              "seconds": round(best, 3), "tokens_per_s": round(tokens / best, 1)}), flush=True)
    if a.texts:
        Path(a.texts).write_text(json.dumps(texts, indent=1))


if __name__ == "__main__":
    main()
