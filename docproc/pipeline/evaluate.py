"""`docproc eval`: field exact match and F1 of a run's answers against ground truth (truth.jsonl).

Both sides are normalised by field type before comparing: dates to ISO, amounts to plain
decimals, strings case- and space-insensitively. F1 is over whitespace tokens of the normalised
strings (partial credit for a vendor name missing a word). A field whose truth is null counts as
correct when the answer is empty/none.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from docproc.pipeline.normalize import normalize_amount, normalize_date, normalize_text
from docproc.pipeline.schema import read_table

FIELD_TYPES = {"date": "date", "due_date": "date", "total": "number"}


def _norm(field: str, value) -> str | None:
    if value is None:
        return None
    kind = FIELD_TYPES.get(field, "string")
    if kind == "date":
        return normalize_date(str(value)) or normalize_text(str(value))
    if kind == "number":
        return normalize_amount(str(value)) or normalize_text(str(value))
    return normalize_text(str(value))


def _f1(pred: str | None, truth: str | None) -> float:
    if pred is None or truth is None:
        return float(pred == truth)
    p, t = pred.split(), truth.split()
    common = sum(min(p.count(w), t.count(w)) for w in set(p))
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(t)
    return 2 * prec * rec / (prec + rec)


def _properties(query: str, value: str | None) -> dict[str, str | None]:
    """QUERY.FIELD -> the field's value as text, for a JSON object answer (a number as written,
    null as None)."""
    if value is None:
        return {}
    try:
        obj = json.loads(value)
    except json.JSONDecodeError:
        return {}
    if not isinstance(obj, dict):
        return {}
    return {f"{query}.{k}": (None if v is None else v if isinstance(v, str) else json.dumps(v)) for k, v in obj.items()}


def evaluate(out: str | Path, truth_file: str | Path) -> dict:
    out = Path(out)
    results = out / "results.parquet"
    if not results.is_file():
        raise FileNotFoundError(f"{results} does not exist: run `docproc run ... --out {out}` first")
    table = read_table(results).to_pylist()
    answers: dict[str, dict[str, str | None]] = defaultdict(dict)
    no_object: dict[str, list[str]] = defaultdict(list)
    for r in table:
        if r["query"] is not None:
            got = answers[Path(r["path"]).name]
            got[r["query"]] = r["value"]
            if r["query_type"] == "json":  # a JSON answer's properties are scored as QUERY.FIELD
                got.update(_properties(r["query"], r["value"]))
                if r["value"] is None:  # no object (a parse error, a failure): wrong for every field
                    no_object[Path(r["path"]).name].append(r["query"])
    truth = [json.loads(line) for line in Path(truth_file).read_text().splitlines() if line.strip()]
    per_field: dict[str, list[tuple[float, float]]] = defaultdict(list)
    per_group: dict[str, list[float]] = defaultdict(list)
    missing = []
    for rec in truth:
        name = Path(rec["file"]).name
        if name not in answers:
            missing.append(rec["file"])
            continue
        got = answers[name]
        group = "pdf" if rec.get("format", "pdf") == "pdf" else "scan"
        for q in no_object[name]:
            got.update({f"{q}.{field}": None for field in rec["fields"]})
        for field, value in rec["fields"].items():
            for key in [k for k in got if k == field or k.endswith("." + field)]:
                t, p = _norm(field, value), _norm(field, got[key])
                em = float(t == p)
                per_field[key].append((em, _f1(p, t)))
                per_group[group].append(em)
    cells = [x for v in per_field.values() for x in v]
    return {
        "documents": len(truth) - len(missing),
        "missing_documents": missing,
        "overall_exact_match": sum(e for e, _ in cells) / len(cells) if cells else 0.0,
        "overall_f1": sum(f for _, f in cells) / len(cells) if cells else 0.0,
        "per_field": {k: {"exact_match": sum(e for e, _ in v) / len(v), "f1": sum(f for _, f in v) / len(v),
                          "n": len(v)} for k, v in sorted(per_field.items())},
        "by_format": {k: {"exact_match": sum(v) / len(v), "n": len(v)} for k, v in sorted(per_group.items())},
    }
