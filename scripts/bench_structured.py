"""The default query set under its rules against the same questions as free text, on fresh
documents and blank pages (issue: schema-constrained extraction).

    python3 scripts/bench_structured.py --count 200 --seed 9090 --blank 10 --json bench/results/X.json

Generates --count documents (a generator seed the bundled pair never saw) plus --blank blank
pages (white PNGs), then runs `docproc run` twice over them with the bundled target (CPU,
float32 unless --device says otherwise): the default query set (every answer decoded under its
type's rule, all_fields under the document schema), and the same questions with
`constrained = false` (free text, as the engine decoded them before the rules). Reports for each:
`docproc eval` (overall and per field; all_fields' properties as all_fields.FIELD), how many
all_fields answers are valid JSON for the schema, statuses, seconds; and on the blank pages how
many fields came back null. --mode picks one of the two runs (for running them side by side);
--mode partial reports on the documents both runs' flushed parts hold (runs stopped early),
paired document for document.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from docproc.pipeline.json_schema import violation as schema_violation  # noqa: E402
from docproc.pipeline.evaluate import evaluate  # noqa: E402
from docproc.pipeline.queries import default_query_file, load_queries  # noqa: E402
from docproc.pipeline.run import Pipeline, RunSettings  # noqa: E402
from docproc.pipeline.schema import read_table  # noqa: E402


def free_text_queries(path: Path) -> Path:
    """The default questions with constrained = false and no schema."""
    lines = []
    for q in load_queries().queries:
        lines += ["[[query]]", f"name = {json.dumps(q.name)}", f"question = {json.dumps(q.question)}",
                  f"type = {json.dumps(q.type)}", f"max_tokens = {q.max_tokens}", "constrained = false", ""]
    path.write_text("\n".join(lines))
    return path


def make_inputs(work: Path, count: int, seed: int, blank: int) -> Path:
    from PIL import Image

    from fixtures.documents import generate

    docs = work / "docs"
    if not (work / "truth.jsonl").exists():
        docs.mkdir(parents=True, exist_ok=True)
        generate(docs, count, seed=seed)
        (docs / "truth.jsonl").rename(work / "truth.jsonl")
        for i in range(blank):
            Image.new("RGB", (850, 1100), "white").save(docs / f"blank_{i:02d}.png")
    return docs


def one_run(docs: Path, out: Path, queries: Path | None, args) -> dict:
    from docproc.pipeline.settings import bundled_model

    s = RunSettings(inputs=[str(docs)], out=str(out), model=str(bundled_model("target")),
                    queries=str(queries) if queries else None, device=args.device, force=True)
    t0 = time.perf_counter()
    manifest = Pipeline(s).run()
    seconds = time.perf_counter() - t0
    rows = [r for r in read_table(out / "results.parquet").to_pylist() if r["query"] is not None]
    return {"seconds": round(seconds, 1), "constraints": manifest["query_set"]["constraints"],
            **report(rows, out, out.parent / "truth.jsonl")}


def report(rows: list[dict], out: Path, truth: Path) -> dict:
    schema = json.loads(load_queries().queries[-1].schema)
    fields = [r for r in rows if r["query"] == "all_fields" and not Path(r["path"]).name.startswith("blank_")]
    valid = 0
    for r in fields:
        try:
            valid += schema_violation(json.loads(r["answer"]), schema) is None
        except json.JSONDecodeError:
            pass
    blank = [r for r in rows if Path(r["path"]).name.startswith("blank_")]
    blank_nulls, blank_cells = 0, 0
    for r in blank:
        if r["query"] == "all_fields":
            obj = json.loads(r["value"]) if r["value"] else {}
            blank_cells += 6
            blank_nulls += sum(obj.get(k) is None for k in schema["properties"])
        else:
            blank_cells += 1
            blank_nulls += r["value"] is None
    return {"statuses": dict(Counter(r["status"] for r in rows)),
            "all_fields_documents": len(fields), "all_fields_valid_for_schema": valid,
            "blank_pages": len({r["path"] for r in blank}), "blank_cells": blank_cells, "blank_null_cells": blank_nulls,
            "blank_answers": {f"{Path(r['path']).name}|{r['query']}": r["answer"] for r in blank},
            "eval": evaluate(out, truth)}


def partial(work: Path) -> dict:
    """Both runs' rows on the documents both have finished (from their flushed parts)."""
    import pyarrow.parquet as pq

    from docproc.pipeline.runstore import RunStore
    from docproc.pipeline.schema import to_table

    tables = {k: [r for r in RunStore(work / f"out_{k}").current().to_pylist() if r["query"] is not None]
              for k in ("rules", "free")}
    common = set.intersection(*({r["path"] for r in t} for t in tables.values()))
    names = {Path(p).name for p in common}
    truth = work / "truth_common.jsonl"
    truth.write_text("".join(line + "\n" for line in (work / "truth.jsonl").read_text().splitlines()
                             if json.loads(line)["file"] in names))
    res = {"documents_in_both": len([p for p in common if not Path(p).name.startswith("blank_")])}
    for k, t in tables.items():
        rows = [r for r in t if r["path"] in common]
        view = work / f"view_{k}"
        view.mkdir(exist_ok=True)
        pq.write_table(to_table(rows), view / "results.parquet")
        res["rules" if k == "rules" else "free_text"] = report(rows, view, truth)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--seed", type=int, default=9090)
    ap.add_argument("--blank", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", default="/tmp/docproc-structured")
    ap.add_argument("--mode", choices=["both", "rules", "free", "partial"], default="both")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    docs = make_inputs(work, args.count, args.seed, args.blank)
    res = {"what": "default query set under its rules against the same questions as free text, bundled target",
           "count": args.count, "seed": args.seed, "blank": args.blank, "device": args.device,
           "default_queries": str(default_query_file())}
    if args.mode == "partial":
        res.update(partial(work))
    if args.mode in ("both", "rules"):
        res["rules"] = one_run(docs, work / "out_rules", None, args)
    if args.mode in ("both", "free"):
        res["free_text"] = one_run(docs, work / "out_free", free_text_queries(work / "free.toml"), args)
    Path(args.json).write_text(json.dumps(res, indent=1))
    for k in ("rules", "free_text"):
        if k in res:
            e = res[k]["eval"]
            print(k, res[k].get("seconds"), "s, exact match", round(e["overall_exact_match"], 4),
                  "valid", res[k]["all_fields_valid_for_schema"], "/", res[k]["all_fields_documents"],
                  "blank nulls", res[k]["blank_null_cells"], "/", res[k]["blank_cells"])


if __name__ == "__main__":
    main()
