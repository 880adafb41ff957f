"""Soak the CLI on a GPU: many `docproc run` invocations over the combinations that have crashed
or could, each run several times, reporting crashes and whether each combination's answers match
its plain run.

Combinations: draft none / bundled x --spec-k 4 / auto (with a draft) x --kv-cache bf16 / fp4 x
CUDA graphs on / --enforce-eager. The plain run of a KV format is draft none, graphs on, its first
repeat; a greedy combination with the same KV format should give the same answers. Several runs
share the GPU at once (--parallel, each with its share of memory); a crash is a non-zero exit, a
traceback, or a CUDA error in the output.

    python scripts/gpu_soak.py --docs DOCS --repeats 2 --parallel 4 --json soak.json
    python scripts/gpu_soak.py --make-docs DOCS --count 32   # documents first (needs pymupdf)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent


def combinations(kinds: list[str]) -> list[dict]:
    out = []
    for draft, k, kv, graphs in itertools.product(("none", "bundled"), ("4", "auto"), ("bf16", "fp4"), (True, False)):
        if draft == "none" and k != "auto":
            continue  # K means nothing without a draft
        c = {"draft": draft, "spec_k": k, "kv": kv, "graphs": graphs}
        if not kinds or name(c) in kinds:
            out.append(c)
    return out


def name(c: dict) -> str:
    spec = "plain" if c["draft"] == "none" else f"draft-k{c['spec_k']}"
    return f"{spec}-{c['kv']}-{'graphs' if c['graphs'] else 'eager'}"


def run_one(c: dict, repeat: int, docs: Path, work: Path, share: float, timeout: int, more: list[str]) -> dict:
    out = work / f"{name(c)}-r{repeat}"
    cmd = [sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--draft", c["draft"],
           "--kv-cache", c["kv"], "--device", "cuda", "--quiet", "--gpu-memory-utilization", str(share), *more]
    if c["draft"] != "none":
        cmd += ["--spec-k", c["spec_k"]]  # a usage error without a draft
    if not c["graphs"]:
        cmd.append("--enforce-eager")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    seconds = time.perf_counter() - t0
    crashed = rc not in (0, 1) or "Traceback" in text or "CUDA error" in text
    answers = None
    if (out / "results.parquet").is_file():
        answers = {f"{r['path']}|{r['query']}": r["answer"] for r in pq.read_table(out / "results.parquet").to_pylist()}
    manifest = None
    runs = sorted((out / "runs").glob("*/manifest.json")) if (out / "runs").is_dir() else []
    if runs:
        m = json.loads(runs[-1].read_text())
        manifest = {"status": m.get("status"), "exit_code": m.get("exit_code"), "totals": m["totals"],
                    "acceptance_rate": m.get("acceptance_rate"), "tokens_per_second": m.get("tokens_per_second"),
                    "fault": m.get("fault"), "graphs": (m.get("engine") or {}).get("num_cuda_graphs")}
    return {"combination": name(c), **c, "repeat": repeat, "rc": rc, "seconds": round(seconds, 1),
            "crashed": crashed, "tail": text[-1500:] if crashed else "", "manifest": manifest, "answers": answers}


def differing(a: dict | None, b: dict | None) -> list[str] | None:
    """Rows (path|query) whose answers differ between two runs; None if either has no results."""
    if a is None or b is None:
        return None
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def compare(runs: list[dict]) -> dict:
    """Per combination: crashes, and answers against the plain run of its KV format (draft none,
    first repeat) with graphs on and with the same graphs setting as the combination, and between
    its own repeats; the first differing rows with both answers."""
    plain = {}
    for r in runs:
        if r["draft"] == "none" and r["repeat"] == 0 and r["answers"] is not None:
            plain[(r["kv"], r["graphs"])] = r["answers"]
    report = {}
    for combo, group in itertools.groupby(sorted(runs, key=lambda r: (r["combination"], r["repeat"])),
                                          key=lambda r: r["combination"]):
        group = list(group)
        base = plain.get((group[0]["kv"], True))
        same = plain.get((group[0]["kv"], group[0]["graphs"]))
        diffs = [differing(r["answers"], base) for r in group]
        same_diffs = [differing(r["answers"], same) for r in group]
        examples = {}
        for r, d in zip(group, diffs):
            for k in (d or [])[:3]:
                examples.setdefault(k, {"plain_graphs": base.get(k), combo: r["answers"].get(k)})
        report[combo] = {"runs": len(group), "crashes": sum(r["crashed"] for r in group),
                         "answers_differing_from_plain": [None if d is None else len(d) for d in diffs],
                         "answers_differing_from_plain_same_graphs": [None if d is None else len(d) for d in same_diffs],
                         "differing_rows": examples, "rows": len(base) if base else None,
                         "repeats_identical": len({json.dumps(r["answers"], sort_keys=True) for r in group}) == 1,
                         "acceptance": [r["manifest"]["acceptance_rate"] if r["manifest"] else None for r in group],
                         "seconds": [r["seconds"] for r in group]}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=Path, help="A folder of documents to run on.")
    ap.add_argument("--make-docs", type=Path, help="Generate --count synthetic scans here and exit.")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="Runs of each combination.")
    ap.add_argument("--extra", default="draft-kauto-bf16-graphs:1,draft-kauto-fp4-graphs:1",
                    help="More repeats for some combinations: NAME:N,...")
    ap.add_argument("--only", default="", help="Comma-separated combination names (default: all).")
    ap.add_argument("--parallel", type=int, default=4, help="Runs sharing the GPU at once.")
    ap.add_argument("--timeout", type=int, default=480, help="Seconds one run may take.")
    ap.add_argument("--json", type=Path, help="Write the report here.")
    ap.add_argument("--run-args", default="", help="More `docproc run` options for every run, one string "
                    "(--run-args=--batch-invariant: with `=`, since it starts with a dash).")
    a = ap.parse_args()
    if a.make_docs:
        sys.path.insert(0, str(ROOT / "tests"))
        from fixtures.documents import generate

        generate(a.make_docs, a.count, seed=2026, formats=("png", "jpeg", "tiff"), max_pages=2)
        (a.make_docs / "truth.jsonl").unlink()
        return
    combos = combinations([x for x in a.only.split(",") if x])
    extra = {k: int(v) for k, v in (x.split(":") for x in a.extra.split(",") if x)}
    jobs = [(c, r) for c in combos for r in range(a.repeats + extra.get(name(c), 0))]
    share = round(0.85 / a.parallel, 3)
    t0 = time.perf_counter()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.parallel) as pool:
        # the plain runs first: every other run is compared with them
        jobs.sort(key=lambda j: (j[1], j[0]["draft"] != "none"))
        futures = [pool.submit(run_one, c, r, a.docs, Path(tmp), share, a.timeout, a.run_args.split())
                   for c, r in jobs]
        for fut in as_completed(futures):
            runs.append(fut.result())
            report = summarize(runs, a, share, t0)
            if a.json:  # after every run: a soak cut short still leaves its report
                a.json.write_text(json.dumps(report, indent=2))
            r = runs[-1]
            print(f"[{len(runs)}/{len(jobs)}] {r['combination']} r{r['repeat']} rc={r['rc']} {r['seconds']} s"
                  f"{' CRASH' if r['crashed'] else ''}", flush=True)
    print(json.dumps({k: report[k] for k in ("runs", "crashes", "runs_with_draft_auto", "seconds")}))
    for combo, v in report["combinations"].items():
        print(combo, json.dumps(v))
    for r in report["crashed_runs"]:
        print("CRASH", r["combination"], r["repeat"], r["rc"], r["tail"][-600:])


def summarize(runs: list[dict], a, share: float, t0: float) -> dict:
    return {"runs": len(runs), "run_args": a.run_args, "crashes": sum(r["crashed"] for r in runs),
              "runs_with_draft_auto": sum(r["draft"] == "bundled" and r["spec_k"] == "auto" for r in runs),
              "parallel": a.parallel, "memory_share": share, "seconds": round(time.perf_counter() - t0, 1),
              "documents": len([p for p in a.docs.iterdir() if p.is_file()]),
              "combinations": compare(runs),
              "crashed_runs": [{k: r[k] for k in ("combination", "repeat", "rc", "tail")} for r in runs if r["crashed"]],
              "per_run": [{k: v for k, v in r.items() if k not in ("answers", "tail")} for r in runs]}


if __name__ == "__main__":
    main()
