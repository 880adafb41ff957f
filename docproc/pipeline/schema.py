"""The one Arrow schema of docproc's results: the source of truth for the results table (Parquet,
CSV and JSON lines, one set of columns) and the per-document JSON files.

A row is one document x query. A file that was skipped or failed before any query ran has one row
with a null query, so every input file has an outcome in the table. In the state's parts (not in
results.parquet) a document whose file is gone from its root has one tombstone row of doc_status
"removed".
"""
from __future__ import annotations

import array
import json
import mmap
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from docproc.multimodal import safe_text

RESULT_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("path", pa.string(), nullable=False),  # the document's key: relative to its input root
    pa.field("root", pa.string()),  # the input root's real path (null in tables written before it existed)
    pa.field("doc_sha256", pa.string()),  # of the file's bytes; null when the file was not read
    pa.field("doc_status", pa.string(), nullable=False),  # ok | partial | skipped | error
    pa.field("pages", pa.int32()),  # pages processed (after --max-pages)
    pa.field("query", pa.string()),
    pa.field("query_type", pa.string()),
    pa.field("page", pa.int32()),  # a per-page query's page (1 = the first); null for a document's rows
    pa.field("answer", pa.string()),  # raw model text
    pa.field("value", pa.string()),  # parsed and normalised (ISO date, plain decimal, sorted JSON)
    # ok | empty | parse_error | schema_violation | truncated | error | skipped
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("error_kind", pa.string()),  # a document's error or skip class (docs/outputs.md: "Outcomes")
    pa.field("prompt_tokens", pa.int32()),
    pa.field("cached_tokens", pa.int32()),
    pa.field("generated_tokens", pa.int32()),
    pa.field("draft_proposed", pa.int32()),
    pa.field("draft_accepted", pa.int32()),
    pa.field("draft_verifications", pa.int32()),  # verification steps (null in tables written before it existed)
    pa.field("latency_s", pa.float64()),
    pa.field("config_fingerprint", pa.string(), nullable=False),
    pa.field("part", pa.int64(), nullable=False),  # write order: the latest part wins per path
])

COLUMNS = [f.name for f in RESULT_SCHEMA]
# a row's status when its answer is not usable: the engine failed on it; it does not parse; it
# breaks its JSON Schema (a keyword decoding does not enforce); it ran out of max_tokens before its
# constraint could close (its shortest valid form did not fit)
BAD_STATUSES = ("error", "parse_error", "schema_violation", "truncated")


def is_bad(row: dict) -> bool:
    """A row whose answer is not usable: a bad status without a value. An answer closed at
    max_tokens (truncated, its value kept) is usable, though its last value may be cut."""
    return row.get("status") in BAD_STATUSES and not (row.get("status") == "truncated" and row.get("value") is not None)

# what --format takes: json (json/<path>.json), parquet, csv and jsonl (results.parquet, .csv and
# .jsonl, each with the schema's columns) and documents (documents.parquet, typed per query)
OUTPUT_FORMATS = ("json", "parquet", "csv", "jsonl", "documents")


def _cell(v):
    return safe_text(v) if isinstance(v, str) else v


def to_table(rows: list[dict]) -> pa.Table:
    """Rows as the schema's table; text that UTF-8 cannot store (a non-UTF-8 name carried into a
    message) is written with backslash escapes."""
    return pa.Table.from_pylist([{c: _cell(r.get(c)) for c in COLUMNS} for r in rows], schema=RESULT_SCHEMA)


def read_table(path: str | Path, schema: pa.Schema | None = None) -> pa.Table:
    """A Parquet file of OUT, read from a memory map of it (Arrow takes no path that is not UTF-8,
    so Python opens it), on one thread: Arrow reading through a Python file object, with its
    thread pools, could abort the interpreter at exit ("terminate called without an active
    exception": 35 of 40 runs with pyarrow 26 on a 2-core machine, and about 1 in 50 still with
    use_threads=False under load; apache/arrow#50482); a memory map is a plain buffer to it.
    Through ParquetFile, not pq.read_table, whose dataset layer imports pandas (0.7 s of a run
    with nothing to do); with a schema, as a dataset reads it: its columns in its order and
    types, nulls for those the file lacks (parts written before a column existed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
    finally:
        os.close(fd)
    table = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data))).read(use_threads=False)
    if schema is None:
        return table
    columns = []
    for fld in schema:
        if fld.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, fld.type))
        else:
            column = table.column(fld.name)
            columns.append(column if column.type == fld.type else column.cast(fld.type))
    return pa.table(columns, schema=schema)


def int64_array(values: list[int]) -> pa.Array:
    """Row indices as an Arrow array made from their bytes: pa.array() imports pandas, where it
    is installed, to ask whether it was given a pandas object (0.3 s of a run with nothing to do)."""
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(array.array("q", values))])


def document_json(rows: list[dict]) -> dict:
    """One document's JSON file, from its rows (same fields and names as the table)."""
    first = rows[0]
    doc = {k: first.get(k) for k in ("run_id", "path", "doc_sha256", "doc_status", "pages", "config_fingerprint")}
    # a JSON answer as the object it is (the table holds its text)
    doc["fields"] = {}
    for r in rows:  # a per-page query's field: its values in page order
        if r["query"] is not None:
            value = json_value(r["value"]) if r.get("query_type") == "json" else r["value"]
            if r.get("page") is None:
                doc["fields"][r["query"]] = value
            else:
                doc["fields"].setdefault(r["query"], []).append(value)
    doc["queries"] = [{k: r.get(k) for k in COLUMNS if k not in doc and k not in ("part", "root")} for r in rows
                      if r["query"] is not None]
    # what went wrong, each message once and naming its query (and page): "errors" for the rows
    # without a usable answer, "notes" for those whose answer stands with a remark (closed at
    # max_tokens with its value kept, a document read only to --max-pages)
    # (--max-pages' remark, which every row of a document read in part carries: once, unnamed)
    short = next((m.group(0) for r in rows if r.get("error") and (m := TRUNCATED.search(r["error"]))), None)
    for key, bad in (("errors", True), ("notes", False)):
        said = dict.fromkeys(row_problem({**r, "error": TRUNCATED.sub("", r["error"])}) for r in rows
                             if r.get("error") and TRUNCATED.sub("", r["error"]) and is_bad(r) == bad)
        if key == "notes" and short is not None:
            said[short.removeprefix("; ")] = None
        if said:
            doc[key] = list(said)
    if first.get("error_kind") and first["query"] is None:
        doc["error_kind"] = first["error_kind"]
    return _clean(doc)


TRUNCATED = re.compile(r"(?:; )?only the first \d+ of \d+ pages were read \(--max-pages\)$")


def row_problem(row: dict) -> str:
    """A row's error naming its query and, for a per-page query, its page: "total: not a number:
    ..." or "date (page 2): ..."; a file's row (no query) as it is."""
    if row.get("query") is None:
        return row["error"]
    where = row["query"] if row.get("page") is None else f"{row['query']} (page {row['page']})"
    return f"{where}: {row['error']}"


def json_value(value: str | None):
    """A json query's value (JSON text, as parse_answer writes it) decoded; text that is not JSON
    (not expected) as it is."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


def _clean(obj):
    """The JSON file's content with all text safe for UTF-8 (see to_table)."""
    if isinstance(obj, dict):
        return {_cell(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return _cell(obj)
