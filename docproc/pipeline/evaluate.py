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
from docproc.pipeline.schema import json_value, read_table

FIELD_TYPES = {"date": "date", "due_date": "date", "total": "number"}


def _text(value) -> str | None:
    """A value as text, the same way for truth and answers (JSON for lists, objects, numbers)."""
    return None if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _norm(field: str, value) -> str | None:
    value = _text(value)
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


def evaluate(out: str | Path, truth_file: str | Path) -> dict:
    out = Path(out)
    results = out / "results.parquet"
    if not results.is_file():
        raise FileNotFoundError(f"{results} does not exist: run `docproc run ... --out {out}` first")
    table = read_table(results).to_pylist()
    answers: dict[str, dict[str, str | None]] = defaultdict(dict)
    properties: dict[str, dict[str, str | None]] = defaultdict(dict)  # QUERY.FIELD of JSON answers
    fields_of: dict[str, set[str]] = defaultdict(set)  # the fields each JSON query has answered anywhere
    no_object: dict[str, list[str]] = defaultdict(list)
    for r in table:
        if r["query"] is None:
            continue
        name, value = Path(r["path"]).name, r["value"]
        if r["query_type"] == "json":  # an object's properties are scored as QUERY.FIELD
            obj = json_value(value)
            if isinstance(obj, dict):
                fields_of[r["query"]].update(obj)
                properties[name].update({f"{r['query']}.{k}": _text(v) for k, v in obj.items()})
            elif value is None:  # no answer (a parse error, a failure)
                no_object[name].append(r["query"])
            else:  # a schema whose root is not an object: the value itself
                value = _text(obj)
        answers[name][r["query"]] = value
    truth = [json.loads(line) for line in Path(truth_file).read_text().splitlines() if line.strip()]
    per_field: dict[str, list[tuple[float, float]]] = defaultdict(list)
    per_group: dict[str, list[float]] = defaultdict(list)
    missing = []
    for rec in truth:
        name = Path(rec["file"]).name
        if name not in answers:
            missing.append(rec["file"])
            continue
        # a query's own answer wins over a JSON answer's property of the same name
        got = {**properties[name], **answers[name]}
        group = "pdf" if rec.get("format", "pdf") == "pdf" else "scan"
        for q in no_object[name]:  # counted as no value for each field that query answers elsewhere
            got.update({f"{q}.{f}": None for f in rec["fields"] if not fields_of[q] or f in fields_of[q]})
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
