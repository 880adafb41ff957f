"""Compile our paged attention kernels for Hopper (sm_90) on a machine without a GPU and print the
inner loop's instruction mix: how many SASS instructions one thread issues per KV tile, and of
which kinds. A first check of a kernel change before spending device time on it.

    python scripts/kernel_sass.py --kernel fp4 --block-n 128
    PYTHONPATH=/tmp/t36 python scripts/kernel_sass.py ...   # with the device's Triton (3.6) unpacked
                                                            # there from its wheel (pip download)

Launch arguments are those of the Qwen2-VL-7B geometry (28 query / 4 KV heads x 128, block 16,
two outlier slots); pointer and stride divisibility is declared as Triton would specialise it at
launch. Uses the ptxas and cuobjdump that Triton's NVIDIA backend ships.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import paged_attention as pa  # noqa: E402

# runtime values at the 7B geometry (FP4 pool: 9,600-byte pages, keys with 2 outlier slots and values
# without; dense: bf16 blocks)
FP4_INTS = dict(block_size=16, sq_t=3584, sq_h=128, so_t=3584, so_h=128, s_table=1024, sk_b=9600, sk_s=256,
                sk_h=64, ss_b=9600, ss_s=32, ss_h=8, si_b=9600, si_s=8, si_h=2, sv_b=4800, sv_s=8, sv_h=2)
DENSE_INTS = dict(block_size=16, sq_t=3584, sq_h=128, so_t=3584, so_h=128, s_table=1024, sk_b=16 * 4 * 128,
                  sk_s=4 * 128, sk_h=128)
POINTER_TYPES = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                 "k_ptr": "*bf16", "v_ptr": "*bf16", "kv_ptr": "*fp16", "vv_ptr": "*fp16", "khs_ptr": "*fp32",
                 "vhs_ptr": "*fp32", "table_ptr": "*i32", "eye_ptr": "*bf16"}


def compile_sass(kernel: str, block_n: int, num_warps: int, ptx_decode: bool = True,
                extra: dict | None = None) -> str:
    fn = pa._paged_attn_fp4_kernel if kernel == "fp4" else pa._paged_attn_kernel
    ints = FP4_INTS if kernel == "fp4" else DENSE_INTS
    meta = dict(GROUP=7, TOKENS=1, BLOCK_M=16, BLOCK_N=block_n, HALF=64, SPLIT=True, NUM_OUTLIERS=2,
                DOT_FP32=False, PTX_DECODE=ptx_decode, PDL=0)
    meta.update(extra or {})
    sig, consts, attrs = {}, {}, {}
    for prm in fn.params:  # compile-time parameters left at their defaults
        if prm.is_constexpr and prm.name not in meta and prm.default is not inspect.Parameter.empty:
            meta[prm.name] = prm.default
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            sig[name], consts[name] = "constexpr", meta[name]
        elif name.endswith("_ptr"):
            sig[name] = POINTER_TYPES.get(name, "*u8")
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=int(os.environ.get("KERNEL_SASS_STAGES", "2")),
                                    **({"maxnreg": int(os.environ["KERNEL_SASS_MAXNREG"])}
                                       if os.environ.get("KERNEL_SASS_MAXNREG") else {})))
    if os.environ.get("KERNEL_SASS_IR"):
        Path(os.environ["KERNEL_SASS_IR"]).write_text(compiled.asm["ttgir"])
    md = compiled.metadata
    print(f"registers per thread {getattr(md, 'n_regs', '?')}, shared memory {md.shared} bytes", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?SHARED:(\d+)", res)
        if m:
            print(f"ptxas: {m.group(1)} registers per thread, {m.group(2)} bytes of static shared memory", flush=True)
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instructions in the largest backward-branch loop, and their opcodes."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,6}\*/", ln)]

    def addr(ln):
        return int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16)

    loops = []
    for ln in lines:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr(ln):
            loops.append((int(m.group(1), 16), addr(ln)))
    if not loops:
        return 0, collections.Counter()
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    body = [ln for ln in lines if lo <= addr(ln) <= hi]

    def opcode(ln):
        toks = ln.split("*/")[1].strip().rstrip(";").split()
        return toks[1] if toks[0].startswith("@") else toks[0]

    return len(body), collections.Counter(opcode(ln) for ln in body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=("fp4", "dense"), default="fp4")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--float-decode", action="store_true", help="FP4: the float32 decode instead of the PTX one")
    ap.add_argument("--meta", default="", help="extra compile-time arguments, NAME=VALUE,... (ints/bools)")
    ap.add_argument("--sass", default=None, help="also write the whole SASS listing here")
    a = ap.parse_args()
    sass = compile_sass(a.kernel, a.block_n, a.num_warps, not a.float_decode, {k: eval(v) for k, v in (kv.split("=") for kv in a.meta.split(",") if kv)})
    if a.sass:
        Path(a.sass).write_text(sass)
    n, mix = loop_mix(sass)
    elems = a.block_n * 128 * 2 / (32 * a.num_warps)  # cached K and V elements per thread per tile
    print(f"triton {triton.__version__}: {a.kernel} kernel, {a.block_n} keys per tile, {a.num_warps} warps: "
          f"{n} instructions per tile per thread, {n / elems:.1f} per cached element")
    print(", ".join(f"{k} {v}" for k, v in mix.most_common(20)))


if __name__ == "__main__":
    main()
