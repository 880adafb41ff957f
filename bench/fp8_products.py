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
- scaled_mm_block (--probe-layouts): torch.nn.functional.scaled_mm with 1x128 activation and
  128x128 weight blocks, each scale layout tried in turn.
Each: the median of CUDA-event timings over `--iters` runs (after warm-up), ms per layer (all four
products), TFLOP/s, and the weight bytes read per second.

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
from kernels.fp8 import ROWS_MAX, gemm_fp8_rows, quantize_groups, quantize_groups_ref, quantize_rows, quantize_rows_fast  # noqa: E402

# hidden, intermediate, heads, kv heads (head dim 128)
GEOMETRIES = {"2b": (1536, 8960, 12, 2), "7b": (3584, 18944, 28, 4), "72b": (8192, 29568, 64, 8)}


def layer_shapes(geometry: str) -> dict[str, tuple[int, int]]:
    h, inter, heads, kv = GEOMETRIES[geometry]
    return {"qkv": (h + 2 * kv * 128, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}


def timed(fn, iters: int) -> float:
    """Median ms of fn over iters runs, each between two CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


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
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = layer_shapes(args.geometry)
    weights = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        weights[name] = (w, quantize(w), quantize_blocks(w, (128, 128)))
    bmm = block_mm()
    out = {"geometry": args.geometry, "shapes": shapes, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "quantizers": check_quantizers(dev), "rows": {}}
    print(out["quantizers"], flush=True)
    for m in [int(r) for r in args.rows.split(",")]:
        res = {}
        paths = {name: {} for name in ("bf16", "fp8", "fp8_block", "rows", "quantize", "quantize_torch", "scaled_mm",
                                             "scaled_mm_block")}
        for name, (n, k) in shapes.items():
            w, wq, wb = weights[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            paths["bf16"][name] = timed(lambda: torch.nn.functional.linear(x, w), args.iters)
            paths["fp8"][name] = timed(lambda: fp8_linear(x, wq), args.iters)
            paths["fp8_block"][name] = timed(lambda: fp8_linear(x, wb), args.iters)
            if m <= ROWS_MAX:
                paths["rows"][name] = timed(lambda: gemm_fp8_rows(x, wq.data, wq.scale, wq.group), args.iters)
            if name == "down":  # the block-wise path against its reference (a share of the error)
                ref = torch.nn.functional.linear(x.float(), wb.dequantize(torch.float32))
                res["fp8_block_rel_err"] = round(((fp8_linear(x, wb).float() - ref).norm() / ref.norm()).item(), 5)
            paths["quantize"][name] = timed(lambda: quantize_rows_fast(x), args.iters)
            paths["quantize_torch"][name] = timed(lambda: quantize_rows(x), args.iters)
            xq, sx = quantize_rows(x)
            try:
                paths["scaled_mm"][name] = timed(lambda: torch._scaled_mm(
                    xq, wq.data.t(), scale_a=sx, scale_b=wq.scale.view(1, -1), out_dtype=torch.bfloat16),
                    args.iters)
            except RuntimeError as e:
                paths["scaled_mm"][name] = f"error: {str(e).splitlines()[0][:160]}"
            if bmm is not None and args.probe_layouts:
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
