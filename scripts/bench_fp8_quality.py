"""FP8 weights against the checkpoint's own on fresh documents: `docproc run` twice over the same
generated documents (the bundled pair, or --model), once as the checkpoint stores its weights and
once with `--quantization fp8`, then `docproc eval` of each against the documents' truth. On CUDA
FP8 is W8A8 in batched steps (the inputs rounded per token) and weight-only in one-row and few-row
steps; on a CPU it is weight-only throughout. Also reports how many answers the two runs share.

    python3 scripts/bench_fp8_quality.py --count 200 --seed 6262 --work /tmp/fp8q --json fp8q.json
        [--device cuda] [--model DIR] [--workers 8] [-- extra docproc run options]

The documents are generated with --workers processes (the generator's seed gives every document
its own random stream, so the set does not depend on the split).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _make(args: tuple[str, int, int]) -> dict:
    from fixtures.documents import generate_one

    out, seed, i = args
    return generate_one(Path(out), seed, i)


def generate(out: Path, count: int, seed: int, workers: int) -> None:
    from fixtures.documents import write_truth

    out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) as pool:
        records = list(pool.map(_make, [(str(out), seed, i) for i in range(count)], chunksize=4))
    write_truth(out, records)


def docproc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "docproc", *args], cwd=ROOT, capture_output=True, text=True)


def answers(out: Path) -> dict:
    from docproc.pipeline.schema import read_table

    return {(r["path"], r["query"]): r["answer"] for r in read_table(out / "results.parquet").to_pylist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--seed", type=int, default=6262)
    ap.add_argument("--work", default="/tmp/fp8-quality")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="a model folder (default: the bundled target)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("extra", nargs="*", help="more docproc run options (after --)")
    a = ap.parse_args()
    work = Path(a.work)
    docs = work / "docs"
    t0 = time.perf_counter()
    generated = not (docs / "truth.jsonl").is_file()
    if generated:
        generate(docs, a.count, a.seed, a.workers)
    report: dict = {"documents": a.count, "seed": a.seed, "device": a.device,
                    "generate_seconds": round(time.perf_counter() - t0, 1) if generated else None, "runs": {}}
    if a.device.startswith("cuda"):
        import torch

        report["device_name"] = torch.cuda.get_device_name()
    for name, flags in (("checkpoint", []), ("fp8", ["--quantization", "fp8"])):
        out = work / name
        cmd = ["run", str(docs), "--out", str(out), "--device", a.device, "--quiet", *flags, *a.extra]
        if a.model:
            cmd += ["--model", a.model]
        shutil.rmtree(out, ignore_errors=True)  # a fresh run, not an incremental one
        t1 = time.perf_counter()
        p = docproc(*cmd)
        seconds = time.perf_counter() - t1
        if p.returncode != 0:
            raise SystemExit(f"docproc {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
        e = docproc("eval", str(out), "--truth", str(docs / "truth.jsonl"), "--json")
        if e.returncode != 0:
            raise SystemExit(f"docproc eval exited {e.returncode}:\n{e.stderr[-3000:]}")
        manifest = json.loads((sorted((out / "runs").iterdir())[-1] / "manifest.json").read_text())
        report["runs"][name] = {"command": "docproc " + " ".join(cmd), "seconds": round(seconds, 1),
                                "eval": json.loads(e.stdout), "totals": manifest.get("totals")}
        print(name, report["runs"][name]["eval"]["overall_exact_match"], f"{seconds:.1f} s", flush=True)
    base, fp8 = answers(work / "checkpoint"), answers(work / "fp8")
    same = sum(1 for k, v in base.items() if fp8.get(k) == v)
    report["answers"] = len(base)
    report["answers_identical"] = same
    ev = {k: r["eval"]["overall_exact_match"] for k, r in report["runs"].items()}
    report["exact_match_points_fp8_minus_checkpoint"] = round(100 * (ev["fp8"] - ev["checkpoint"]), 3)
    print(json.dumps({k: report[k] for k in ("answers", "answers_identical", "exact_match_points_fp8_minus_checkpoint")}))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
