"""`docproc eval`: field exact match and F1 of a run's answers against ground truth (truth.jsonl).

Both sides are normalised by field type before comparing: dates to ISO, amounts to plain
decimals, strings case- and space-insensitively. F1 is over whitespace tokens of the normalised
strings (partial credit for a vendor name missing a word). A field whose truth is null counts as
correct when the answer is empty/none.
"""
from __future__ import annotations

import codecs
import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa

from docproc.pipeline.normalize import normalize_amount, normalize_date, normalize_text
from docproc.pipeline.queries import json_value_problem, not_json
from docproc.pipeline.runstore import RunStore, check_out_folder, json_kind, nothing_yet
from docproc.pipeline.schema import json_value, read_table

# the kinds of a JSON answer's properties, which carry no query type of their own (the default
# query set's all_fields): by the property's name
FIELD_TYPES = {"date": "date", "due_date": "date", "total": "number"}


def _text(value) -> str | None:
    """A value as text, the same way for truth and answers (JSON for lists, objects, numbers)."""
    return None if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _norm(kind: str, value) -> str | None:
    """value normalised as a `kind` answer ("date", "number", anything else as text). A list or
    an object is not read as a date or an amount (["7213.84"] is not the amount 7213.84)."""
    scalar = not isinstance(value, (list, dict))
    value = _text(value)
    if value is None:
        return None
    if not scalar:
        return normalize_text(value)
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


class TruthFileError(ValueError):
    """A ground-truth file that cannot be scored against: the message names the file, the line
    and what a line must hold."""


RECORD = 'a record must be a JSON object with "file" (a string) and "fields" (an object)'
TRUTH_FILE_LIMIT = 256 << 20  # bytes: about a million records of a few fields


def read_truth(path: str | Path) -> list[dict]:
    """Every record of a truth.jsonl, each checked before any is scored: one JSON object per
    line, with "file" (the document's file name) and "fields" (field -> expected value); blank
    lines are skipped but counted, so that a message's line number is the editor's."""
    path = Path(path)
    if path.is_dir():
        raise TruthFileError(f"{path} is a folder: pass the truth file itself (one JSON record per line)")
    try:
        with path.open("rb") as f:  # at most the limit (a pipe, `<(cmd)`, is fine; /dev/zero never ends)
            data = f.read(TRUTH_FILE_LIMIT + 1)
        if len(data) > TRUTH_FILE_LIMIT:
            raise TruthFileError(f"{path} is over {TRUTH_FILE_LIMIT >> 20} MiB: not a truth file")
    except FileNotFoundError:
        raise TruthFileError(f"{path} does not exist: pass a truth file (one JSON record per line)") from None
    except OSError as e:
        raise TruthFileError(f"{path} cannot be read ({e.strerror or e}): pass a readable truth file") from None
    records = []
    first_line: dict[str, int] = {}  # file -> the line of its record
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path} line {number}"
        if number == 1 and raw.startswith(codecs.BOM_UTF8):  # as some Windows editors save UTF-8
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TruthFileError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line is "
                                 f"{raw[e.start]:#04x}): save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=not_json)
        except json.JSONDecodeError as e:  # its own position is within the line: the column only
            raise TruthFileError(f"{where}: not JSON ({e.msg} at column {e.colno}); {RECORD}, one per line") from None
        except RecursionError:
            raise TruthFileError(f"{where}: JSON nested too deep; {RECORD}") from None
        except ValueError as e:  # NaN or Infinity, a whole number of thousands of digits
            raise TruthFileError(f"{where}: not JSON ({json_value_problem(e)}); {RECORD}, one per line") from None
        if not isinstance(rec, dict):
            raise TruthFileError(f"{where}: {RECORD}; got {json_kind(rec)}")
        if "file" not in rec:
            raise TruthFileError(f'{where}: {RECORD}; "file" is missing')
        if not isinstance(rec["file"], str) or not rec["file"].strip():
            got = "an empty string" if isinstance(rec["file"], str) else json_kind(rec['file'])
            raise TruthFileError(f'{where}: "file" must be the document\'s file name (a string); got {got}')
        if "fields" not in rec:
            raise TruthFileError(f'{where}: {RECORD}; "fields" is missing')
        if not isinstance(rec["fields"], dict):
            raise TruthFileError(f'{where}: "fields" must be an object (field name -> expected value); '
                                 f'got {json_kind(rec["fields"])}')
        if rec["file"] in first_line:  # scored twice (or against two truths) it would count twice
            raise TruthFileError(f'{where}: a second record for {rec["file"]!r} (the first is on line '
                                 f'{first_line[rec["file"]]}): one record per file')
        first_line[rec["file"]] = number
        records.append(rec)
    if not records:
        raise TruthFileError(f"{path} holds no records: {RECORD}, one per line")
    return records


def match_document(file: str, paths: set[str], by_name: dict[str, list[str]]) -> tuple[str | None, list[str]]:
    """The OUT document a truth record's "file" names, and the candidates: the path itself
    (separators as on Windows, `./` and doubled slashes read too); else for a bare file name,
    the one document of that name in any folder; else for a path, the document whose path it
    ends with or that ends with it, folder by folder, the longest such (a truth written from
    another folder: `sample_docs/a.pdf` for `a.pdf`), and where no folder lines up, the one
    document of its file name. (None, candidates) where none or several fit."""
    if file in paths:
        return file, [file]
    # written on Windows, or with ./ and doubled slashes
    parts = [p for p in file.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts:
        return None, []
    file = "/".join(parts)
    if file in paths:
        return file, [file]
    named = by_name.get(parts[-1], [])
    if len(parts) == 1:
        return (named[0] if len(named) == 1 else None), named
    best, found = 0, []  # one path ends with the other, folder by folder; the longest such
    for p in named:
        q = p.split("/")
        n = min(len(q), len(parts))
        if q[-n:] != parts[-n:] or n < best:
            continue
        if n > best:
            best, found = n, []
        found.append(p)
    if not found:  # folders that do not line up (another input's name): the file name, if one has it
        found = named
    return (found[0] if len(found) == 1 else None), found


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "") if names else "none"


FAILED = {"error", "skipped"}  # a row's or a document's status that is no answer at all
NO_ANSWER = object()  # (a failed or skipped query's value: not None, which a null truth would match)


def answer_rows(out: Path) -> tuple[list[dict], list[str]]:
    """OUT's rows as they stand, and the names of the state's parts that could not be read. The
    rows are the state's current ones (an OUT written with any --format, the documents of a run
    still going or killed); the documents of parts that cannot be read, and every document where
    there is no state, come from results.parquet (the last completed run's table)."""
    store = RunStore(out)
    table = store.current() if store.part_files() else None
    lost = sorted(p.name for p in store.damaged_parts | store.unreadable_parts)
    rows = table.to_pylist() if table is not None else []
    results = out / "results.parquet"
    if (table is None or lost) and results.is_file():
        try:
            written = read_table(results).to_pylist()
        except PermissionError:
            if table is None:
                raise  # (said as the system's refusal, not as a damaged table)
            written = []
        except (pa.ArrowException, OSError) as e:
            if table is None:
                raise ValueError(f"{results} cannot be read as Parquet ({e}): run `docproc run ... --out {out}` "
                                 f"again to rewrite it") from None
            written = []
        have = {r["path"] for r in rows}
        rows += [r for r in written if r["path"] not in have]
    return rows, lost


def evaluate(out: str | Path, truth_file: str | Path) -> dict:
    """Scores of OUT's answers as they stand (answer_rows) against truth_file. A document of the
    truth that failed or was skipped in OUT is listed (failed_documents) and scored as its rows
    say: with no answer rows at all, as no answer to each query OUT asks elsewhere; one OUT does
    not hold is listed, not scored. overall_* are None when no field of the truth
    met an answer (documents not in OUT, or queries that name none of its fields):
    `nothing_compared` says which."""
    out = Path(out)
    check_out_folder(out)
    truth = read_truth(truth_file)
    table, lost = answer_rows(out)
    if not table:
        if lost:  # (answers there, which cannot be read: not "run docproc run first")
            raise PermissionError(f"{out}'s answers cannot be read: {len(lost)} part(s) of its state ({_listed(lost)}), "
                                  f"and no readable results.parquet holds their documents")
        raise nothing_yet(out, "answers")
    answers: dict[str, dict[str, object]] = defaultdict(dict)
    properties: dict[str, dict[str, str | None]] = defaultdict(dict)  # QUERY.FIELD of JSON answers
    fields_of: dict[str, set[str]] = defaultdict(set)  # the fields each JSON query has answered anywhere
    not_objects: set[str] = set()  # JSON queries whose schema's root is not an object (a value was not one)
    no_object: dict[str, list[str]] = defaultdict(list)
    queries: dict[str, str] = {}  # every document query OUT asked anywhere: its type
    statuses: dict[str, set[str]] = defaultdict(set)  # the doc_status of each document (its path)
    by_name: dict[str, list[str]] = defaultdict(list)  # file name -> the documents of that name
    for r in table:
        if r["path"] not in statuses:
            by_name[Path(r["path"]).name].append(r["path"])
        statuses[r["path"]].add(r["doc_status"])
        if r["query"] is None or r.get("page") is not None:  # (the truth is per document, not per page)
            continue
        name, value = r["path"], r["value"]
        queries[r["query"]] = r["query_type"]
        if r["query_type"] == "json":  # an object's properties are scored as QUERY.FIELD
            obj = json_value(value)
            if isinstance(obj, dict):
                fields_of[r["query"]].update(obj)
                properties[name].update({f"{r['query']}.{k}": _text(v) for k, v in obj.items()})
            elif value is None:  # no answer (a parse error, a failure)
                no_object[name].append(r["query"])
            else:  # a schema whose root is not an object: the value itself
                value = _text(obj)
                not_objects.add(r["query"])
        # the engine failed on it or it was skipped: wrong against any truth, a null one too
        answers[name][r["query"]] = NO_ANSWER if r["status"] in FAILED else value
    per_field: dict[str, list[tuple[float, float]]] = defaultdict(list)
    per_group: dict[str, list[float]] = defaultdict(list)
    missing, failed, ambiguous = [], [], []
    paths = set(statuses)
    named_by: dict[str, str] = {}  # an OUT document -> the truth's "file" that named it
    for rec in truth:
        name, candidates = match_document(rec["file"], paths, by_name)
        if name is None:
            (ambiguous if candidates else missing).append(rec)
            continue
        if name in named_by:  # (scored twice it would count twice)
            raise TruthFileError(f"{truth_file}: the records for {named_by[name]!r} and {rec['file']!r} name one "
                                 f"document of {out} ({name!r}): one record per document")
        named_by[name] = rec["file"]
        if statuses[name] <= FAILED:  # failed or skipped there
            failed.append(rec)
        if name not in answers:
            if not statuses[name] <= FAILED:
                continue  # (per-page answers only: nothing the truth's fields can be compared with)
            # no answer to any query: each query OUT asks elsewhere, unanswered
            answers[name] = {q: NO_ANSWER for q, kind in queries.items() if kind != "json" or q in not_objects}
            no_object[name] = [q for q, kind in queries.items() if kind == "json" and q not in not_objects]
        # a query's own answer wins over a JSON answer's property of the same name
        got = {**properties[name], **answers[name]}
        fmt = rec.get("format") or ("pdf" if name.lower().endswith(".pdf") else "image")
        group = "pdf" if fmt == "pdf" else "scan"
        for q in no_object[name]:  # counted as no value for each field that query answers elsewhere
            if q in not_objects and not fields_of[q]:
                continue  # (its value is scored as itself, under its own name)
            none = NO_ANSWER if answers[name].get(q) is NO_ANSWER else None
            got.update({f"{q}.{f}": none for f in rec["fields"] if not fields_of[q] or f in fields_of[q]})
        for field, value in rec["fields"].items():
            for key in [k for k in got if k == field or k.endswith("." + field)]:
                if got[key] is NO_ANSWER:
                    em, f1 = 0.0, 0.0
                else:
                    # a query's answer by its query's type, a JSON answer's property by its name
                    kind = queries.get(key) if key in queries else FIELD_TYPES.get(field, "string")
                    t, p = _norm(kind, value), _norm(kind, got[key])
                    em, f1 = float(t == p), _f1(p, t)
                per_field[key].append((em, f1))
                per_group[group].append(em)
    missing = [rec["file"] for rec in missing]
    ambiguous = [rec["file"] for rec in ambiguous]
    cells = [x for v in per_field.values() for x in v]
    nothing = None
    if not cells:
        if failed and not queries:
            nothing = (f"{len(failed)} document(s) of the truth file failed or were skipped in {out}, and no "
                       f"document there has an answer to a document query (per-page answers are not compared "
                       f"with the truth)")
        elif len(missing) + len(ambiguous) == len(truth):
            first = (missing or ambiguous)[0]
            nothing = (f"none of the {len(truth)} documents of the truth file is in {out} (matched by path, or by "
                       f"file name where one document has it, e.g. {first!r})" if not ambiguous else
                       f"none of the {len(truth)} documents of the truth file is in {out} or names one document "
                       f"there ({len(ambiguous)} name several: give their paths, e.g. {ambiguous[0]!r})")
        else:
            queries = sorted({q for a in answers.values() for q in a} | {k for p in properties.values() for k in p})
            fields = sorted({f for rec in truth for f in rec["fields"]})
            nothing = (f"no answer names a field of the truth file: answers {_listed(queries)}; truth fields "
                       f"{_listed(fields)}")
    return {
        "documents": len(truth) - len(missing) - len(ambiguous),
        "missing_documents": missing,
        "ambiguous_documents": ambiguous,
        "failed_documents": [rec["file"] for rec in failed],
        "unreadable_state_parts": lost,
        "overall_exact_match": sum(e for e, _ in cells) / len(cells) if cells else None,
        "overall_f1": sum(f for _, f in cells) / len(cells) if cells else None,
        "nothing_compared": nothing,
        "per_field": {k: {"exact_match": sum(e for e, _ in v) / len(v), "f1": sum(f for _, f in v) / len(v),
                          "n": len(v)} for k, v in sorted(per_field.items())},
        "by_format": {k: {"exact_match": sum(v) / len(v), "n": len(v)} for k, v in sorted(per_group.items())},
    }
