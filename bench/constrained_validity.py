"""Whether every constrained answer is whole: the default query set and a schema of numbers, dates
and enums, answered by a model and judged as the pipeline judges rows (docproc.pipeline.rows).

    python3 bench/constrained_validity.py --device cuda --requests 240 --json $OUT/validity.json
    python3 bench/constrained_validity.py --model /tmp/m7 --load-format dummy --requests 240 --json $OUT/v7.json

--requests prompts per query set over the sample pages that are images (a page each, the set's
questions in turn, each query's own max_tokens; --max-tokens overrides them all). A model of
random weights (--load-format dummy) never stops by itself, so every answer meets its budget:
the case that shows whether the budget closes it. Reported per set and query: answers, the
statuses the pipeline would store (ok, empty, parse_error, schema_violation, truncated), how many
ended at max_tokens, how many of those the budget closed (truncated, with a value), and the share
that parse and validate (whole).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from docproc import LLM, SamplingParams  # noqa: E402
from docproc.pipeline.settings import bundled_model  # noqa: E402
from docproc.pipeline.queries import build_prompt, load_queries  # noqa: E402
from docproc.pipeline.rows import answer_row  # noqa: E402

SCHEMA_SET = '''name = "numbers-dates-enums"
[[query]]
name = "fields"
question = "Return the total, the date, the currency and the document kind as JSON."
type = "json"
max_tokens = 128
[query.schema]
type = "object"
additionalProperties = false
required = ["total", "date", "currency", "kind", "lines"]
[query.schema.properties]
total = { type = "number" }
date = { type = "string", format = "date" }
currency = { enum = ["EUR", "USD", "CHF", "GBP"] }
kind = { enum = ["invoice", "receipt", "credit note"] }
lines = { type = "array", items = { type = "object", required = ["amount"], properties = { amount = { type = "number" }, text = { type = "string" } } } }
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from PIL import Image

    llm = LLM(args.model or str(bundled_model("target")), device=args.device, load_format=args.load_format)
    pages = [Image.open(p).convert("RGB") for p in sorted((ROOT / "sample_docs").iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".tif", ".tiff")]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "schema.toml").write_text(SCHEMA_SET)
        sets = {"default": load_queries(None), "numbers_dates_enums": load_queries(Path(tmp) / "schema.toml")}
    report = {"model": args.model or "bundled target", "load_format": args.load_format, "device": args.device}
    for name, qs in sets.items():
        queries = [q if args.max_tokens is None else replace(q, max_tokens=args.max_tokens) for q in qs.queries]
        asked = [queries[i % len(queries)] for i in range(args.requests)]
        prompts = [{"prompt": build_prompt(1, q.question), "multi_modal_data": {"image": [pages[i % len(pages)]]}}
                   for i, q in enumerate(asked)]
        params = [SamplingParams(max_tokens=q.max_tokens, structured_outputs=q.structured_outputs()) for q in asked]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        per = defaultdict(Counter)
        examples = {}
        for q, o in zip(asked, outs):
            out = o.outputs[0]
            cut = out.finish_reason == "length"
            row = answer_row(q, out.text, cut, True) if not o.error else {"status": "error", "error": o.error}
            per[q.name][row["status"]] += 1
            # whole: parses and validates (ok, empty, or truncated with a value: closed by the budget)
            whole = row["status"] in ("ok", "empty") or row["status"] == "truncated" and row.get("value") is not None
            per[q.name]["whole"] += whole
            per[q.name]["closed_by_budget"] += row["status"] == "truncated" and whole
            per[q.name]["at_max_tokens"] += cut
            per[q.name]["answers"] += 1
            if not whole:
                examples.setdefault(q.name, (out.text[:200], row["error"]))
        total = sum(c["answers"] for c in per.values())
        whole = sum(c["whole"] for c in per.values())
        report[name] = {"seconds": round(seconds, 2), "answers": total, "valid": whole,
                        "valid_share": round(whole / total, 4) if total else None,
                        "at_max_tokens": sum(c["at_max_tokens"] for c in per.values()),
                        "closed_by_budget": sum(c["closed_by_budget"] for c in per.values()),
                        "per_query": {k: dict(v) for k, v in per.items()}, "first_invalid": examples}
    print(json.dumps(report, indent=1))
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
