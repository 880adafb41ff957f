"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

Why: a batch-1 decode step is ~9 kernels per layer (norm, qkv, rotary + store, attention, merge,
o, norm, gate|up, down), each a few microseconds; inside a CUDA graph every boundary still costs
the next kernel's launch and ramp while the GPU drains (the fifteenth session's 7B profile: the
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

On by default on sm_90+; `DOCPROC_PDL=0` turns it off: every kernel then launches as before and
`wait` compiles out.
Interpreter and CPU runs never use it: the flag is a compile-time argument (PDL) of each kernel.

Status (H200): +8.0% and +8.8% tokens/s at the 2B geometry's batch-1 decode (the draft's size;
sixteenth and seventeenth sessions), -0.1%, 0.0% and -2.0% at 7B (three paired runs: noise level).
The attention kernel and its merge (ATTENTION, nineteenth session, part a): at 2B 674.4 tokens/s
with the default "start", 669.5 "off", 629.0 "end" (616.8 with PDL off everywhere); at 7B 235.6,
239.1, 234.1 (239.4). A kernel benchmark replaying attention and merge back to back
(bench_kernels) shows PDL's waits only: there the small-batch cells are up to 4.4 us slower with it.
The final code (each kernel's wait ahead of its loop, the 7B down projection's later trigger)
passed the GPU tests (tests/test_pdl.py, tests/test_gemv.py, tests/test_graph_runner.py) on the
H200 in the seventeenth session, so it is on by default. An earlier form that waited inside a
loop's first iteration read stale inputs on the H200; tests/test_pdl.py checks on the CPU, in the
compiled PTX, that the wait precedes every load of an activation on every path.
"""
from __future__ import annotations

import functools
import os

import torch
from kernels._triton import gdc_launch_dependents, gdc_wait, tl, triton

# On unless DOCPROC_PDL=0: see "Status" in the module docstring.
ENABLED = os.environ.get("DOCPROC_PDL", "1") != "0"
# where a kernel lets the next one launch: "start" (on entry), "end" (after its main loop, before
# its stores), or "" for each call site's own choice (launch(early=...)); a knob for measurements
TRIGGER = os.environ.get("DOCPROC_PDL_TRIGGER", "")
# the paged attention kernel and its merge (kernels/paged_attention.py): "start" (PDL, the next
# kernel may launch on entry), "end" (after the main loop) or "off" (plain launches, stream order),
# whatever the other kernels do; a knob for measurements (bench_engine part a times all three)
ATTENTION = os.environ.get("DOCPROC_PDL_ATTENTION", "start")


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on t's device launch with PDL: CUDA, sm_90 or later, not turned off."""
    return enabled_on(t.device)


def enabled_on(device: torch.device) -> bool:
    """enabled() for a device."""
    device = torch.device(device)
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch(t: torch.Tensor, early: bool = True) -> dict:
    """Extra launch arguments for a kernel taking a PDL constexpr: PDL = 1 (let the next kernel
    launch on entry: `start`) or 2 (after the main loop: `end`) with launch_pdl where enabled(t);
    PDL = 0 (plain launch, no wait compiled in) otherwise."""
    if not enabled(t):
        return {"PDL": 0}
    if TRIGGER:
        early = TRIGGER == "start"
    return {"PDL": 1 if early else 2, "launch_pdl": True}


def attention_launch(t: torch.Tensor) -> dict:
    """launch() for the paged attention kernel and its merge, as ATTENTION says (a set
    DOCPROC_PDL_TRIGGER still decides between start and end, as for every kernel)."""
    assert ATTENTION in ("start", "end", "off"), f"DOCPROC_PDL_ATTENTION={ATTENTION!r}: start, end or off"
    if ATTENTION == "off":
        return {"PDL": 0}
    return launch(t, early=ATTENTION == "start")


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
