"""Grammar masks' cost on decode throughput: the same batch decoded free and under a rule.

    python3 scripts/bench_masks.py --device cuda --batch 64 --json $OUT/masks.json

The bundled target over the sample pages that are images (PNG/JPEG/TIFF), --batch requests (the
pages repeated), 128 new tokens each with ignore_eos: once free, once under a rule of printable
text of at least 512 characters (it allows no end within 128 tokens, so both decode the same
number of tokens and the masks are the only difference),
once under the default query set's rules and schema (answers end where their grammar ends).
Tokens/s is generated tokens over the generate() call, the best of --repeats, after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from docproc import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from docproc.cli import bundled_model  # noqa: E402
from docproc.pipeline.queries import build_prompt, load_queries  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from PIL import Image

    pages = [Image.open(p).convert("RGB") for p in sorted((ROOT / "sample_docs").iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".tif", ".tiff")]
    queries = load_queries().queries
    llm = LLM(str(bundled_model("target")), device=args.device)
    reqs = [{"prompt": build_prompt(1, queries[i % len(queries)].question),
             "multi_modal_data": {"image": [pages[i % len(pages)]]}} for i in range(args.batch)]

    def timed(params):
        best, tokens = None, 0
        for _ in range(args.repeats + 1):  # the first is a warm-up (graphs, grammar compiles)
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params)
            dt = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best = dt if best is None or dt < best else best
        return {"seconds": round(best, 4), "generated_tokens": tokens, "tokens_per_s": round(tokens / best, 1)}

    free = timed([SamplingParams(max_tokens=128, ignore_eos=True) for _ in reqs])
    rule = StructuredOutputsParams(regex="[^\\x00-\\x1f]{512,}")
    masked = timed([SamplingParams(max_tokens=128, ignore_eos=True, structured_outputs=rule) for _ in reqs])
    default = timed([SamplingParams(max_tokens=q.max_tokens, structured_outputs=q.structured_outputs())
                     for q in (queries[i % len(queries)] for i in range(args.batch))])
    default_free = timed([SamplingParams(max_tokens=queries[i % len(queries)].max_tokens) for i in range(args.batch)])
    res = {"device": args.device, "batch": args.batch, "vocab": llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else None,
           "free": free, "long_text_rule": masked, "ratio_rule_to_free": round(masked["tokens_per_s"] / free["tokens_per_s"], 4),
           "default_rules": default, "default_questions_free": default_free}
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
