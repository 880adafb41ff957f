"""The weight products of one batch-1 decode step, cuBLAS (F.linear) against kernels/gemv.py, on
the device. For the Qwen2-VL-2B and -7B geometries: every layer's own weights (no L2 reuse
between layers, as in the model), the four products per layer (qkv with its bias, o, gate|up, down
after SiLU x up) and the LM head, each product type replayed from a CUDA graph over all layers.
Reports microseconds per step for each, the bytes read, and the fraction of the copy bandwidth
measured in the same run.

    python scripts/bench_gemv.py --json OUT/gemv.json [--geometries 7b,2b] [--configs 8x512x4,4x512x4,...]

--rows M (with --fp8) times instead the few-row FP8 kernel (kernels/fp8.gemm_fp8_rows: a
verification window of M positions) for each --rows-configs (BLOCK_N x BLOCK_K x warps x stages)
against the one-row kernel on one row and torch._scaled_mm on M, over the first --layers layers
(a 72B geometry's 80 layers do not fit the device in bf16 before quantizing).

--chain times instead one step's dependent chain of the layers' kernels without attention (add +
RMSNorm, qkv, o, add + RMSNorm, gate|up, SiLU x down; each reads the one before), with
programmatic dependent launch (kernels/pdl.py) on and off, and with cuBLAS for the products.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernels.fused import add_rms_norm, silu_mul  # noqa: E402
from kernels.gemv import default_config, gemv  # noqa: E402
from fixtures.checkpoints import GEOMETRIES  # noqa: E402


def copy_bandwidth(mib: int = 2048) -> float:
    a = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 2 * a.numel() / min(ts)


def graph_us(fn, repeats: int = 20) -> float:
    """Median microseconds of one replay of a graph of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def layer_weights(geo: str, dt: torch.dtype):
    """Random weights of every decoder layer at a geometry (each layer its own: no L2 reuse):
    (text config, hidden, intermediate, layers, qkv width, [layer dicts], the maker w(n, k))."""
    t = GEOMETRIES[geo]["text"]
    h, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    nqkv = h + 2 * t["num_key_value_heads"] * (h // t["num_attention_heads"])
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dt)

    W = [dict(qkv=w(nqkv, h), qkv_b=w(1, nqkv)[0], o=w(h, h), gu=w(2 * inter, h), down=w(h, inter))
         for _ in range(layers)]
    return t, h, inter, layers, nqkv, W, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--geometries", default="7b,2b")
    ap.add_argument("--configs", default="8x512x4,4x512x4,16x256x4,8x1024x8,4x256x2",
                    help="BLOCK_N x BLOCK_K x warps of the Triton GEMV to time")
    ap.add_argument("--chain", action="store_true", help="time the dependent chain, PDL on and off (above)")
    ap.add_argument("--fp8", action="store_true",
                    help="per-row FP8 weights: kernels/fp8.gemv_fp8 for each config against torch._scaled_mm "
                         "(the several-row path, its input quantized per token)")
    ap.add_argument("--plain-down", action="store_true",
                    help="also the down projection after a separate SiLU x up kernel (against the gated one)")
    ap.add_argument("--rows", type=int, default=0, help="with --fp8: the few-row kernel at this many rows (above)")
    ap.add_argument("--rows-configs", default="64x128x4x4,32x256x4x3,64x256x4x3,128x128x4x4,32x128x4x4,64x128x8x4")
    ap.add_argument("--layers", type=int, default=0, help="with --rows: this many layers (0: all)")
    a = ap.parse_args()
    dt = torch.bfloat16
    bw = copy_bandwidth()
    if a.chain:
        return chain(a, bw)
    if a.rows:
        return rows_sweep(a, bw)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_GBps": round(bw / 1e9, 1), "geometries": {}}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
    for geo in a.geometries.split(","):
        key, rows = geo, 1
        fn, cfgs, default = gemv, configs, default_config
        t, h, inter, layers, nqkv, W, w = layer_weights(geo, dt)
        head = w(t["vocab_size"], h)
        lin = torch.nn.functional.linear
        if a.fp8:  # the engine's FP8 layout: codes + one float32 scale per output row; the LM head stays bf16
            from kernels.fp8 import default_config as fp8_default, fp8_linear_ref, gemv_fp8, scaled_mm
            from docproc.models.quant import quantize

            key = geo + "_fp8"
            W = [{n: (quantize(v) if v.dim() == 2 else v) for n, v in L.items()} for L in W]
            default = fp8_default

            def fn(x, q, bias=None, gated=False, config=None):
                if not hasattr(q, "scale"):  # the bf16 LM head
                    return gemv(x, q, bias, gated=gated, config=config)
                return gemv_fp8(x, q.data, q.scale, q.group, bias, gated=gated, config=config)

            def lin(x, q, bias=None):
                return lin_bf16(x, q, bias) if not hasattr(q, "scale") else scaled_mm(x, q.data, q.scale, bias)

            lin_bf16 = torch.nn.functional.linear

            def ref_check(x, q, bias=None):
                if not hasattr(q, "scale"):
                    return lin_bf16(x, q, bias)
                return fp8_linear_ref(x, q.data, q.scale, q.group, bias)
        x = torch.randn(rows, h, device="cuda", dtype=dt)
        xgu = torch.randn(rows, 2 * inter, device="cuda", dtype=dt)
        wb = 1 if a.fp8 else 2  # bytes a weight (FP8: codes; their row scales are 4 bytes a row more)
        sb = 4 if a.fp8 else 0
        ops = {  # name -> (cuBLAS step, gemv step(config), bytes)
            "qkv": (lambda: [lin(x, L["qkv"], L["qkv_b"]) for L in W],
                    lambda c: [fn(x, L["qkv"], L["qkv_b"], config=c) for L in W], layers * nqkv * (h * wb + sb)),
            "o": (lambda: [lin(x, L["o"]) for L in W],
                  lambda c: [fn(x, L["o"], config=c) for L in W], layers * h * (h * wb + sb)),
            "gate_up": (lambda: [lin(x, L["gu"]) for L in W],
                        lambda c: [fn(x, L["gu"], config=c) for L in W], layers * 2 * inter * (h * wb + sb)),
            "silu_down": (lambda: [lin(silu_mul(xgu), L["down"]) for L in W],
                          lambda c: [fn(xgu, L["down"], gated=True, config=c) for L in W], layers * h * (inter * wb + sb)),
            "lm_head": (lambda: lin(x, head),
                        lambda c: fn(x, head, config=c), head.numel() * 2),
        }
        if a.plain_down:  # SiLU x up in its own kernel, then the down projection on its output
            ops["silu_then_down"] = (lambda: [lin(silu_mul(xgu), L["down"]) for L in W],
                                     lambda c: [fn(silu_mul(xgu), L["down"], config=c) for L in W],
                                     layers * h * (inter * wb + sb))
        checks = {"qkv": lambda: ref_check(x, W[0]["qkv"], W[0]["qkv_b"]), "o": lambda: ref_check(x, W[0]["o"]),
                  "gate_up": lambda: ref_check(x, W[0]["gu"]), "silu_down": lambda: ref_check(silu_mul(xgu), W[0]["down"]),
                  "lm_head": lambda: ref_check(x, head),
                  "silu_then_down": lambda: ref_check(silu_mul(xgu), W[0]["down"])} if a.fp8 else {}
        # the outputs agree (bf16 rounding of float32 sums in another order)
        for name, (ref, ours, _) in ops.items():
            r, o = (checks[name]() if a.fp8 else ref()), ours(None)
            r, o = (r[0] if isinstance(r, list) else r), (o[0] if isinstance(o, list) else o)
            err = ((r.float() - o.float()).abs().max() / r.float().abs().max()).item()
            assert err < 2e-2, (geo, name, err)
        out = {}
        total = {"cublas": 0.0}
        for name, (ref, ours, nbytes) in ops.items():
            row = {"bytes": nbytes}
            try:
                row["cublas_us"] = round(graph_us(ref), 2)
                row["cublas_bw"] = round(nbytes / (row["cublas_us"] * 1e-6) / bw, 3)
                total["cublas"] += row["cublas_us"]
            except RuntimeError as e:  # _scaled_mm refuses some one-row shapes
                row["cublas"] = f"failed: {str(e)[:120]}"

            for c in cfgs + [None]:
                name_c = "gemv_default" if c is None else "gemv_" + "x".join(str(v) for v in c)
                try:
                    us = graph_us(lambda: ours(c))
                except Exception as e:  # a config that does not compile or launch
                    row[name_c] = f"failed: {type(e).__name__}"
                    continue
                row[name_c + "_us"] = round(us, 2)
                row[name_c + "_bw"] = round(nbytes / (us * 1e-6) / bw, 3)
                total[name_c] = total.get(name_c, 0.0) + us
            out[name] = row
            print(key, name, json.dumps(row), flush=True)
        out["step_total_us"] = {k: round(v, 1) for k, v in total.items()}
        out["rows"] = rows
        out["default_config"] = {n: default(*s) for n, s in
                                 (("qkv", (nqkv, h)), ("o", (h, h)), ("gate_up", (2 * inter, h)),
                                  ("silu_down", (h, inter, True)), ("lm_head", (t["vocab_size"], h)))}
        print(key, "step totals", json.dumps(out["step_total_us"]), flush=True)
        res["geometries"][key] = out
        del W, head
        torch.cuda.empty_cache()
        Path(a.json).write_text(json.dumps(res, indent=1))
    Path(a.json).write_text(json.dumps(res, indent=1))


def rows_sweep(a, bw: float) -> None:
    """The few-row FP8 kernel at --rows rows against one row and _scaled_mm (module docstring)."""
    from docproc.models.quant import quantize
    from kernels.fp8 import fp8_linear_ref, gemm_fp8_rows, gemv_fp8, rows_config, scaled_mm

    m = a.rows
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_GBps": round(bw / 1e9, 1), "rows": m, "geometries": {}}
    configs = [tuple(int(v) for v in c.split("x")) for c in a.rows_configs.split(",")]
    for geo in a.geometries.split(","):
        t = GEOMETRIES[geo]["text"]
        h, inter, all_layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
        layers = min(a.layers or all_layers, all_layers)
        nqkv = h + 2 * t["num_key_value_heads"] * (h // t["num_attention_heads"])
        g = torch.Generator(device="cuda").manual_seed(0)

        def w(n, k):  # quantized at once: a 72B layer's bf16 weights are 1.7 GB
            return quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16))

        W = [dict(qkv=w(nqkv, h), qkv_b=torch.randn(nqkv, device="cuda", dtype=torch.bfloat16) * 0.02,
                  o=w(h, h), gu=w(2 * inter, h), down=w(h, inter)) for _ in range(layers)]
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        act = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16)
        xgu1 = torch.randn(1, 2 * inter, device="cuda", dtype=torch.bfloat16)
        ops = {"qkv": ("qkv", x, "qkv_b", nqkv, h), "o": ("o", x, None, h, h), "gate_up": ("gu", x, None, 2 * inter, h),
               "down": ("down", act, None, h, inter)}
        out = {"layers": layers, "all_layers": all_layers, "default_config": list(rows_config(0, True))}
        totals: dict[str, float] = {}
        for name, (key, inp, bias, n, k) in ops.items():
            nbytes = layers * n * (k + 4)
            row = {"bytes": nbytes}
            q0 = W[0][key]
            ref = fp8_linear_ref(inp, q0.data, q0.scale, q0.group, W[0][bias] if bias else None)
            runs = {"one_row": lambda: [gemv_fp8(xgu1 if key == "down" else inp[:1], L[key].data, L[key].scale,
                                                 L[key].group, L[bias] if bias else None, gated=key == "down")
                                        for L in W],
                    "scaled_mm": lambda: [scaled_mm(inp, L[key].data, L[key].scale, L[bias] if bias else None)
                                          for L in W]}
            for c in configs + [None]:
                label = "rows_default" if c is None else "rows_" + "x".join(map(str, c))
                try:
                    got = gemm_fp8_rows(inp, q0.data, q0.scale, q0.group, W[0][bias] if bias else None, config=c)
                except Exception as e:  # a config that does not compile or launch
                    row[label] = f"failed: {type(e).__name__}"
                    continue
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                assert err < 2e-2, (geo, name, c, err)
                runs[label] = (lambda c=c: [gemm_fp8_rows(inp, L[key].data, L[key].scale, L[key].group,
                                                          L[bias] if bias else None, config=c) for L in W])
            for label, fn in runs.items():
                try:
                    us = graph_us(fn)
                except RuntimeError as e:
                    row[label] = f"failed: {str(e)[:120]}"
                    continue
                row[label + "_us"] = round(us, 2)
                row[label + "_bw"] = round(nbytes / (us * 1e-6) / bw, 3)
                totals[label] = totals.get(label, 0.0) + us * all_layers / layers
            out[name] = row
            print(geo, name, json.dumps(row), flush=True)
        out["step_total_us_all_layers"] = {k: round(v, 1) for k, v in totals.items()}
        print(geo, "totals", json.dumps(out["step_total_us_all_layers"]), flush=True)
        res["geometries"][geo] = out
        del W
        torch.cuda.empty_cache()
    Path(a.json).write_text(json.dumps(res, indent=1))


def chain(a, bw: float) -> None:
    """One decode step's layers without attention, each kernel reading the one before."""
    dt = torch.bfloat16
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_GBps": round(bw / 1e9, 1), "chain": {}}
    for geo in a.geometries.split(","):
        t, h, inter, layers, nqkv, W, w = layer_weights(geo, dt)
        for L in W:
            L["n1"], L["n2"] = torch.ones(h, device="cuda", dtype=dt), torch.ones(h, device="cuda", dtype=dt)
        x0 = torch.randn(1, h, device="cuda", dtype=dt)
        nbytes = sum(v.numel() * 2 for L in W for v in L.values())

        def step(blas: bool, pdl: bool = True):
            lin = torch.nn.functional.linear
            one_row = functools.partial(gemv, pdl_on=pdl)
            x, r = x0, x0
            for L in W:
                hh, r = add_rms_norm(x, r, L["n1"], 1e-6, pdl_on=pdl)
                qkv = lin(hh, L["qkv"], L["qkv_b"]) if blas else one_row(hh, L["qkv"], L["qkv_b"])
                q = qkv[:, :h].contiguous() if blas else qkv[:, :h]
                o = lin(q, L["o"]) if blas else one_row(q, L["o"])
                hh, r = add_rms_norm(o, r, L["n2"], 1e-6, pdl_on=pdl)
                if blas:
                    x = lin(silu_mul(lin(hh, L["gu"])), L["down"])
                else:
                    x = one_row(one_row(hh, L["gu"]), L["down"], gated=True)
            return x

        row = {"weight_bytes": nbytes, "kernels_per_layer": 6}
        ref = step(True)
        for name, blas, pdl in (("cublas", True, True), ("ours_pdl", False, True), ("ours_no_pdl", False, False)):
            out = step(blas, pdl)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
            us = graph_us(lambda: step(blas, pdl))
            row[name + "_us"] = round(us, 1)
            row[name + "_bw"] = round(nbytes / (us * 1e-6) / bw, 3)
            row[name + "_max_rel_err_vs_cublas"] = round(err, 4)
        row["pdl_speedup"] = round(row["ours_no_pdl_us"] / row["ours_pdl_us"], 3)
        print(geo, "chain", json.dumps(row), flush=True)
        res["chain"][geo] = row
        del W
        torch.cuda.empty_cache()
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
