"""Where a constrained decode step's host time goes, on the overlapped path (H200, bundled target).

    python3 bench/mask_step_profile.py --batch 64 --json $OUT/profile.json

The default query set's rules at --batch requests (as scripts/bench_masks.py), timed per phase
by wrapping the engine's methods: collect (waiting for the step's tokens), append (stop checks,
matchers accepting the tokens), fill (the masks: xgrammar's batch fill on the
thread count measured fastest), apply (the bitmask copy
and its kernel) and the rest of the sampling launch; against the step time of the same batch
decoding free (same lengths). Per decode step, in microseconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_masks import rule_requests  # noqa: E402
from docproc import LLM, SamplingParams  # noqa: E402
from docproc.pipeline.settings import bundled_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    llm = LLM(args.model or str(bundled_model("target")), device="cuda", load_format=args.load_format)
    reqs, rules = rule_requests(args.batch)
    outs = llm.generate(reqs, rules)  # warm-up: graphs, grammars
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in outs]

    acc = defaultdict(float)
    counts = defaultdict(int)

    def wrap(obj, name, key):
        real = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
                counts[key] += 1
        setattr(obj, name, timed)

    runner = llm.runner
    wrap(runner, "collect", "collect")
    wrap(llm, "append_token", "append_token")
    wrap(runner, "sample_pending", "sample_pending")
    g = runner.grammar
    wrap(g, "mask", "mask")
    wrap(g, "_apply", "apply")
    if g._fills is not None:
        wrap(g._fills, "fill", "fill")
    wrap(llm.overlap, "_continue", "continue_launch")
    res = {"batch": args.batch, "model": args.model or "bundled target"}
    for name, params in (("rules", rules), ("free_same_lengths",
                                             [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])):
        acc.clear()
        counts.clear()
        steps0 = llm.num_decode_steps
        t0 = time.perf_counter()
        llm.generate(reqs, params)
        wall = time.perf_counter() - t0
        steps = llm.num_decode_steps - steps0
        res[name] = {"wall_s": round(wall, 4), "decode_steps": steps,
                     "us_per_step": {k: round(v / max(steps, 1) * 1e6, 1) for k, v in sorted(acc.items())},
                     "calls": dict(counts)}
    if g._fills is not None:  # the fill's mean seconds a call by (bucket of rows, threads)
        res["fill_threads_mean_us"] = {f"{2 ** (b - 1) + 1}-{2 ** b} rows, {t} threads": round(v * 1e6, 1)
                                       for (b, t), v in sorted(g._fills.seconds.items())}
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
