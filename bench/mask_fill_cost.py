"""Host cost of xgrammar's per-row mask (fill_next_token_bitmask) on the bundled tokenizer, per
rule: a matcher walked along 64 allowed tokens (the first allowed each time), the fill timed at
each position. A probe for the H200 masks figure in BENCHMARKS.md."""
import json
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from docproc.pipeline.constraints import DATE_PATTERN, NUMBER_PATTERN, STRING_PATTERN  # noqa: E402
from docproc.pipeline.queries import load_queries  # noqa: E402

tok = AutoTokenizer.from_pretrained(str(ROOT / "docproc/assets/models/target"))
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=899)
comp = xgr.GrammarCompiler(info)
schema = load_queries().queries[-1].schema  # all_fields' document schema
rules = {"date": comp.compile_regex(DATE_PATTERN), "number": comp.compile_regex(NUMBER_PATTERN),
         "string": comp.compile_regex(STRING_PATTERN), "long_text_512": comp.compile_regex("[^\\x00-\\x1f]{512,}"),
         "invoice_schema": comp.compile_json_schema(schema, any_whitespace=False)}
res = {}
for name, g in rules.items():
    m = xgr.GrammarMatcher(g)
    bm = xgr.allocate_token_bitmask(1, 899)
    times = []
    for _ in range(64):
        if m.is_terminated():
            break
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm, 0)
        times.append(time.perf_counter() - t0)
        allowed = [i for i in range(899) if (int(bm[0, i // 32]) >> (i % 32)) & 1 and i not in tok.all_special_ids]
        if not allowed or not m.accept_token(allowed[len(allowed) // 2]):
            break
    times.sort()
    res[name] = {"positions": len(times), "median_us": round(1e6 * times[len(times) // 2], 1),
                 "max_us": round(1e6 * times[-1], 1)}
print(json.dumps(res))
