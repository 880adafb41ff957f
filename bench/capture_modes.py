"""Probe: does another thread's pinned-memory allocation invalidate a CUDA graph capture?

Captures a small graph (a chain of matmuls, cuBLAS set up first) many times while a second thread
allocates pinned host memory in a loop, and counts the captures that fail; each capture error mode
in a process of its own (a failed capture can leave the context unusable); with and without the
main thread copying pinned tensors to the device and freeing them between captures (what leaves
the host allocator events to query). Global mode is
torch.cuda.graph's default; thread_local is what the engine's graph runner uses.

    python bench/capture_modes.py --captures 200 --json out.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

import torch


def trial(mode: str, captures: int, copies: bool) -> dict:
    x = torch.randn(256, 256).cuda() / 16  # (made on the host: no CUDA RNG state involved)
    (x @ x).sum().item()  # cuBLAS's handle and workspace exist before any capture
    stop = threading.Event()

    def pin():
        # as the image prefetcher does: pages of several sizes, pinned and held a while
        held, n = [], 0
        while not stop.is_set():
            n += 1
            held.append(torch.empty((1 << 16) * (1 + n % 7)).pin_memory())
            if len(held) > 4:
                held.pop(0)

    worker = threading.Thread(target=pin, daemon=True)
    worker.start()
    failed, errors = 0, set()
    try:
        for _ in range(captures):
            if copies:
                # as the engine does with taken pixels: a pinned tensor copied to the device without
                # blocking, then freed (the host allocator records an event, queried later by
                # whichever thread allocates next)
                p = torch.empty(1 << 18).pin_memory()
                p.to("cuda", non_blocking=True)
                del p
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, capture_error_mode=mode):
                    y = x
                    for _ in range(20):
                        y = y @ x
            except RuntimeError as e:
                failed += 1
                errors.add(str(e).splitlines()[0][:160])
                torch.cuda.synchronize()
    finally:
        stop.set()
        worker.join()
    return {"mode": mode, "copies": copies, "captures": captures, "failed": failed, "errors": sorted(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--captures", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # one trial, in this process
    ap.add_argument("--copies", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(trial(a.mode, a.captures, a.copies)))
        return
    trials = []
    for mode, copies in (("thread_local", False), ("global", False), ("thread_local", True), ("global", True)):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--captures", str(a.captures)]
                              + (["--copies"] if copies else []), capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        trials.append(json.loads(lines[-1]) if proc.returncode == 0 and lines else
                      {"mode": mode, "returncode": proc.returncode, "stderr": proc.stderr[-800:]})
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trials": trials}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
