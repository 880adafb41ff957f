"""Where a real `docproc run` spends its host time, and what the host was doing while the GPU idled.

Runs the CLI in this process (the same code path as `python3 -m docproc run`; nothing of torch
imported before it) with two probes:
- a sampler thread that reads the main thread's Python stack every --period seconds, from the
  start to the end of the run (imports and the model load included), and
- torch.profiler (CUDA activity only: kernels, copies and runtime calls, no Python tracing) from
  the first engine step to the last, in windows of --window steps (one profile kept a whole run's
  events only in part), whose GPU timeline says when the device had nothing to run. Each window
  ends with two synchronizes that mark its clock and an export (the probe's own pause, between
  steps: idle is counted inside steps only).

Reported: the load stage's and the engine steps' samples by category and by stack (the
innermost frame and the docproc frames above it); the GPU's idle time inside the steps, by step
kind (a decode step or another), by tenth of the run and by gap length, with the host's stacks
during the gaps; the runtime calls that blocked the host (synchronizations and copies over
0.2 ms) with the stack they came from.

    python3 bench/step_trace.py --docs DIR --model DIR --out DIR --json $OUT/trace.json [--run-args="..."]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = (str(ROOT / "docproc"), str(ROOT / "kernels"))


def frame_key(frame, depth: int = 6) -> str:
    """The innermost frame (any file) and up to `depth` of our frames above it, outermost first."""
    inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
    ours = []
    f = frame
    while f is not None and len(ours) < depth:
        path = f.f_code.co_filename
        if path.startswith(OURS) and f is not frame:
            ours.append(f"{Path(path).name}:{f.f_code.co_name}:{f.f_lineno}")
        f = f.f_back
    return " < ".join([inner] + ours)


class StackSampler:
    def __init__(self, thread_id: int, period: float) -> None:
        self.tid, self.period = thread_id, period
        self.samples: list[tuple[float, str]] = []  # (perf_counter, frame key)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self.tid)
            if frame is not None:
                self.samples.append((time.perf_counter(), frame_key(frame)))
            del frame
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> list[str]:
        return [k for t, k in self.samples if t0 <= t < t1]


def top(keys: list[str], n: int, period: float) -> list[dict]:
    return [{"seconds": round(c * period, 3), "share": round(c / max(1, len(keys)), 3), "where": k}
            for k, c in collections.Counter(keys).most_common(n)]


CATEGORIES = (  # (substring of a frame key, category): the first that matches
    ("check_constraints", "constraints checked (xgrammar's import, compiles)"),
    ("allocate_kv", "KV pool, kernel warm-up, graphs"), ("load_model", "weights"),
    ("collect", "waits for the step's tokens"), ("step_inputs.py:array", "waits for the input buffer"),
    ("structured.py", "grammar masks and matchers"), ("matcher.py", "grammar masks and matchers"),
    ("plan_tiles", "attention tile plan"), ("vision.py", "vision tower (launches)"),
    ("vision_fused.py", "vision tower (launches)"), ("graph_runner.py", "graph replay and its inputs"),
    ("qwen2_vl.py", "language model (launches)"), ("step_inputs.py", "step inputs"),
    ("_prepare", "step inputs"), ("scheduler.py", "scheduling"), ("block_manager.py", "scheduling"),
    ("prefetch", "image prefetch"), ("stream.py:add", "admission (tokenize, requests)"),
    ("append_token", "appending tokens"), ("sample_pending", "sampling"), ("streamer.py", "run loop"),
    ("rows.py", "rows and parts"), ("runstore.py", "rows and parts"))


def category(key: str) -> str:
    inner = key.split(" < ")[0]
    if inner.startswith(("loader.py", "safetensors")):
        return "weights"
    for sub, name in CATEGORIES:
        if sub in key:
            return name
    return "other: " + inner


def by_category(keys: list[str], period: float) -> dict:
    c = collections.Counter(category(k) for k in keys)
    return {k: round(v * period, 3) for k, v in c.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-args", default="")
    ap.add_argument("--period", type=float, default=0.001)
    ap.add_argument("--no-trace", action="store_true", help="samples only (no GPU timeline)")
    ap.add_argument("--window", type=int, default=40, help="engine steps per profiler window")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    t_run = time.perf_counter()
    sampler = StackSampler(threading.get_ident(), args.period)  # (before any import of torch)

    import docproc.pipeline.engine_setup as setup_mod

    marks: dict = {"steps": []}  # perf_counter marks: (start, end, decode step, rows running)
    state = {"prof": None}
    engine0 = setup_mod.EngineSetup._engine
    windows: list[dict] = []  # per traced window: its GPU intervals and blocking calls, on perf_counter's clock

    def close_window() -> None:
        """Stop the profiler (a synchronize at a known perf_counter time marks its clock), keep
        the window's GPU intervals and long runtime calls, in seconds on perf_counter's clock."""
        import torch

        t_close = time.perf_counter()
        torch.cuda.synchronize()
        mark = time.perf_counter()
        torch.cuda.synchronize()
        state["prof"].__exit__(None, None, None)
        path = Path(tempfile.mkdtemp()) / "trace.json"
        state["prof"].export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        path.unlink()
        state["prof"] = None
        syncs = [e for e in events if e.get("ph") == "X" and e.get("name") == "cudaDeviceSynchronize"]
        window = {"steps": (state["first_step"], len(marks["steps"])), "gpu": [], "runtime": [], "closed": t_close}
        if syncs:
            offset = syncs[-1]["ts"] - mark * 1e6  # trace us = perf_counter s * 1e6 + offset
            window["gpu"] = [((e["ts"] - offset) / 1e6, (e["ts"] + e.get("dur", 0) - offset) / 1e6) for e in events
                             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            window["runtime"] = [(e.get("name", ""), (e["ts"] - offset) / 1e6, e.get("dur", 0) / 1e6) for e in events
                                 if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e.get("dur", 0) >= 200]
        windows.append(window)
        marks["probe_seconds"] = marks.get("probe_seconds", 0.0) + time.perf_counter() - t_close

    def patch_steps() -> None:
        import torch

        import docproc.engine.llm as llm_mod

        step0 = llm_mod.LLM.step
        if getattr(step0, "_traced", False):
            return

        def step(self):
            if state["prof"] is None and torch.cuda.is_available() and not args.no_trace:
                from torch.profiler import ProfilerActivity, profile

                p = profile(activities=[ProfilerActivity.CUDA])
                p.__enter__()
                state["prof"] = p
                state["first_step"] = len(marks["steps"])
            decodes = self.num_decode_steps
            t0 = time.perf_counter()
            try:
                return step0(self)
            finally:
                marks["steps"].append((t0, time.perf_counter(), self.num_decode_steps > decodes,
                                       len(self.scheduler.running)))
                if state["prof"] is not None and len(marks["steps"]) % args.window == 0:
                    close_window()  # (the profiler's buffer keeps a whole run's events only in part)
        step._traced = True
        llm_mod.LLM.step = step

    def engine(self):
        t0 = time.perf_counter()
        try:
            return engine0(self)
        finally:
            marks.setdefault("load", (t0, time.perf_counter()))
            patch_steps()
    setup_mod.EngineSetup._engine = engine

    from typer.main import get_command

    from docproc.cli import app

    out = args.out or tempfile.mkdtemp()
    argv = ["run", args.docs, "--out", out, "--model", args.model, "--quiet", *shlex.split(args.run_args)]
    try:
        get_command(app).main(args=argv, standalone_mode=False)
    except SystemExit:
        pass
    t_end = time.perf_counter()
    if state["prof"] is not None:
        close_window()
    sampler.stop()
    period = args.period

    report: dict = {"argv": argv, "wall_s": round(t_end - t_run, 2), "num_samples": len(sampler.samples),
                    "period_s": period, "num_steps": len(marks["steps"])}
    if "load" in marks:
        l0, l1 = marks["load"]
        keys = sampler.between(l0, l1)
        report["before_load_s"] = round(l0 - t_run, 2)
        report["before_load"] = top(sampler.between(t_run, l0), 15, period)
        report["load"] = {"seconds": round(l1 - l0, 2), "by_category": by_category(keys, period),
                          "top": top(keys, 50, period)}
    steps = marks["steps"]
    if steps:
        in_steps = [k for a, b, *_ in steps for k in sampler.between(a, b)]
        report["steps"] = {"seconds": round(sum(b - a for a, b, *_ in steps), 2),
                           "span_s": round(steps[-1][1] - steps[0][0], 2),
                           "by_category": by_category(in_steps, period), "top": top(in_steps, 50, period)}
        outside = [k for (_, a1, *_), (b0, *_) in zip(steps, steps[1:]) for k in sampler.between(a1, b0)]
        report["between_steps"] = {"seconds": round(sum(b[0] - a[1] for a, b in zip(steps, steps[1:])), 2),
                                   "by_category": by_category(outside, period), "top": top(outside, 20, period)}
    if windows:
        report["gpu"] = analyse(windows, marks, sampler, period)
        report["gpu"]["probe_seconds"] = round(marks.get("probe_seconds", 0.0), 2)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k in ("wall_s", "num_steps", "before_load_s")}))
    for part in ("load", "steps", "between_steps"):
        if part in report:
            print(f"== {part}: {report[part]['seconds']} s", json.dumps(report[part]["by_category"]))
            for row in report[part]["top"][:20]:
                print(f"  {row['seconds']:8.3f} {row['share']:.3f}  {row['where'][:220]}")
    if "gpu" in report:
        g = report["gpu"]
        print("== gpu:", json.dumps({k: v for k, v in g.items() if k not in ("gap_stacks", "blocking")}))
        for row in g["gap_stacks"][:20]:
            print(f"  {row['seconds']:8.3f} {row['share']:.3f}  {row['where'][:220]}")
        print("== blocking runtime calls")
        for row in g["blocking"][:15]:
            print(f"  {row}")


LOST_SHARE = 0.05


def analyse(windows: list[dict], marks: dict, sampler: StackSampler, period: float) -> dict:
    """The GPU's idle time inside each engine step (from the step's call to its return: the probe's
    own pauses between steps are left out), by step kind and by tenth of the run, the gaps'
    lengths and the host's stacks during them, and the runtime calls that blocked the host."""
    gpu = sorted(iv for w in windows for iv in w["gpu"])
    merged: list[list[float]] = []
    for a, b in gpu:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    steps = marks["steps"]
    # A window whose trace holds GPU events for under LOST_SHARE of its steps' time lost them
    # (two 7B e2e traces each had one window of 40 eager steps at 0.4-2%, the others at 58-98%;
    # the profiler's export comes back nearly empty at times): its steps are left out of the idle
    # figures rather than counted as idle, and the windows' shares are reported.
    shares = []
    for w in windows:
        idx = range(*w["steps"])
        span = sum(steps[i][1] - steps[i][0] for i in idx)
        busy = sum(min(b, steps[i][1]) - max(a, steps[i][0]) for i in idx for a, b in w["gpu"]
                   if a < steps[i][1] and b > steps[i][0])
        w["lost"] = not w["gpu"] or (span > 0 and busy / span < LOST_SHARE)
        shares.append({"steps": list(w["steps"]), "wall_s": round(span, 3),
                       "gpu_events_share": round(busy / span, 3) if span else None, "lost": w["lost"]})
    lost = {i for w in windows if w["lost"] for i in range(*w["steps"])}
    idle_step = [0.0] * len(steps)
    j = 0
    for i, (w0, w1, *_) in enumerate(steps):
        covered = 0.0
        while j < len(merged) and merged[j][1] <= w0:
            j += 1
        k = j
        while k < len(merged) and merged[k][0] < w1:
            covered += min(w1, merged[k][1]) - max(w0, merged[k][0])
            k += 1
        idle_step[i] = w1 - w0 - covered
    kinds = collections.defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [steps, wall s, idle s]
    tenths = [[0, 0.0, 0.0] for _ in range(10)]
    for i, (a, b, decode, rows) in enumerate(steps):
        if i in lost:
            continue
        kind = "decode" if decode else "other"
        kinds[kind][0] += 1
        kinds[kind][1] += b - a
        kinds[kind][2] += idle_step[i]
        t = min(9, int(10 * i / len(steps)))
        tenths[t][0] += 1
        tenths[t][1] += b - a
        tenths[t][2] += idle_step[i]
    gaps = []
    for (_, a1), (b0, _) in zip(merged, merged[1:]):
        if b0 - a1 > 20e-6:
            gaps.append((a1, b0))
    in_steps = []  # the gaps' parts inside a step
    j = 0
    for a, b in gaps:
        while j < len(steps) and steps[j][1] <= a:
            j += 1
        if j < len(steps) and steps[j][0] < b and j not in lost:
            in_steps.append((max(a, steps[j][0]), min(b, steps[j][1])))
    hist = collections.Counter()
    for a, b in in_steps:
        d = b - a
        hist["<0.1ms" if d < 1e-4 else "<1ms" if d < 1e-3 else "<5ms" if d < 5e-3 else ">=5ms"] += d
    keys = [k for a, b in in_steps for k in sampler.between(a, b)]
    blocking = collections.Counter()
    for w in windows:
        for name, t, dur in w["runtime"]:
            if not any(x in name for x in ("Synchronize", "Memcpy", "Malloc", "Free", "Query")):
                continue
            mid = t + dur / 2
            near = [k for ts, k in sampler.samples if abs(ts - mid) <= max(dur / 2, period)]
            blocking[(name, near[0] if near else "?")] += dur
    wall = sum(b - a for i, (a, b, *_) in enumerate(steps) if i not in lost)
    idle = sum(v for i, v in enumerate(idle_step) if i not in lost)
    return {"windows": shares, "windows_lost": sum(w["lost"] for w in windows), "steps_lost": len(lost),
            "steps_lost_wall_s": round(sum(b - a for i, (a, b, *_) in enumerate(steps) if i in lost), 3),
            "steps_wall_s": round(wall, 3), "idle_in_steps_s": round(idle, 3),
            "idle_share_in_steps": round(idle / wall, 4) if wall else None, "num_gaps": len(in_steps),
            "idle_s_by_gap_length": {k: round(v, 3) for k, v in hist.items()},
            "by_step_kind": {k: {"steps": v[0], "wall_s": round(v[1], 3), "idle_s": round(v[2], 3)}
                             for k, v in kinds.items()},
            "by_tenth_of_steps": [{"steps": n, "wall_s": round(w_, 3), "idle_s": round(i_, 3)}
                                  for n, w_, i_ in tenths],
            "gap_by_category": by_category(keys, period),
            "gap_stacks": top(keys, 40, period),
            "blocking": [{"seconds": round(v, 4), "call": n, "where": w} for (n, w), v in blocking.most_common(30)]}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
