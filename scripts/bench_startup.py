"""Start-up on the GPU: seconds from a fresh process to an engine ready to decode, cold and warm.

Cold: Triton's kernel cache empty (a new TRITON_CACHE_DIR) and the model's files dropped from the
page cache (posix_fadvise DONTNEED after an fsync). Warm: the same again right after, the cache and
the files as the cold run left them. Each measurement is its own process: CUDA's start, the
imports, `LLM(...)` (weights read and copied, the fingerprint hashed, kernels warmed), then one
request with a page (the vision tower's and the first step's graph captures) reported apart.

Cases: `bundled` (the bundled target and draft, as `docproc run` loads them), `7b` (a Qwen2-VL-7B
geometry bf16 checkpoint of random weights, written to local disk first: 15 GB) and `qwen3-8b` (the
same at Qwen3-VL-8B geometry: 17.5 GB).

    python3 scripts/bench_startup.py --json startup.json [--cases bundled,7b] [--work /tmp/docproc-startup]
        [--profile profile.txt]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]


def child(model: str, draft: str | None, device: str, profile: str | None = None) -> dict:
    """One start-up, in this process (called as `--child`). With `profile`, `LLM(...)` runs under
    cProfile: its 40 largest cumulative entries and every subprocess it started go to that file."""
    import torch

    sys.path.insert(0, str(ROOT))
    from PIL import Image

    from docproc import LLM, SamplingParams
    from docproc.pipeline.queries import build_prompt

    t_import = time.perf_counter() - T0
    torch.zeros(1, device=device)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    t_cuda = time.perf_counter() - T0 - t_import
    spawned: list[str] = []
    if profile:
        import cProfile

        real_init = subprocess.Popen.__init__

        def logged_init(self, args, *rest, **kw):
            spawned.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
            real_init(self, args, *rest, **kw)

        subprocess.Popen.__init__ = logged_init
        prof = cProfile.Profile()
        prof.enable()
    t1 = time.perf_counter()
    llm = LLM(model, device=device, **({"speculative_model": draft, "num_speculative_tokens": "auto"} if draft else {}))
    t_llm = time.perf_counter() - t1
    if profile:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        buf.write(f"\n{len(spawned)} subprocesses:\n" + "\n".join(spawned) + "\n")
        Path(profile).write_text(buf.getvalue())
    info = llm.cache_info()
    img = Image.new("RGB", (620, 877), "white")
    t2 = time.perf_counter()
    llm.generate([{"prompt": build_prompt(1, "What is the total?"), "multi_modal_data": {"image": [img]}}],
                 SamplingParams(max_tokens=8, ignore_eos=True))
    t_first = time.perf_counter() - t2
    after = llm.cache_info()
    return {"import_seconds": round(t_import, 3), "cuda_init_seconds": round(t_cuda, 3),
            "engine_seconds": round(t_llm, 3), "load_seconds": info["load_seconds"],
            "kernel_warmup_seconds": info["kernel_warmup_seconds"],
            "kernel_warmup_compiles": info.get("kernel_warmup_compiles"),
            "first_request_seconds": round(t_first, 3),
            "cuda_graph_capture_seconds": after["cuda_graph_capture_seconds"],
            "weight_bytes": info["weight_bytes"],
            "process_to_ready_seconds": round(t_import + t_cuda + t_llm, 3)}


def drop_from_page_cache(folders: list[Path]) -> int:
    dropped = 0
    for folder in folders:
        for f in folder.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    dropped += f.stat().st_size
                finally:
                    os.close(fd)
    return dropped


def run_child(model: Path, draft: Path | None, device: str, triton_cache: str, profile: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), "--device", device]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    if profile:
        cmd += ["--profile", profile]
    env = {**os.environ, "TRITON_CACHE_DIR": triton_cache}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": p.stderr[-2000:], "wall_seconds": round(wall, 3)}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["wall_seconds"] = round(wall, 3)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--cases", default="bundled,7b")
    ap.add_argument("--work", default="/tmp/docproc-startup")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warm-repeats", type=int, default=2)
    ap.add_argument("--child")
    ap.add_argument("--draft")
    ap.add_argument("--profile", help="a file: after the warm runs, one more warm run of each case under cProfile "
                                      "writes its top entries and subprocesses there (CASE.FILE per case)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.draft, a.device, a.profile)))
        return
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from docproc.pipeline.settings import bundled_model

    report: dict = {"date": time.strftime("%Y-%m-%d"), "device": a.device, "cases": {}}
    if a.device.startswith("cuda"):
        report["device"] = torch.cuda.get_device_name()
    for case in a.cases.split(","):
        if case == "bundled":
            model, draft = bundled_model("target"), bundled_model("draft")
        elif case in ("7b", "qwen3-8b"):
            from fixtures.checkpoints import make_model

            model, draft = Path(a.work) / case, None
            t0 = time.perf_counter()
            if not (model / "config.json").is_file():
                make_model(model, geometry=case, dtype=torch.bfloat16, device=a.device if a.device != "cpu" else "cpu",
                           init_std=None, max_pixels=28 * 28 * 1280, shards=4)
                import gc

                gc.collect()
                torch.cuda.empty_cache()  # the writer's memory back for the measured processes
            report.setdefault("written_seconds", {})[case] = round(time.perf_counter() - t0, 1)
        else:
            raise SystemExit(f"unknown case {case!r}: bundled, 7b or qwen3-8b")
        folders = [model] + ([draft] if draft else [])
        cache = tempfile.mkdtemp(prefix="triton-cache-")
        dropped = drop_from_page_cache(folders)
        cold = run_child(model, draft, a.device, cache)
        warm = [run_child(model, draft, a.device, cache) for _ in range(a.warm_repeats)]
        r = {"model_bytes_on_disk": dropped, "cold": cold, "warm": warm}
        ok = [w["process_to_ready_seconds"] for w in warm if "process_to_ready_seconds" in w]
        if ok:
            r["warm_best_process_to_ready_seconds"] = min(ok)
            r["warm_best_engine_seconds"] = min(w["engine_seconds"] for w in warm if "engine_seconds" in w)
        if a.profile:
            target = Path(a.profile)
            run_child(model, draft, a.device, cache, str(target.with_name(f"{case}.{target.name}")))
        report["cases"][case] = r
        print(json.dumps({case: r}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
