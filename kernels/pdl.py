"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

Why: a batch-1 decode step is ~9 kernels per layer (norm, qkv, rotary + store, attention, merge,
o, norm, gate|up, down), each a few microseconds; inside a CUDA graph every boundary still costs
the next kernel's launch and ramp while the GPU drains (a 7B profile: the
products read at 0.97 of the copy bandwidth, yet the step is 1.21x the roofline; at 2B, 2.1x).
With PDL a kernel launched with `launch_pdl=True` may start while the kernel before it in the
stream still runs, once that one's programs have all called `launch_dependents` (they do so on
entry). It then does the work that depends on nothing the earlier kernels write (the one-row
products load their first weight tile) and waits in `wait` until the kernel before it has
completed and its writes are visible.

Rules every kernel launched this way keeps (what makes it safe):
- `wait` comes before its first load of anything an earlier kernel writes and before its first
  store (an earlier kernel may still read the memory it writes);
- every program calls `wait`, unconditionally, so that a kernel completes only after the kernel
  before it did: the chain's ordering stays transitive for kernels further back (a torch kernel,
  an FP4 store) that the next one's wait does not see directly;
- only weights (never written during a step) are read before `wait`.
Kernels launched without the flag keep plain stream order (they start after the previous kernel
completes), so mixing the two is safe.

On by default on sm_90+; the engine's `pdl=False` (EngineConfig, handed to the launches as
KernelOptions.pdl, kernels/options.py) turns it off: every kernel then launches as before and
`wait` compiles out. Interpreter and CPU runs never
use it: the flag is a compile-time argument (PDL) of each kernel. The paged attention kernel and
its merge let the next kernel launch on entry; the other call sites choose start or end (after
their main loop) by what measured faster.

Status (H200): +8.0% and +8.8% tokens/s at the 2B geometry's batch-1 decode (the draft's size),
-0.1% to -2.0% at 7B (noise level); BENCHMARKS.md. A kernel benchmark replaying attention and merge
back to back shows PDL's waits only (small-batch cells up to 4.4 us slower there).
tests/test_pdl.py checks on the CPU, in the compiled PTX, that the wait precedes every load of an
activation on every path, and on a GPU that outputs equal those without PDL.
"""
from __future__ import annotations

import functools

import torch
from kernels._triton import gdc_launch_dependents, gdc_wait, interpreting, tl, triton

@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(t: torch.Tensor, on: bool = True) -> bool:
    """Whether kernels working on t's device launch with PDL: asked for (on: the engine's
    KernelOptions.pdl), CUDA, sm_90 or later."""
    return enabled_on(t.device, on)


def enabled_on(device: torch.device, on: bool = True) -> bool:
    """enabled() for a device."""
    device = torch.device(device)
    if not on or device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch(t: torch.Tensor, early: bool = True, on: bool = True) -> dict:
    """Extra launch arguments for a kernel taking a PDL constexpr: PDL = 1 (let the next kernel
    launch on entry: `start`) or 2 (after the main loop: `end`) with launch_pdl where
    enabled(t, on); PDL = 0 (plain launch, no wait compiled in) otherwise."""
    if not enabled(t, on):
        return {"PDL": 0}
    return {"PDL": 1 if early else 2, "launch_pdl": True}


def attention_launch(t: torch.Tensor, on: bool = True) -> dict:
    """launch() for the paged attention kernel and its merge: the next kernel may launch on entry
    (on the H200 faster than after the main loop, or than plain launches, at 2B and 7B)."""
    return launch(t, early=True, on=on)


@triton.jit
def start(PDL: tl.constexpr):
    """On entry of a PDL kernel: with PDL = 1, let the next kernel's programs launch (they wait in
    `wait` until this kernel completes, so nothing they depend on is read early)."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def end(PDL: tl.constexpr):
    """After a PDL kernel's main loop: with PDL = 2, let the next kernel's programs launch (its
    launch and first loads then overlap only this kernel's last stores, not its whole run)."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one in the stream has completed and its writes are
    visible (see the module's rules)."""
    if PDL != 0:
        gdc_wait()
