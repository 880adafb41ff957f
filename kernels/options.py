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


DEFAULT = KernelOptions()
