"""Host cost of a constrained decode step's masks and accepts at batch 64 on the bundled target,
by how xgrammar is called: its batch fill on 1, 2, 4, 8 threads or its default (half the
host's cores), one fill per row from Python, and the accepts one call per row or in one batch
call. The token sequences are the engine's own answers under the default query set's rules (one
generate), replayed through fresh matchers, so every fill is in a state decoding reaches. A
probe for the masks figure in BENCHMARKS.md.

    python3 bench/mask_fill_threads.py --device cuda --json $OUT/fill_threads.json
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_masks import replayed_answers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import xgrammar as xgr

    n = args.batch
    llm, params, seqs = replayed_answers(args.device, n)
    grammar = llm.runner.grammar
    bitmask = xgr.allocate_token_bitmask(n, grammar.num_tokens)

    def replay(fill, accept) -> dict:
        best = None
        for _ in range(args.repeats):
            ms = [grammar.matcher(p.structured_outputs, p.max_tokens) for p in params]
            t_fill = t_acc = 0.0
            steps = 0
            for step in range(max(map(len, seqs))):
                live = [i for i in range(n) if step < len(seqs[i])]
                t = time.perf_counter()
                fill([ms[i] for i in live], live)
                t_fill += time.perf_counter() - t
                t = time.perf_counter()
                accept([ms[i] for i in live], [seqs[i][step] for i in live])
                t_acc += time.perf_counter() - t
                steps += 1
            r = {"fill_us_per_step": round(t_fill / steps * 1e6, 1), "accept_us_per_step": round(t_acc / steps * 1e6, 1)}
            if best is None or r["fill_us_per_step"] + r["accept_us_per_step"] < \
                    best["fill_us_per_step"] + best["accept_us_per_step"]:
                best = r
        return best

    def serial_fill(ms, rows):
        for m, r in zip(ms, rows):
            m.fill_next_token_bitmask(bitmask, r)

    def serial_accept(ms, toks):
        for m, t in zip(ms, toks):
            m.accept_token(t)

    res = {"device": args.device, "batch": n, "host_cores": os.cpu_count(), "steps": max(map(len, seqs)),
           "generated_tokens": sum(map(len, seqs)), "xgrammar": __import__("importlib.metadata").metadata.version("xgrammar"), "modes": {}}
    res["modes"]["python_loop"] = replay(serial_fill, serial_accept)
    for threads in (1, 2, 4, 8, "auto"):
        b = xgr.BatchGrammarMatcher(max_threads=threads)
        res["modes"][f"batch_threads_{threads}"] = replay(
            lambda ms, rows, b=b: b.batch_fill_next_token_bitmask(ms, bitmask, rows),
            lambda ms, toks: xgr.BatchGrammarMatcher.batch_accept_token(ms, toks))
    print(json.dumps(res, indent=1))
    Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
