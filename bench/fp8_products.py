"""One transformer layer's products at a geometry, timed alone on the GPU at batch sizes from 1 to
thousands of rows: bf16, and every FP8 path the engine has (and the pieces of each), so that a
step's FP8 cost can be read off row counts.

Rows (M) x each layer product (q|k|v, o, gate|up, down), per path:
- bf16: torch.nn.functional.linear on bf16 weights;
- fp8: docproc.models.quant.fp8_linear as the engine dispatches it (per-channel weights);
- fp8_block: the same for 128 x 128 block-wise weights;
- quantize: the per-token activation quantization alone (quantize_rows);
- scaled_mm: torch._scaled_mm alone on an already quantized input;
- rows: the few-row kernel (weight-only) up to ROWS_MAX rows;
- tc, tc_block: the Triton FP8 tensor-core product (activation quantization included) on
  per-channel and block-wise weights, at the tiles the engine picks (`--sweep-tc`: every tile in
  TC_TILES, the best reported per product);
- scaled_mm_block (--probe-layouts): torch.nn.functional.scaled_mm with 1x128 activation and
  128x128 weight blocks, each scale layout tried in turn.
Each: the median of CUDA-event timings over `--iters` runs (after warm-up), ms per layer (all four
products), TFLOP/s, and the weight bytes read per second. `--graphs`: each timing is one CUDA
graph replay of 10 calls, divided by 10 (as the engine's decode steps run: no launch latency).

    python3 bench/fp8_products.py --geometry 72b --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docproc.models.quant import fp8_linear, quantize, quantize_blocks  # noqa: E402
from kernels.fp8 import (ROWS_MAX, gemm_fp8_rows, gemm_fp8_tc, quantize_groups, quantize_groups_ref,  # noqa: E402
                         quantize_rows, quantize_rows_fast)

# (BLOCK_N, BLOCK_K, warps, stages) tried by --sweep-tc (BLOCK_M: all rows up to 128; BLOCK_K 128
# only for block-wise weights)
TC_TILES = [(bn, bk, w, st) for bn in (32, 64, 128) for bk in (128, 256) for w, st in ((4, 3), (4, 4), (4, 5), (8, 3))]
GRAPHS = False

# hidden, intermediate, heads, kv heads (head dim 128)
GEOMETRIES = {"2b": (1536, 8960, 12, 2), "7b": (3584, 18944, 28, 4), "72b": (8192, 29568, 64, 8)}


def layer_shapes(geometry: str) -> dict[str, tuple[int, int]]:
    h, inter, heads, kv = GEOMETRIES[geometry]
    return {"qkv": (h + 2 * kv * 128, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}


def timed(fn, iters: int) -> float:
    """Median ms of fn over iters runs, each between two CUDA events (GRAPHS: each run one replay of
    a CUDA graph of 10 calls, divided by 10)."""
    for _ in range(3):
        fn()
    run, per = fn, 1
    if GRAPHS:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        run, per = graph.replay, 10
        run()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per)
    times.sort()
    return times[len(times) // 2]


def sweep_tc(x, w, iters) -> dict:
    """Every TC_TILES tile of the Triton FP8 product on this weight (key splits as the engine picks
    them), then the best tile at 1, 2, 4 and 8 splits: ms by tile, and the best."""
    m = x.shape[0]
    block_m = min(128, max(16, 1 << (m - 1).bit_length()))
    per = {}

    def one(cfg):
        try:
            per["x".join(map(str, cfg))] = timed(lambda: gemm_fp8_tc(x, w.data, w.scale, w.group, config=cfg), iters)
        except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (shared memory): reported
            per["x".join(map(str, cfg))] = f"error: {type(e).__name__}"
    for bn, bk, warps, stages in TC_TILES:
        if w.per_channel or bk == w.group:
            one((block_m, bn, bk, warps, stages))
    ok = {k: v for k, v in per.items() if not isinstance(v, str)}
    if ok:
        tile = tuple(int(v) for v in min(ok, key=ok.get).split("x"))
        for splits in (1, 2, 4, 8):
            one((*tile, splits))
    ok = {k: v for k, v in per.items() if not isinstance(v, str)}
    best = min(ok, key=ok.get) if ok else None
    return {"best": best, "best_ms": ok.get(best), "by_tile": per}


def block_mm():
    """torch's block-wise scaled product (1x128 activation blocks, 128x128 weight blocks), or None."""
    F = torch.nn.functional
    st = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or st is None:
        return None

    def run(xq, sx, wq, sw):
        return F.scaled_mm(xq, wq.t(), sx, st.BlockWise1x128, sw, st.BlockWise128x128, output_dtype=torch.bfloat16)
    return run


def probe_block(bmm, x, wb, paths, name, iters):
    """torch's block-wise product on this product: the scale layouts it takes (tried in turn), its
    error against the dequantized product, and its time (with the activation quantization)."""
    m, k = x.shape
    g = -(-k // 128)
    gp = -(-g // 4) * 4
    n = wb.shape[0]
    wblk = wb.scale[::128]  # (N/128, G)
    ref = torch.nn.functional.linear(x.float(), wb.dequantize(torch.float32))
    tried = []
    for a_name in ("col_padded", "col", "row"):
        for b_name in ("col_padded", "col"):
            try:
                if a_name == "row":
                    sa_buf = None
                elif a_name == "col":
                    sa_buf = torch.empty(g, m, device=x.device).t()
                else:
                    sa_buf = torch.ones(gp, m, device=x.device).t()
                cols = gp if b_name == "col_padded" else g
                sb = torch.ones(n // 128, cols, device=x.device)
                sb[:, :g] = wblk
                sb = sb.t()

                def run():
                    xq, sa = quantize_groups(x, 128, sa_buf)
                    return bmm(xq, sa, wb.data, sb)
                y = run().float()
                err = ((y - ref).norm() / ref.norm()).item()
                paths["scaled_mm_block"][name] = timed(run, iters)
                return {"a": a_name, "b": b_name, "rel_err": round(err, 5), "tried": tried}
            except Exception as e:  # noqa: BLE001 - reported, the next layout is tried
                tried.append(f"{a_name}/{b_name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    paths["scaled_mm_block"][name] = "error"
    return {"tried": tried}


def check_quantizers(dev) -> dict:
    """The one-kernel quantizers against their torch references (codes and scales equal)."""
    out = {}
    for m, k in ((1, 3584), (37, 18944), (300, 8192), (5, 200)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
        x[0, :7] = 0
        q1, s1 = quantize_rows(x)
        q2, s2 = quantize_rows_fast(x)
        g1, t1 = quantize_groups_ref(x, 128)
        g2, t2 = quantize_groups(x, 128)
        out[f"{m}x{k}"] = {"rows_codes_equal": bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))),
                           "rows_scales_equal": bool(torch.equal(s1, s2)),
                           "groups_codes_equal": bool(torch.equal(g1.view(torch.uint8), g2.view(torch.uint8))),
                           "groups_scales_equal": bool(torch.equal(t1, t2))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7b", choices=sorted(GEOMETRIES))
    ap.add_argument("--rows", default="1,8,16,17,32,64,128,256,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--probe-layouts", action="store_true", help="also try torch's block-wise product's scale layouts")
    ap.add_argument("--graphs", action="store_true", help="time each path inside a CUDA graph")
    ap.add_argument("--sweep-tc", action="store_true", help="time every tile of the Triton FP8 product")
    ap.add_argument("--paths", default="", help="only these paths (comma-separated; default all)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    global GRAPHS
    GRAPHS = args.graphs
    only = set(filter(None, args.paths.split(",")))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = layer_shapes(args.geometry)
    weights = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        weights[name] = (w, quantize(w), quantize_blocks(w, (128, 128)))
    bmm = block_mm()
    out = {"geometry": args.geometry, "shapes": shapes, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "graphs": GRAPHS, "quantizers": check_quantizers(dev), "rows": {}}
    print(out["quantizers"], flush=True)
    for m in [int(r) for r in args.rows.split(",")]:
        res = {}
        names = ("bf16", "fp8", "fp8_block", "rows", "tc", "tc_block", "quantize", "quantize_torch", "scaled_mm",
                 "scaled_mm_block")
        paths = {name: {} for name in names if not only or name in only}

        def put(path, name, fn):
            if path in paths:
                paths[path][name] = timed(fn, args.iters)
        for name, (n, k) in shapes.items():
            w, wq, wb = weights[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            put("bf16", name, lambda: torch.nn.functional.linear(x, w))
            put("fp8", name, lambda: fp8_linear(x, wq))
            put("fp8_block", name, lambda: fp8_linear(x, wb))
            if m <= ROWS_MAX:
                put("rows", name, lambda: gemm_fp8_rows(x, wq.data, wq.scale, wq.group))
            put("tc", name, lambda: gemm_fp8_tc(x, wq.data, wq.scale, wq.group))
            put("tc_block", name, lambda: gemm_fp8_tc(x, wb.data, wb.scale, wb.group))
            if args.sweep_tc:
                res.setdefault("sweep_tc", {})[name] = sweep_tc(x, wq, args.iters)
                res.setdefault("sweep_tc_block", {})[name] = sweep_tc(x, wb, args.iters)
            if name == "down":  # each FP8 path against its quantized reference (a share of the error)
                ref = torch.nn.functional.linear(x.float(), wb.dequantize(torch.float32))
                res["fp8_block_rel_err"] = round(((fp8_linear(x, wb).float() - ref).norm() / ref.norm()).item(), 5)
                xq, sx = quantize_rows(x)
                ref = (xq.float() * sx) @ wq.dequantize(torch.float32).t()
                got = gemm_fp8_tc(x, wq.data, wq.scale, wq.group).float()
                res["tc_rel_err_vs_quantized"] = round(((got - ref).norm() / ref.norm()).item(), 6)
            put("quantize", name, lambda: quantize_rows_fast(x))
            put("quantize_torch", name, lambda: quantize_rows(x))
            xq, sx = quantize_rows(x)
            try:
                put("scaled_mm", name, lambda: torch._scaled_mm(
                    xq, wq.data.t(), scale_a=sx, scale_b=wq.scale.view(1, -1), out_dtype=torch.bfloat16))
            except RuntimeError as e:
                if "scaled_mm" in paths:
                    paths["scaled_mm"][name] = f"error: {str(e).splitlines()[0][:160]}"
            if bmm is not None and args.probe_layouts and "scaled_mm_block" in paths:
                res.setdefault("block_layout", {})[name] = probe_block(bmm, x, wb, paths, name, args.iters)
        for path, per in paths.items():
            if not per or len(per) < len(shapes) or any(isinstance(v, str) for v in per.values()):
                res[path] = per
                continue
            ms = sum(per.values())
            flop = sum(2 * m * n * k for n, k in shapes.values())
            wbytes = sum(n * k * (2 if path == "bf16" else 1) for n, k in shapes.values())
            res[path] = {"ms_per_layer": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                         "weight_gbps": round(wbytes / ms / 1e6, 1),
                         "products_ms": {n_: round(v, 4) for n_, v in per.items()}}
        out["rows"][m] = res
        print(m, {p: (r["ms_per_layer"] if isinstance(r, dict) and "ms_per_layer" in r else r) for p, r in res.items()},
              flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
