"""The host's cost of a constrained row, per decode step: what `BudgetMatcher.forced_token` (the
budget that closes answers) and the grammar's mask fill take, with no model at all.

    python3 bench/budget_cost.py --tokenizer tiny --rows 180 --json /tmp/budget.json
    python3 bench/budget_cost.py --tokenizer bundled --rows 180 --json /tmp/budget_bundled.json

A "model" that picks a random token the mask allows (seeded) drives one matcher per request of
the default query set, in turn, until each answer ends or reaches its max_tokens: the shape of
a random-weight run, where every answer runs to its budget. Reported: row-steps, host seconds
per row-step for forced_token and for the fills (one batch fill a step, as the engine does),
the tokens forced, and a digest of every answer's tokens (two versions of the budget code that
decide alike give the same digest). --tokenizer tiny is the 384-token tokenizer of
tests/fixtures/checkpoints.py (the one bench/e2e_run.py's checkpoints carry); bundled is the
bundled pair's Qwen tokenizer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
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
    ap.add_argument("--tokenizer", choices=("tiny", "bundled"), default="tiny")
    ap.add_argument("--rows", type=int, default=180, help="requests decoded together (one step: one token each)")
    ap.add_argument("--vocab", type=int, default=152064, help="the model's logits' width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    from docproc.engine.structured import GrammarCompiler
    from docproc.models.processor import load_tokenizer
    from docproc.pipeline.queries import load_queries
    from docproc.pipeline.settings import bundled_model

    if args.tokenizer == "tiny":
        from fixtures.checkpoints import make_tokenizer

        folder = Path(tempfile.mkdtemp(prefix="budget-tok-"))
        make_tokenizer(folder)
    else:
        folder = bundled_model("target")
    tok = load_tokenizer(folder)
    stops = {tok.convert_tokens_to_ids("<|im_end|>")}
    compiler = GrammarCompiler(tok, args.vocab, stops)
    import xgrammar as xgr

    queries = [q for q in load_queries(None).queries if q.structured_outputs() is not None]
    rng = random.Random(args.seed)
    matchers = []
    for i in range(args.rows):
        q = queries[i % len(queries)]
        params = q.structured_outputs()
        compiler.compile(params)
        matchers.append((q.name, compiler.matcher(params, q.max_tokens), q.max_tokens))
    width = compiler.num_tokens
    bitmask = xgr.allocate_token_bitmask(args.rows, width)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    tokens: list[list[int]] = [[] for _ in matchers]
    live = list(range(len(matchers)))
    t_forced = t_fill = 0.0
    row_steps = forced = steps = 0
    t0 = time.perf_counter()
    while live:
        steps += 1
        fills, forced_at = [], {}
        a = time.perf_counter()
        for r in live:
            tok_id = matchers[r][1].forced_token()
            if tok_id is None:
                fills.append(r)
            else:
                forced_at[r] = tok_id
        b = time.perf_counter()
        if fills:
            batch.batch_fill_next_token_bitmask([matchers[r][1].matcher for r in fills], bitmask, fills)
        c = time.perf_counter()
        t_forced += b - a
        t_fill += c - b
        row_steps += len(live)
        forced += len(forced_at)
        still = []
        for r in live:
            name, m, max_tokens = matchers[r]
            if r in forced_at:
                t = forced_at[r]
            else:
                words = bitmask[r].tolist()
                allowed = [w * 32 + bit for w, word in enumerate(words) if word for bit in range(32)
                           if (word >> bit) & 1 and w * 32 + bit < width]
                t = rng.choice(allowed)
            if not m.accept_token(t):
                raise SystemExit(f"row {r}: token {t} refused after the mask allowed it")
            tokens[r].append(t)
            if not (m.is_terminated() or len(tokens[r]) >= max_tokens):
                still.append(r)
        live = still
    wall = time.perf_counter() - t0
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    ended = sum(1 for _, m, _ in matchers if m.is_terminated())
    report = {"tokenizer": args.tokenizer, "rows": args.rows, "steps": steps, "row_steps": row_steps,
              "tokens_forced": forced, "answers_ended_by_grammar": ended,
              "forced_token_us_per_row_step": round(t_forced / row_steps * 1e6, 2),
              "fill_us_per_row_step": round(t_fill / row_steps * 1e6, 2),
              "host_ms_per_step_at_full_rows": round((t_forced + t_fill) / row_steps * args.rows * 1e3, 2),
              "forced_token_seconds": round(t_forced, 3), "fill_seconds": round(t_fill, 3),
              "wall_seconds": round(wall, 3), "tokens_digest": digest}
    print(json.dumps(report))
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
