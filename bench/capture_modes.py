"""Probe: does another thread's pinned-memory allocation invalidate a CUDA graph capture?

Captures a small graph (a chain of matmuls, cuBLAS set up first) many times while a second thread
allocates pinned host memory in a loop, and counts the captures that fail; each capture error mode
in a process of its own (a failed capture can leave the context unusable). Global mode is
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


def trial(mode: str, captures: int) -> dict:
    x = torch.randn(256, 256).cuda() / 16  # (made on the host: no CUDA RNG state involved)
    (x @ x).sum().item()  # cuBLAS's handle and workspace exist before any capture
    stop = threading.Event()

    def pin():
        while not stop.is_set():
            torch.empty(1 << 18).pin_memory()

    worker = threading.Thread(target=pin, daemon=True)
    worker.start()
    failed, errors = 0, set()
    try:
        for _ in range(captures):
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
    return {"mode": mode, "captures": captures, "failed": failed, "errors": sorted(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--captures", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # one trial, in this process
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(trial(a.mode, a.captures)))
        return
    trials = []
    for mode in ("thread_local", "global"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--captures", str(a.captures)],
                              capture_output=True, text=True)
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
