"""Two `docproc run` output folders compared on the documents both have finished (their json/
files; a run may still be going, or have been stopped): each one's field exact match against the
truth (normalised as `docproc eval` does) and the share of answers that are identical.

    python scripts/compare_runs.py OUT_A OUT_B --truth truth.jsonl [--json R.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docproc.pipeline.evaluate import FIELD_TYPES, _norm  # noqa: E402


def answers(out: Path) -> dict[str, dict[str, str | None]]:
    got = {}
    for f in (out / "json").glob("*.json"):
        rec = json.loads(f.read_text())
        if rec.get("doc_status") == "ok":
            got[Path(rec["path"]).name] = {q["query"]: q["value"] for q in rec["queries"]}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--truth", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs = {name: answers(Path(name)) for name in (args.a, args.b)}
    truth = {Path(r["file"]).name: r["fields"] for r in map(json.loads, Path(args.truth).read_text().splitlines())
             if r}
    common = sorted(set(runs[args.a]) & set(runs[args.b]) & set(truth))
    em = {name: [] for name in runs}
    same = []
    for doc in common:
        for field, value in truth[doc].items():
            a, b = runs[args.a][doc].get(field), runs[args.b][doc].get(field)
            if a is None and b is None and field not in runs[args.a][doc]:
                continue  # a field no query asks for
            for name, v in ((args.a, a), (args.b, b)):
                kind = FIELD_TYPES.get(field, "string")  # (the default query set's field names)
                em[name].append(float(_norm(kind, value) == _norm(kind, v)))
            same.append(a == b)
    report = {"documents": len(common), "fields": len(same),
              "exact_match": {name: round(sum(v) / max(1, len(v)), 4) for name, v in em.items()},
              "identical_answers": round(sum(same) / max(1, len(same)), 4)}
    report["difference_points"] = round(100 * (report["exact_match"][args.b] - report["exact_match"][args.a]), 2)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
