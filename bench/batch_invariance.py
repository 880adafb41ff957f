"""Where an answer starts to depend on its batch: each product and attention row of a model's
shapes computed alone and inside batches, compared bit for bit ("ops"), and one request's tokens
and first logits alone and inside batches of other documents' requests through the engine
("engine").

    python3 bench/batch_invariance.py ops --geometry 7b --json $OUT/bi_ops.json
    python3 bench/batch_invariance.py engine --kv-cache fp4 --batches 1,8,32 --json $OUT/bi_engine.json

ops, products: rows 0-7 of x (M, K) times the geometry's weights (bf16: the engine's
`kernels.gemv.linear`, one row through the one-row kernel on CUDA; FP8: `fp8_linear` on weights
quantized per channel) for each M, against the same rows alone (M = 1) and against M = 2's.
ops, attention: one query row (the last position of a sequence of --context keys, 28 query heads
over 4 KV heads at 7B) through the engine's backend (`DenseAttention` bf16, `FP4Attention`),
alone as a decode row, inside decode batches of B sequences of other lengths, as row j of a
verification window of 5, and as the last row of a 64-token prefill chunk; each against the row
alone. engine: the first document's `all_fields` request, greedy, alone and with the other
documents' requests (--batches), prefix caching off so that every pass computes its prompt; its
tokens and every plain step's logits against the request alone (the first differing step, the
largest difference) and its page's vision embeddings (each pass encodes its pages afresh, as a
run of its own would), with and without a draft.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"equal": bool(torch.equal(a, b)), "max_abs_diff": float(d.max()),
            "differing_share": round(float((d > 0).float().mean()), 4)}


def products(geo: dict, dev: torch.device, rows: list[int], fp8: bool, opts) -> dict:
    from kernels.gemv import linear
    from docproc.models.quant import fp8_linear, quantize

    t = geo["text"]
    h, inter, heads, kvh = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = h // heads
    shapes = {"qkv": (h, (heads + 2 * kvh) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for name, (k, n) in shapes.items():
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(dev)
        x = torch.randn(max(rows), k, generator=g).to(torch.bfloat16).to(dev)
        wq = quantize(w) if fp8 else None

        def prod(xs):
            return fp8_linear(xs, wq, opts=opts) if fp8 else linear(xs, w, opts=opts)

        alone = torch.cat([prod(x[i:i + 1]) for i in range(8)])
        pair = prod(x[:2])
        cells = {}
        for m in rows:
            y = prod(x[:m])[: min(8, m)]
            cells[m] = {"vs_alone": compare(y, alone[: len(y)]), "vs_two_rows": compare(y[:2], pair[: len(y[:2])])}
        out[name] = cells
    return out


def attention_rows(geo: dict, dev: torch.device, kv: str, context: int, batches: list[int], opts) -> dict:
    """The probe row (the last of a sequence of `context` keys) through the engine's attention
    backend in each arrangement, against the row alone."""
    from docproc.layers.attention import AttentionMetadata, DenseAttention, FP4Attention

    t = geo["text"]
    heads, kvh = t["num_attention_heads"], t["num_key_value_heads"]
    d = t["hidden_size"] // heads
    bs = 16
    lengths = [context] + [1000 + 700 * i for i in range(max(batches))]  # the others' keys
    blocks = [-(-n // bs) + 1 for n in lengths]
    nb = sum(blocks) + 1
    if kv == "fp4":
        backend = FP4Attention(heads, kvh, d, d ** -0.5, dev, torch.bfloat16, kernels=opts)
    else:
        backend = DenseAttention(heads, kvh, d, d ** -0.5, dev, torch.bfloat16, torch.bfloat16, kernels=opts)
    layer = backend.allocate(nb, bs)
    g = torch.Generator(device="cpu").manual_seed(1)
    slots = torch.arange(nb * bs, device=dev)
    k = torch.randn(nb * bs, kvh, d, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(nb * bs, kvh, d, generator=g).to(torch.bfloat16).to(dev)
    backend.store(layer, k, v, AttentionMetadata(slots, [0, 1], [1], [[0]], bs))
    tables, used = [], 1  # block 0 left out
    for n in blocks:
        tables.append(list(range(used, used + n)))
        used += n
    q_probe = torch.randn(1, heads, d, generator=g).to(torch.bfloat16).to(dev)

    def run(q_lens: list[int], ctx: list[int], seqs: list[int], probe_row: int) -> torch.Tensor:
        qs = [0]
        for n in q_lens:
            qs.append(qs[-1] + n)
        q = torch.randn(qs[-1], heads, d, generator=g).to(torch.bfloat16).to(dev)
        q[probe_row] = q_probe[0]
        meta = AttentionMetadata(torch.zeros(qs[-1], dtype=torch.long, device=dev), qs, ctx,
                                 [tables[s] for s in seqs], bs)
        backend.prepare(meta)
        out = backend.attend(q, layer, meta)
        return out[probe_row].clone(), meta.plan

    alone, plan = run([1], [context], [0], 0)
    cells = {"alone": {"num_splits": plan.num_splits if plan else None}}
    for b in batches:
        if b == 1:
            continue
        y, plan = run([1] * b, lengths[:b], list(range(b)), 0)
        cells[f"decode_batch_{b}"] = {**compare(y, alone), "num_splits": plan.num_splits if plan else None}
    for j in range(5):  # row j of a window of 5 whose row j is the probe's position
        y, plan = run([5], [context + 4 - j], [0], j)
        cells[f"window_row_{j}"] = {**compare(y, alone), "num_splits": plan.num_splits if plan else None}
    y, plan = run([64, 1, 1], [context, lengths[1], lengths[2]], [0, 1, 2], 63)
    cells["prefill_chunk_last_row"] = {**compare(y, alone), "num_splits": plan.num_splits if plan else None}
    return cells


def ops(args) -> dict:
    from fixtures.checkpoints import GEOMETRIES

    dev = torch.device(args.device)
    geo = GEOMETRIES[args.geometry]
    rows = [int(r) for r in args.rows.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    from kernels.options import KernelOptions

    opts = KernelOptions(batch_invariant=args.batch_invariant)
    report = {"products_bf16": products(geo, dev, rows, False, opts)}
    if dev.type == "cuda":
        report["products_fp8"] = products(geo, dev, rows, True, opts)
    for kv in ("bf16", "fp4"):
        report[f"attention_{kv}"] = {c: attention_rows(geo, dev, kv, c, batches, opts)
                                     for c in (int(x) for x in args.contexts.split(","))}
    return report


def engine(args) -> dict:
    from workloads import first_page_queries

    from docproc import LLM

    reqs, params, _ = first_page_queries(args.docs, max(int(b) for b in args.batches.split(",")))
    names = [q.name for q in __import__("docproc.pipeline.queries", fromlist=["load_queries"]).load_queries().queries]
    probe = names.index("all_fields")  # the first document's long answer
    for p in params:
        p.max_tokens = args.max_tokens
    kw = dict(device=args.device, kv_cache_dtype=args.kv_cache, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=0.8, batch_invariant=args.batch_invariant)
    if args.draft:
        kw.update(speculative_model=args.draft, num_speculative_tokens=args.spec_k)
    llm = LLM(args.model, **kw)
    seen: dict[int, list[torch.Tensor]] = {}
    target = {"seq_id": None}

    def hook(seqs, logits):
        for i, s in enumerate(seqs):
            if s.seq_id == target["seq_id"]:
                seen.setdefault(s.seq_id, []).append(logits[i].float().cpu())

    llm.runner.logits_hook = hook
    from docproc.engine.sequence import Sequence

    def caches():
        from docproc.engine.encoder_cache import EncoderCache

        return [o for o in gc.get_objects() if isinstance(o, EncoderCache)]

    def fresh_encodes():
        for c in caches():
            c._entries.clear()
            c.nbytes = 0

    def page_embeds(req) -> torch.Tensor:
        key = (llm.runner.model.vision_fingerprint, req["multi_modal_uuids"]["image"][0])
        return llm.runner.encoder_cache.get(key).float().cpu()

    report, base = {}, None
    for b in [int(x) for x in args.batches.split(",")]:
        for repeat in range(args.repeats):
            order = [probe] + [i for i in range(len(reqs)) if i != probe][: (b - 1) * len(names)]
            # the probe first, then the others' requests (b - 1 documents' worth of queries)
            probe_id = next(Sequence._ids)
            Sequence._ids = __import__("itertools").count(probe_id)
            target["seq_id"] = probe_id
            seen.clear()
            fresh_encodes()  # each pass encodes its pages, as a run of its own would
            t0 = time.perf_counter()
            outs = llm.generate([reqs[i] for i in order], [params[i] for i in order])
            tokens = list(outs[0].outputs[0].token_ids)
            embeds = page_embeds(reqs[probe])
            logits = seen.get(probe_id, [])
            cell = {"requests": len(order), "seconds": round(time.perf_counter() - t0, 2), "tokens": len(tokens),
                    "plain_steps_seen": len(logits)}
            if base is None:
                base = (tokens, logits, embeds)
            else:
                cell["page_embeddings"] = compare(embeds, base[2])
                same = next((i for i, (a, c) in enumerate(zip(tokens, base[0])) if a != c), None)
                cell["first_differing_token"] = same if same is not None else (
                    None if len(tokens) == len(base[0]) else min(len(tokens), len(base[0])))
                diffs = [compare(a, c) for a, c in zip(logits, base[1])]
                cell["first_differing_logits_step"] = next((i for i, x in enumerate(diffs) if not x["equal"]), None)
                cell["first_step_logits"] = diffs[0] if diffs else None
                cell["max_logit_diff"] = max((x["max_abs_diff"] for x in diffs), default=None)
            report[f"batch_{b}_r{repeat}"] = cell
            print(f"batch {b} r{repeat}: {cell}", flush=True)
    llm.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["ops", "engine"])
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--geometry", default="7b", help="ops: the shapes")
    ap.add_argument("--rows", default="1,2,4,8,16,17,32,64,128,512,1300", help="ops: product rows M")
    ap.add_argument("--contexts", default="1500,5000", help="ops: the probe row's keys")
    ap.add_argument("--batches", default="1,8,32,64", help="decode batches (ops) / documents (engine)")
    ap.add_argument("--model", default=str(ROOT / "docproc" / "assets" / "models" / "target"))
    ap.add_argument("--draft", default=None)
    ap.add_argument("--spec-k", default="4")
    ap.add_argument("--kv-cache", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true", help="the engine's batch-invariant mode "
                    "(KernelOptions.batch_invariant)")
    ap.add_argument("--docs", default=str(ROOT / "sample_docs"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    report = {"part": args.part, "args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "torch": torch.__version__}
    report["results"] = ops(args) if args.part == "ops" else engine(args)
    Path(args.json).write_text(json.dumps(report, indent=1))
    if args.part == "ops":  # one line each: the arrangements whose rows differ from the row alone
        for section, cells in report["results"].items():
            for key, row in cells.items():
                if section.startswith("products"):
                    bad = {m: c["vs_alone"]["max_abs_diff"] for m, c in row.items() if not c["vs_alone"]["equal"]}
                    bad2 = {m: c["vs_two_rows"]["max_abs_diff"] for m, c in row.items() if not c["vs_two_rows"]["equal"]}
                    print(f"{section} {key}: rows differ from alone at M {bad or 'none'}; from M=2 at {bad2 or 'none'}")
                else:
                    bad = {a: (c["max_abs_diff"], c.get("num_splits")) for a, c in row.items() if a != "alone"
                           and not c["equal"]}
                    print(f"{section} {key} keys (alone: {row['alone']['num_splits']} splits): differ {bad or 'nowhere'}")


if __name__ == "__main__":
    main()
