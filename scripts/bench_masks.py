"""Grammar masks' cost on decode throughput: the same batch decoded free and under rules.

    python3 scripts/bench_masks.py --device cuda --batch 64 --json $OUT/masks.json
    python3 scripts/bench_masks.py --draft bundled --batch 64 --json $OUT/masks_draft.json
    python3 scripts/bench_masks.py --model /tmp/m7 --load-format dummy --batch 64 --json $OUT/masks_7b.json

--model (default: the bundled target; a folder from scripts/random_models.py --no-weights with
--load-format dummy for a geometry without a checkpoint) over the sample pages that are images,
--batch requests (the pages repeated, the default query set's questions in turn). Cases:
- default_rules: each request under its query's rule and schema (answers end where the grammar
  ends), against default_free_same_lengths: the same requests free, each decoding exactly the
  tokens its constrained answer had (ignore_eos, max_tokens = that length), so that the masks
  are the only difference; ratio_default_rules_to_free is the figure;
- long_text_rule (--long): 128 tokens under printable text of at least 512 characters (a counted
  rule xgrammar fills slowly) against 128 free tokens.
With --draft, each case also reports the draft's acceptance (accepted / proposed drafts).
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

import torch  # noqa: E402

from docproc import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from docproc.pipeline.settings import bundled_model  # noqa: E402
from docproc.pipeline.queries import build_prompt, load_queries  # noqa: E402


def rule_requests(n: int) -> tuple[list[dict], list[SamplingParams]]:
    """n requests over the sample pages that are images, the default query set's questions in
    turn, and each one's SamplingParams under its query's rule (bench/ probes use the same)."""
    from PIL import Image

    pages = [Image.open(p).convert("RGB") for p in sorted((ROOT / "sample_docs").iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".tif", ".tiff")]
    queries = load_queries().queries
    asked = [queries[i % len(queries)] for i in range(n)]
    reqs = [{"prompt": build_prompt(1, q.question), "multi_modal_data": {"image": [pages[i % len(pages)]]}}
            for i, q in enumerate(asked)]
    return reqs, [SamplingParams(max_tokens=q.max_tokens, structured_outputs=q.structured_outputs()) for q in asked]


def replayed_answers(device: str, n: int):
    """The bundled target's answers to n rule_requests (engine, their SamplingParams, each
    answer's tokens): what bench/ probes replay through the masks."""
    llm = LLM(str(bundled_model("target")), device=device)
    reqs, params = rule_requests(n)
    return llm, params, [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--draft", default=None, help="a draft folder, or bundled")
    ap.add_argument("--long", action="store_true", help="also the long counted text rule")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    draft = str(bundled_model("draft")) if args.draft == "bundled" else args.draft
    llm = LLM(args.model or str(bundled_model("target")), device=args.device, load_format=args.load_format,
              speculative_model=draft)
    reqs, rules_params = rule_requests(args.batch)

    def timed(params):
        best, outs = None, None
        for _ in range(args.repeats + 1):  # the first is a warm-up (graphs, grammar compiles)
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params)
            dt = time.perf_counter() - t0
            best = dt if best is None or dt < best else best
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {"seconds": round(best, 4), "generated_tokens": tokens, "tokens_per_s": round(tokens / best, 1)}
        if draft:
            proposed = sum(o.metrics.draft_proposed for o in outs)
            accepted = sum(o.metrics.draft_accepted for o in outs)
            res.update(draft_proposed=proposed, draft_accepted=accepted,
                       acceptance=round(accepted / proposed, 4) if proposed else None)
        return res, outs

    res = {"device": args.device, "batch": args.batch, "model": args.model or "bundled target",
           "load_format": args.load_format, "draft": args.draft,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    rules, outs = timed(rules_params)
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in outs]
    free, _ = timed([SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    res.update(default_rules=rules, default_free_same_lengths=free,
               ratio_default_rules_to_free=round(rules["tokens_per_s"] / free["tokens_per_s"], 4),
               stopped_by_grammar=sum(o.outputs[0].finish_reason == "stop" for o in outs))
    if args.long:
        free128, _ = timed([SamplingParams(max_tokens=128, ignore_eos=True) for _ in reqs])
        rule = StructuredOutputsParams(regex="[^\\x00-\\x1f]{512,}")
        masked, _ = timed([SamplingParams(max_tokens=128, ignore_eos=True, structured_outputs=rule) for _ in reqs])
        res.update(free_128=free128, long_text_rule=masked,
                   ratio_long_rule_to_free=round(masked["tokens_per_s"] / free128["tokens_per_s"], 4))
    res["overlapped_steps"] = llm.num_overlapped_steps
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
