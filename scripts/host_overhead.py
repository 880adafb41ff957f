"""Host time per engine step: where a draft engine's extra host time goes when the adaptive
policy bypasses the draft, and what the CUDA-graph step path costs the host.

Three modes:
- default (the device): the bundled pair on the `evaluate_pair.py --speed` workload (the default
  queries on the first page of --docs documents, prefix cache warm), three engines alternated
  pass by pass: plain, the adaptive draft, and the adaptive draft with probes switched off. For
  each, the best pass's total, the time inside LLM.step, inside the target's forward
  (runner.execute) and inside speculative steps.
- --stub (any machine): the target's forward replaced by a constant-time stub, so that a step is
  only the engine's host work; prints microseconds per step, plain vs the adaptive draft with its
  cost lines set so that it bypasses (probes off).
- --stub-graph (any machine): the CUDA-graph step path (its padded static buffers, run eagerly as
  on a CPU) with the model's layers stubbed: scheduler, input fill, copies, logits and sampling
  per decode step (on a CPU the LM head's matmul is in it too).

    python scripts/host_overhead.py --docs-dir DIR [--device cuda] [--batches 1,16] [--repeats 6]
    python scripts/host_overhead.py --stub
    python scripts/host_overhead.py --stub-graph [--batches 1,16]
    python scripts/host_overhead.py --stub-graph --rules --prompt-tokens 300 --batches 176 [--model DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from docproc import LLM, SamplingParams  # noqa: E402
from docproc.engine.model_runner import StepResult  # noqa: E402
from workloads import first_page_queries  # noqa: E402

T, D = str(ROOT / "docproc/assets/models/target"), str(ROOT / "docproc/assets/models/draft")


def no_probes(llm: LLM) -> None:
    pol = llm.speculator.policy
    pol.probe_every = pol._probe_interval = 10 ** 9


def stub(batches: list[int]) -> None:
    def fake_execute(out):  # a constant token for every sampling row: only host work remains
        return StepResult({s.seq.seq_id: 40 for s in out.scheduled if s.needs_sample},
                          sum(s.num_new_tokens for s in out.scheduled), 0.0003)

    reqs = [f"hello world {i}" for i in range(32)]
    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for b in batches:
        plain = LLM(T, device="cpu", max_num_seqs=b)
        spec = LLM(T, device="cpu", max_num_seqs=b, speculative_model=D, num_speculative_tokens="auto")
        for llm in (plain, spec):
            llm.runner.execute = fake_execute
        no_probes(spec)
        pol = spec.speculator.policy
        for n in range(1, 6):  # c ~ 1: the draft cannot pay, every step bypasses it
            pol.observe_step(n * b, 0.0003)
            pol.observe_draft_forward(b, 0.00029)
        best: dict[str, float] = {}
        for _ in range(3):
            for name, llm in (("plain", plain), ("adaptive_bypassing", spec)):
                t0 = time.perf_counter()
                llm.generate(reqs, sp)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        steps = len(reqs) * sp.max_tokens / b
        print(json.dumps({"batch": b, **{f"{k}_us_per_step": round(v / steps * 1e6, 2) for k, v in best.items()}}))


def stub_graph(batches: list[int], prompt_tokens: int = 0, rules: bool = False, model: str = T) -> None:
    """With prompt_tokens, every request's prompt is about that long (contexts like a page's) and
    the model's layers are removed outright, so the prefill steps that leave the graph path run
    (eagerly, as on a GPU) too; the timed part is still the decode steps' host work. rules: each
    request is one of the default query set's, decoded under its rule (and max_tokens), against
    the same requests free: the grammar's share of a decode step's host time."""
    from torch import nn

    from docproc.engine import model_runner

    real = model_runner.resolve_step_graphs
    model_runner.resolve_step_graphs = lambda config, device: "static"
    try:
        for b in batches:
            llm = LLM(model, device="cpu", max_num_seqs=b)
            g = llm.runner.graphs
            hidden = llm.runner.text_config.hidden_size

            def no_layers(key, _g=g):  # the static path's model call, stubbed: zeros of the right shape
                views, n = _g._layout(key)[:2]
                return torch.zeros(n, hidden).index_select(0, views["rows"])

            if prompt_tokens:
                llm.runner.model.text.layers = nn.ModuleList()
            else:
                g._forward_static = no_layers
            filler = " ".join(["word"] * prompt_tokens)
            reqs = [f"hello world {i} {filler}" for i in range(max(32, b))]  # every step runs b sequences
            sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            if rules:
                rules_vs_free(llm, reqs)
                continue
            llm.generate(reqs, sp)
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            best, best_one = 1e9, 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(reqs, sp)
                best = min(best, time.perf_counter() - t0)
                t0 = time.perf_counter()
                llm.generate(reqs, one)  # the same prefills and no decode step
                best_one = min(best_one, time.perf_counter() - t0)
            waves = -(-len(reqs) // b)
            steps = waves * sp.max_tokens  # (until the eleventh session: wrong for b > 32)
            print(json.dumps({"batch": b, "prompt_tokens": prompt_tokens,
                              "graph_path_us_per_step": round(best / steps * 1e6, 1),
                              "decode_us_per_step": round((best - best_one) / (waves * (sp.max_tokens - 1)) * 1e6, 1),
                              "graph_steps": g.num_replays}))
    finally:
        model_runner.resolve_step_graphs = real


def rules_vs_free(llm: LLM, reqs: list[str]) -> None:
    """The default query set's rules against free decoding of the same requests, each run's steps
    and host ms a step (best of three; the answers end where the grammar or max_tokens ends them)."""
    from docproc.pipeline.queries import load_queries

    qs = load_queries().queries
    for name, constrain in (("rules", True), ("free", False)):
        params = [SamplingParams(temperature=0.0, max_tokens=qs[i % len(qs)].max_tokens,
                                 structured_outputs=qs[i % len(qs)].structured_outputs() if constrain else None)
                  for i in range(len(reqs))]
        llm.generate(reqs[:8], params[:8])
        best = None
        for _ in range(3):
            steps = llm.num_steps
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params)
            dt, n = time.perf_counter() - t0, llm.num_steps - steps
            if best is None or dt < best[0]:
                best = (dt, n, sum(len(o.outputs[0].token_ids) for o in outs))
        print(json.dumps({"rows": len(reqs), "decoding": name, "steps": best[1], "tokens": best[2],
                          "host_ms_per_step": round(best[0] / best[1] * 1e3, 2)}))


def device_run(args) -> None:
    reqs, params, _ = first_page_queries(args.docs_dir, args.docs)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for b in args.batches:
        configs = {"plain": {}, "adaptive": {"speculative_model": D, "num_speculative_tokens": "auto"},
                   "adaptive_no_probes": {"speculative_model": D, "num_speculative_tokens": "auto"}}
        llms = {n: LLM(T, device=args.device, max_num_seqs=b, kv_cache_memory_bytes=512 << 20, **kw)
                for n, kw in configs.items()}
        no_probes(llms["adaptive_no_probes"])
        acc: dict[str, dict] = {}
        for name, llm in llms.items():
            llm.generate(reqs, params)  # prefix cache filled, graphs captured
            st = acc[name] = {"step_s": 0.0, "steps": 0, "execute_s": 0.0, "spec_step_s": 0.0, "spec_steps": 0}

            def wrap(obj, attr, seconds, count=None, _st=st):
                orig = getattr(obj, attr)

                def timed(*a, **k):
                    t0 = time.perf_counter()
                    r = orig(*a, **k)
                    _st[seconds] += time.perf_counter() - t0
                    if count:
                        _st[count] += 1
                    return r
                setattr(obj, attr, timed)

            wrap(llm, "step", "step_s", "steps")
            wrap(llm.runner, "execute", "execute_s")
            if llm.speculator is not None:
                wrap(llm.verifier, "step", "spec_step_s", "spec_steps")
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                for key in acc[name]:
                    acc[name][key] = 0
                sync()
                t0 = time.perf_counter()
                llm.generate(reqs, params)
                sync()
                dt = time.perf_counter() - t0
                if name not in best or dt < best[name]["total_ms"] / 1e3:
                    best[name] = {"total_ms": round(dt * 1e3, 2),
                                  **{k[:-2] + "_ms" if k.endswith("_s") else k: round(v * 1e3, 2) if k.endswith("_s") else v
                                     for k, v in acc[name].items()}}
        for name, row in best.items():
            print(json.dumps({"batch": b, "config": name, **row}), flush=True)
        del llms
        if cuda:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stub", action="store_true")
    ap.add_argument("--stub-graph", action="store_true")
    ap.add_argument("--docs-dir", default=".work/speed_docs")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="--stub-graph: prompts of about this many tokens")
    ap.add_argument("--rules", action="store_true", help="--stub-graph: the default query set's rules against free "
                                                         "decoding (with --model, a checkpoint's tokenizer)")
    ap.add_argument("--model", default=T, help="--stub-graph: the checkpoint (its layers are removed)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.stub:
        stub(args.batches)
    elif args.stub_graph:
        stub_graph(args.batches, args.prompt_tokens, args.rules, args.model)
    else:
        device_run(args)


if __name__ == "__main__":
    main()
