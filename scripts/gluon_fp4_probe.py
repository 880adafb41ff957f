"""Compile-only SASS report for the Gluon FP4 decode (issue #5), for sm_90, without a GPU: the
numbers are instruction counts, not times.

    python scripts/gluon_fp4_probe.py --kernel [--json]   # kernels/fp4_gluon.py's kernel
    python scripts/gluon_fp4_probe.py                       # the nineteenth session's probe (below)
    PYTHONPATH=/tmp/t36 python scripts/gluon_fp4_probe.py   # Triton 3.6 (the device's) unpacked there

--kernel compiles kernels/fp4_gluon._fp4_decode_kernel at the 7B geometry (GROUP 7, split, block
size 16 unless --block-size, 2 key slots unless --key-slots) and reports its key loop: instructions, the opcode mix,
shared-memory operations (the design has none in the loop), registers. tests/test_kernels.py runs it.

The probe:
What it computes: scores = q K^T for one KV head's 128-key tile of an FP4 cache (the kernels/fp4.py
format without outlier slots): codes loaded from global memory in the operand layout (2-byte loads:
the layout pairs two consecutive dims of one key), decoded by the word PTX of kernels/paged_attention.py
(scale left out, x 2^118 folded into the bf16x2 FMA), one m16n8k16 MMA per group of 16 dims, and each
group's E4M3 scale applied to its partial scores afterwards (a group is exactly one MMA k-block, so
the scale is per (key, group) of the accumulator). It is a measurement of the layout, not a kernel:
q is reloaded per group (L1 hits), scales are byte loads, there is no softmax, no values and no
outliers. Written in the nineteenth session; see BENCHMARKS.md there.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sass import loop_mix  # noqa: E402


def _decode_ptx() -> str:
    # one 32-bit word of 4 code bytes in; 4 bf16 of the low nibbles ($0, $1) and 4 of the high ($2, $3)
    # out, each code value x 2^-8 (x 2^-126 from the bit placement, x 2^118 by one bf16x2 FMA)
    lines = ["{", ".reg .b32 t01, t23, x, z, k;", "mov.b32 z, 0x80008000;", "mov.b32 k, 0x7A807A80;",
             "prmt.b32 t01, $4, 0, 0x4140;", "prmt.b32 t23, $4, 0, 0x4342;"]
    for out, src, mask, mul in (("$0", "t01", "0x000F000F", "0x1040"), ("$1", "t23", "0x000F000F", "0x1040"),
                                ("$2", "t01", "0x00F000F0", "0x104"), ("$3", "t23", "0x00F000F0", "0x104")):
        lines += [f"and.b32 x, {src}, {mask};", f"mul.lo.u32 x, x, {mul};", "and.b32 x, x, 0x81C081C0;",
                  f"fma.rn.bf16x2 {out}, x, k, z;"]
    return "\n".join(lines + ["}"])


DECODE = gl.constexpr(_decode_ptx())


@gluon.jit
def probe(q_ptr, codes_ptr, scales_ptr, out_ptr, n_keys, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    GH: gl.constexpr = HALF // 16
    # q per group of 16 dims, lo and hi halves, in the A-operand layout
    rq = gl.arange(0, 16, layout=gl.SliceLayout(1, A_L))
    dq = gl.arange(0, 16, layout=gl.SliceLayout(0, A_L))
    dk = gl.arange(0, 16, layout=gl.SliceLayout(1, B_L))
    nk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, B_L))
    ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    s = gl.full([16, BLOCK_N], 0.0, gl.float32, layout=MMA)
    zero = gl.full([16, BLOCK_N], 0.0, gl.float32, layout=MMA)
    for n0 in range(0, n_keys, BLOCK_N):
        for g in gl.static_range(GH):
            q_lo = gl.load(q_ptr + gl.expand_dims(rq, 1) * (2 * HALF) + g * 16 + gl.expand_dims(dq, 0))
            q_hi = gl.load(q_ptr + gl.expand_dims(rq, 1) * (2 * HALF) + HALF + g * 16 + gl.expand_dims(dq, 0))
            c = gl.load(codes_ptr + g * 16 + gl.expand_dims(dk, 1) + gl.expand_dims(n0 + nk, 0) * HALF)
            k_lo, k_hi = gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r", [c], dtype=(gl.bfloat16, gl.bfloat16),
                                                   is_pure=True, pack=4)
            e_lo = gl.load(scales_ptr + (n0 + ns) * (2 * GH) + g).to(gl.int32)
            e_hi = gl.load(scales_ptr + (n0 + ns) * (2 * GH) + GH + g).to(gl.int32)
            sc_lo = (e_lo << 20).to(gl.float32, bitcast=True)
            sc_hi = (e_hi << 20).to(gl.float32, bitcast=True)
            s += mma_v2(q_lo, k_lo, zero) * gl.expand_dims(sc_lo, 0)
            s += mma_v2(q_hi, k_hi, zero) * gl.expand_dims(sc_hi, 0)
    ro = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    gl.store(out_ptr + gl.expand_dims(ro, 1) * BLOCK_N + gl.expand_dims(ns, 0), s)


def kernel_report(key_slots: int = 2, group: int = 7, block_size: int = 16) -> dict:
    """kernels/fp4_gluon.py's kernel compiled for sm_90: its key loop's SASS mix and resources."""
    import inspect

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kernels import fp4_gluon as g

    from kernels.fp4 import FP4PagedLayer

    layer = FP4PagedLayer(2, block_size, 4, 128, "cpu", num_outliers=key_slots)  # 7B: 4 KV heads
    geometry = g.page_geometry(layer.kernel_views("k"), layer.kernel_views("v"))
    names = list(inspect.signature(g._fp4_decode_kernel.fn).parameters)
    fp = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
          "khs_ptr": "*fp32", "vhs_ptr": "*fp32"}
    sig = {}
    for n in names:
        if n.endswith("_ptr"):
            sig[n] = fp.get(n, "*i32" if n.startswith(("tile", "table")) else "*u8")
        elif n.isupper():
            sig[n] = "constexpr"
        else:
            sig[n] = "fp32" if n == "sm_scale_log2" else "i32"
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr")]
    src = GluonASTSource(g._fp4_decode_kernel, sig,
                         constexprs={"GROUP": group, "SPLIT": True, "BS_LOG2": block_size.bit_length() - 1, "NUM_OUTLIERS": key_slots,
                                     **geometry},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    n_loop, mix = loop_mix(sass)
    regs = re.search(r"REG:(\d+)", res)
    return {"triton": triton.__version__, "key_slots": key_slots, "loop_instructions": n_loop,
            "loop_shared": sum(v for op, v in mix.items() if op.startswith(("STS", "LDS", "BAR", "LDSM"))),
            "loop_spills": sum(v for op, v in mix.items() if op.startswith(("STL", "LDL"))),
            "registers": int(regs.group(1)) if regs else None, "mix": dict(mix.most_common())}


def main():
    if "--kernel" in sys.argv:
        import json

        slots = int(sys.argv[sys.argv.index("--key-slots") + 1]) if "--key-slots" in sys.argv else 2
        bs = int(sys.argv[sys.argv.index("--block-size") + 1]) if "--block-size" in sys.argv else 16
        rep = kernel_report(slots, block_size=bs)
        if "--json" in sys.argv:
            print(json.dumps(rep))
        else:
            print(f"triton {rep['triton']}, {slots} key slots: {rep['loop_instructions']} SASS instructions in the "
                  f"128-key loop (per thread, 4 warps), {rep['loop_shared']} shared-memory operations, "
                  f"{rep['registers']} registers")
            print(", ".join(f"{op} {v}" for op, v in list(rep["mix"].items())[:24]))
        return
    sig = {"q_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*fp32", "n_keys": "i32",
           "BLOCK_N": "constexpr", "HALF": "constexpr"}
    src = GluonASTSource(probe, sig, constexprs={"BLOCK_N": 128, "HALF": 64},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ops = collections.Counter(re.findall(r"\*/\s+(?:@!?P\d+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    shared = sum(v for op, v in ops.items() if op.startswith(("STS", "LDS", "BAR")))
    n_loop, _ = loop_mix(sass)
    print(f"triton {triton.__version__}: {sum(ops.values())} SASS instructions in the kernel, {n_loop} in the "
          f"128-key loop (per thread, 4 warps), {shared} shared-memory loads, stores and barriers")
    print(", ".join(f"{op} {v}" for op, v in ops.most_common(20)))


if __name__ == "__main__":
    main()
