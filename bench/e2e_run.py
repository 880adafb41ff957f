"""A whole `docproc run` as a user runs it, timed from outside: fresh synthetic documents
(tests/fixtures/documents.py), a random-weight checkpoint of a named geometry (written to disk, or
config only with --load-format dummy), the real CLI in a subprocess, the GPU sampled meanwhile.

    python3 bench/e2e_run.py --docs 240 --geometry 7b --trees .,.base --runs cold,warm --json $OUT/e2e.json
    python3 bench/e2e_run.py --docs 240 --geometry 72b --load-format dummy --run-args="--quantization fp8" ...
    python3 bench/e2e_run.py --corpus .docs/soak --geometry 2b --trees .,.base --runs warm --json $OUT/e2e.json

--trees: code trees run side by side (PYTHONPATH=tree), each over the same corpus and model, in
turn per round (--runs: cold clears Triton's and the engine's caches first, warm keeps them).
Reported per run: wall seconds, documents/s and pages/s of the whole run, the manifest's stages
and stage timeline, engine busy time (the GPU's utilisation sampled every 50 ms: the time a
kernel ran), wall / (model load + busy), GPU idle share between the first request and the last
answer, the host's max RSS (the run's process and its children, sampled), documents/day per GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


class Sampler:
    """GPU utilisation (NVML) and the process tree's RSS (psutil), every `period` seconds."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid, self.period = pid, period
        self.gpu: list[tuple[float, int]] = []  # (time.time(), utilisation %)
        self.rss_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:  # (this machine: no RSS figures)
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 -- no GPU: RSS only
            handle = None
        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            if handle is not None:
                self.gpu.append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                self.rss_max = max(self.rss_max, rss)
            except psutil.Error:
                pass
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, start: float, end: float) -> tuple[float, float]:
        """Seconds a kernel ran between start and end (time.time()), and the span sampled."""
        pts = [(t, u) for t, u in self.gpu if start <= t <= end]
        if len(pts) < 2:
            return 0.0, 0.0
        busy = sum((t1 - t0) * u0 / 100 for (t0, u0), (t1, _) in zip(pts, pts[1:]))
        return busy, pts[-1][0] - pts[0][0]


def answers_digest(out: Path) -> str | None:
    """SHA-256 over every row's (path, query, page, status, answer), sorted: equal between trees
    that answer alike."""
    import hashlib

    import pyarrow.parquet as pq

    rows = []
    for part in sorted(out.rglob("*.parquet")):
        t = pq.read_table(part).to_pylist()  # (a tree's tables may lack later columns: page)
        rows += [json.dumps([r["path"], r["query"], r.get("page"), r["status"], r["answer"]]) for r in t]
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16] if rows else None


def run_once(tree: Path, docs: Path, model: Path, out: Path, run_args: list[str], cold: bool) -> dict:
    if cold:
        for cache in (Path.home() / ".triton" / "cache", Path.home() / ".cache" / "docproc"):
            shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                        .split(os.pathsep) if p])}
    cmd = [sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--model", str(model), "--quiet",
           *run_args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.time() - t0
    sampler.stop()
    runs = sorted((out / "runs").iterdir()) if (out / "runs").is_dir() else []
    if not runs:
        return {"exit_code": proc.returncode, "stderr": stderr[-2000:]}
    m = json.loads((runs[-1] / "manifest.json").read_text())
    started = datetime.fromisoformat(m["started_at"]).timestamp()
    busy, sampled = sampler.busy(t0, t0 + wall)
    result = {"exit_code": proc.returncode, "wall_s": round(wall, 2), "documents": m["totals"]["documents"],
              "pages": m["totals"]["pages"], "docs_per_s": round(m["totals"]["documents"] / wall, 3),
              "pages_per_s": round(m["totals"]["pages"] / wall, 3),
              "docs_per_day_per_gpu": round(m["totals"]["documents"] / wall * 86400),
              "stage_seconds": m["stage_seconds"], "stage_timeline": m.get("stage_timeline"),
              "gpu_busy_s": round(busy, 2), "gpu_sampled_s": round(sampled, 2),
              "host_max_rss_bytes_tree": sampler.rss_max,
              "manifest_host_max_rss_bytes": m["peak_memory"]["host_max_rss_bytes"],
              "gpu_alloc_retries": m["peak_memory"].get("gpu_alloc_retries"),
              "kernel_compiles_after_warmup": (m.get("engine") or {}).get("kernel_compiles_after_warmup"),
              "engine_steps": {k: (m.get("engine") or {}).get(k) for k in (
                  "num_steps", "num_step_tokens", "mean_running_per_step", "step_seconds", "num_decode_steps",
                  "decode_step_seconds", "num_overlapped_steps", "num_graph_steps", "images_prefetched",
                  "images_preprocessed_inline", "pixel_wait_seconds")},
              "engine_start": {k: (m.get("engine") or {}).get(k) for k in (
                  "load_seconds", "kernel_warmup_seconds", "num_cuda_graphs", "cuda_graph_capture_seconds")},
              "stderr": stderr[-1500:] if proc.returncode not in (0, 1) else ""}
    result["model"] = {k: v for k, v in (m.get("model") or {}).items() if k != "path"}
    result["answers_digest"] = answers_digest(out)
    # the process's time before the run's clock started (interpreter, imports, arguments) and after
    # its manifest's last second (interpreter and CUDA teardown, worker exits)
    result["before_run_s"] = round(started - t0, 2)
    result["after_run_s"] = round(t0 + wall - (started + m["seconds"]), 2)
    load = m["stage_seconds"].get("load_model", 0.0)
    result["wall_over_load_plus_busy"] = round(wall / (load + busy), 3) if load + busy else None
    engine = (m.get("stage_timeline") or {}).get("engine")
    if engine:  # the first request to the last answer, on the manifest's clock
        e_busy, e_span = sampler.busy(started + engine[0], started + engine[1])
        result["engine_span_s"] = round(e_span, 2)
        result["gpu_idle_share_in_engine_span"] = round(1 - e_busy / e_span, 4) if e_span else None
        steps = (m.get("engine") or {}).get("step_seconds")
        if steps is not None:  # the engine span's time outside LLM.step (the feed, rows, writing parts)
            result["engine_span_outside_steps_s"] = round(engine[1] - engine[0] - steps, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=240)
    ap.add_argument("--seed", type=int, default=4900)
    ap.add_argument("--formats", default="pdf")
    ap.add_argument("--corpus", default=None,
                    help="a folder of documents to run instead of generating --docs of them (made where pymupdf "
                         "is, e.g. `python3 scripts/gpu_soak.py --make-docs DIR --count N` for scans)")
    ap.add_argument("--geometry", default="7b")
    ap.add_argument("--draft-geometry", default=None, help="a draft model of this geometry (--draft)")
    ap.add_argument("--load-format", default="auto", help="dummy: config only, random weights at load "
                                                          "(a tree's CLI must take --load-format)")
    ap.add_argument("--trees", default=".", help="code trees, comma-separated, run in turn")
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--run-args", default="", help="more `docproc run` options, one string")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from fixtures.checkpoints import make_model

    work = Path(args.work or tempfile.mkdtemp(prefix="e2e-")).resolve()
    docs = work / f"docs-{args.seed}-{args.docs}"
    if args.corpus:
        docs = Path(args.corpus).resolve()
        args.docs = sum(1 for p in docs.iterdir() if p.is_file() and p.name != "truth.jsonl")
    elif not docs.exists():
        from fixtures.documents import generate  # (pymupdf draws them)

        generate(docs, count=args.docs, seed=args.seed, formats=args.formats.split(","))
        (docs / "truth.jsonl").unlink(missing_ok=True)
    def folder(geometry: str, seed: int) -> Path:
        path = work / f"model-{geometry}-{args.load_format}-{seed}"
        if not path.exists():
            t0 = time.time()
            import torch

            make_model(path, geometry=geometry, dtype=torch.bfloat16, init_std=None, naming="published", seed=seed,
                       device="cuda" if torch.cuda.is_available() else "cpu", max_pixels=28 * 28 * 1280,
                       weights=args.load_format != "dummy")
            print(f"{geometry} model written in {time.time() - t0:.1f} s", flush=True)
            if torch.cuda.is_available():  # (this process's cached blocks would be missing from the run's)
                import gc

                gc.collect()
                torch.cuda.empty_cache()
        return path

    model = folder(args.geometry, 0)
    run_args = args.run_args.split() + (["--load-format", "dummy"] if args.load_format == "dummy" else [])
    if args.draft_geometry:
        run_args += ["--draft", str(folder(args.draft_geometry, 1))]
    report = {"docs": args.docs, "seed": args.seed, "geometry": args.geometry, "load_format": args.load_format,
              "run_args": run_args, "runs": []}
    for kind in filter(None, args.runs.split(",")):  # (--runs "": corpus and model only)
        for tree in args.trees.split(","):
            r = run_once(Path(tree).resolve(), docs, model, work / "out", run_args, cold=kind == "cold")
            r.update(tree=tree, kind=kind)
            report["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("stage_timeline", "stderr")}), flush=True)
            if r.get("stderr"):
                print(r["stderr"], flush=True)
            Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
