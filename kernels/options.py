"""The kernel choices of one engine, handed down to its model and attention backend (never held
by the kernels' modules, so that two engines in one process each keep their own)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    # one-row weight products of batch-1 decode through kernels/gemv.py and kernels/fp8.py (else
    # cuBLAS), and the few-row FP8 products and fused SiLU x up with them
    one_row: bool = True
    # programmatic dependent launch on sm_90 and later (kernels/pdl.py)
    pdl: bool = True
    # FP4 decode tiles through the Gluon kernel (kernels/fp4_gluon.py) where it can run (else the
    # Triton one)
    fp4_gluon: bool = True
    # answers that do not depend on the batch: every language-model product through
    # kernels/matmul.py (one tile shape for any row count, FP8 weights dequantized in it) and every
    # attention plan in its invariant shape (kernels/attention_plan.py), so a row's bits follow from
    # its own sequence alone; the one-row, few-row and FP8 tensor-core paths and the Gluon kernel are
    # not taken
    batch_invariant: bool = False


DEFAULT = KernelOptions()
