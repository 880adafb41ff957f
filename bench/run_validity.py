"""Whether every constrained answer of a real `docproc run` is whole: fresh synthetic documents
(tests/fixtures/documents.py, a seed not used elsewhere), run through the CLI with the default
query set and with the numbers-dates-enums schema set of bench/constrained_validity.py, each row
judged as stored: whole when its status is ok or empty, or truncated with a value (closed by the
budget: it parses and validates); anything else (parse_error, schema_violation, truncated without
a value, an engine error) is counted by status.

    python3 bench/run_validity.py --docs 200 --seed 4801 --device cpu --json /tmp/validity_cpu.json
    python3 bench/run_validity.py --docs 200 --seed 4802 --json $OUT/validity_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))


def judge(out: Path) -> dict:
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "results.parquet").to_pylist()
    statuses = Counter(r["status"] for r in rows if r["query"] is not None)
    whole = sum(1 for r in rows if r["query"] is not None and (r["status"] in ("ok", "empty") or (
        r["status"] == "truncated" and r["value"] is not None)))
    answers = sum(statuses.values())
    return {"documents": len({r["path"] for r in rows}), "file_errors": sum(1 for r in rows if r["query"] is None),
            "answers": answers, "whole": whole, "whole_share": round(whole / answers, 4) if answers else None,
            "statuses": dict(statuses),
            "not_whole": [{k: r[k] for k in ("path", "query", "status", "error", "answer")} for r in rows
                          if r["query"] is not None and r["status"] not in ("ok", "empty")
                          and not (r["status"] == "truncated" and r["value"] is not None)][:20]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=4801)
    ap.add_argument("--formats", default="pdf,png,jpeg,tiff")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work", default=None, help="folder for the documents and OUTs (default: a temporary one)")
    ap.add_argument("--json", required=True)
    ap.add_argument("run_args", nargs="*", help="more `docproc run` options, after --")
    args = ap.parse_args()
    from constrained_validity import SCHEMA_SET
    from fixtures.documents import generate

    work = Path(args.work or tempfile.mkdtemp(prefix="validity-"))
    docs = work / "docs"
    if not docs.exists():
        generate(docs, count=args.docs, seed=args.seed, formats=args.formats.split(","))
    (work / "schema.toml").write_text(SCHEMA_SET)
    report = {"docs": args.docs, "seed": args.seed, "device": args.device, "run_args": args.run_args, "sets": {}}
    for name, queries in (("default", None), ("numbers_dates_enums", work / "schema.toml")):
        out = work / f"out-{name}"
        cmd = [sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--quiet",
               *(["--device", args.device] if args.device != "auto" else []),
               *(["--queries", str(queries)] if queries else []), *args.run_args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        result = judge(out) if (out / "results.parquet").exists() else {}
        report["sets"][name] = {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                                "stderr_tail": proc.stderr[-600:], **result}
        print(name, json.dumps({k: v for k, v in report["sets"][name].items() if k != "not_whole"}), flush=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
