"""Grammar backends side by side: xgrammar's and llguidance's masks for the same answers.

    python3 bench/mask_backends.py --device cuda --batch 64 --json $OUT/mask_backends.json

The bundled target answers --batch requests of the default query set under its rules (the
engine's own decoding), then each backend replays those answers at batch --batch: per step, one
bitmask fill for every live row (xgrammar's batch fill, llguidance's parallel fill, each on 1
thread and on its default thread count) and one token accepted per row. Reported: microseconds a
step for fill and accept (the best of --repeats), compile seconds per backend, and whether the two
backends' masks agree on every row of every step (the same language, written differently).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_masks import replayed_answers  # noqa: E402
from docproc.engine.structured import _strict_strings, bounded_numbers, tokenizer_size  # noqa: E402


def llg_grammar(llg, so) -> str:
    if so.kind == "json":
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return llg.LLMatcher.grammar_from_json_schema(
            bounded_numbers(_strict_strings(schema)),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    if so.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.regex)
    alts = " | ".join(json.dumps(c) for c in so.choice)
    return llg.LLMatcher.grammar_from_lark(f"start: {alts}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as llgt
    import xgrammar as xgr

    llm, params, seqs = replayed_answers(args.device, args.batch)
    tok = llm.tokenizer
    n_tok = tokenizer_size(tok)
    stops = sorted(t for t in llm.eos_token_ids if t < n_tok)

    t0 = time.perf_counter()
    xinfo = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=n_tok, stop_token_ids=stops)
    xcomp = xgr.GrammarCompiler(xinfo, cache_enabled=False)
    xcompiled = {}
    for p in params:
        so = p.structured_outputs
        if so.key() not in xcompiled:
            if so.kind == "json":
                schema = json.loads(so.json) if isinstance(so.json, str) else so.json
                xcompiled[so.key()] = xcomp.compile_json_schema(json.dumps(bounded_numbers(_strict_strings(schema))),
                                                                any_whitespace=False)
            elif so.kind == "regex":
                xcompiled[so.key()] = xcomp.compile_regex(so.regex)
            else:
                xcompiled[so.key()] = xcomp.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in so.choice))
    x_compile = time.perf_counter() - t0

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=n_tok, eos_token=stops)
    lgrammars = {}
    for p in params:
        so = p.structured_outputs
        if so.key() not in lgrammars:
            lgrammars[so.key()] = llg_grammar(llg, so)
    probe = [llg.LLMatcher(ltok, g) for g in lgrammars.values()]
    assert not any(m.is_error() for m in probe), [m.get_error() for m in probe if m.is_error()]
    l_compile = time.perf_counter() - t0

    n = len(seqs)
    steps = max(map(len, seqs))

    def replay(make, fill, accept) -> tuple[float, float, list]:
        best_fill = best_acc = None
        masks = []
        for r in range(args.repeats):
            ms = [make(p.structured_outputs) for p in params]
            t_fill = t_acc = 0.0
            for step in range(steps):
                live = [i for i in range(n) if step < len(seqs[i])]
                bm = torch.zeros((n, (n_tok + 31) // 32), dtype=torch.int32)
                t = time.perf_counter()
                fill(ms, live, bm)
                t_fill += time.perf_counter() - t
                if r == 0:
                    masks.append(bm.clone())
                t = time.perf_counter()
                for i in live:
                    assert accept(ms[i], seqs[i][step]), (i, step)
                t_acc += time.perf_counter() - t
            best_fill = t_fill if best_fill is None else min(best_fill, t_fill)
            best_acc = t_acc if best_acc is None else min(best_acc, t_acc)
        return best_fill / steps * 1e6, best_acc / steps * 1e6, masks

    results = {"batch": n, "steps": steps, "vocab": n_tok, "compile_s": {"xgrammar": round(x_compile, 4),
                                                                          "llguidance": round(l_compile, 4)}}
    all_masks = {}
    for threads in (1, None):
        batch = xgr.BatchGrammarMatcher(max_threads=threads) if threads else xgr.BatchGrammarMatcher()
        f, a, masks = replay(lambda so: xgr.GrammarMatcher(xcompiled[so.key()]),
                             lambda ms, live, bm: batch.batch_fill_next_token_bitmask([ms[i] for i in live], bm, live),
                             lambda m, t: m.accept_token(t))
        results[f"xgrammar_threads_{threads or 'default'}"] = {"fill_us_per_step": round(f, 1),
                                                              "accept_us_per_step": round(a, 1)}
        all_masks["xgrammar"] = masks
        ex = llg.LLExecutor(num_threads=threads) if threads else llg.LLExecutor()
        f, a, masks = replay(lambda so: llg.LLMatcher(ltok, lgrammars[so.key()]),
                             lambda ms, live, bm: llgt.fill_next_token_bitmask_par(ex, [(ms[i], i) for i in live], bm),
                             lambda m, t: m.consume_token(t))
        results[f"llguidance_threads_{threads or 'default'}"] = {"fill_us_per_step": round(f, 1),
                                                                "accept_us_per_step": round(a, 1)}
        all_masks["llguidance"] = masks
    x, lm = all_masks["xgrammar"], all_masks["llguidance"]
    differ = sum(int(not torch.equal(a[i], b[i])) for a, b in zip(x, lm) for i in range(n))
    results["rows_whose_masks_differ"] = differ
    results["rows"] = sum(len(s) for s in seqs)
    print(json.dumps(results, indent=1))
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
