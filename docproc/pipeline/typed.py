"""documents.parquet: one row per document, one typed column per query, for readers that want
numbers and dates as such (pandas, DuckDB, Polars).

results.parquet keeps one row per document x query with every value as text: its schema is the
same for every query set, so that parts written under different query sets concatenate. This
table is derived from it at the end of each run, typed by the current query set: a `number`
query is float64, a `date` query date32, a `string` query string, and a `json` query with a
schema a struct column whose fields follow the schema (string, number -> float64, integer ->
int64, boolean, nested objects as structs, arrays as lists, a string of format "date" as date32;
any other value as its JSON text). A json query without a schema is its JSON text. A value that
does not fit its type (an answer from before the query's schema changed) is null; the text is
in results.parquet.
"""
from __future__ import annotations

import json
import math
from datetime import date

import pyarrow as pa

from docproc.pipeline.schema import json_value

DOCUMENT_COLUMNS = [("path", pa.string()), ("root", pa.string()), ("doc_sha256", pa.string()),
                    ("doc_status", pa.string()), ("run_id", pa.string())]


def arrow_type(schema) -> pa.DataType:
    """The Arrow type a JSON Schema's values are stored as."""
    if not isinstance(schema, dict):
        return pa.string()
    for key in ("anyOf", "oneOf"):
        if key in schema:
            real = [s for s in schema[key] if not (isinstance(s, dict) and s.get("type") == "null")]
            return arrow_type(real[0]) if len(real) == 1 else pa.string()
    t = schema.get("type")
    if isinstance(t, list):
        real = [x for x in t if x != "null"]
        if len(real) != 1:
            return pa.string()
        t = real[0]
    if t == "string":
        return pa.date32() if schema.get("format") == "date" else pa.string()
    if t == "number":
        return pa.float64()
    if t == "integer":
        return pa.int64()
    if t == "boolean":
        return pa.bool_()
    if t == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return pa.struct([(k, arrow_type(v)) for k, v in schema["properties"].items()])
    if t == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(arrow_type(schema["items"]))
    return pa.string()


def convert(value, typ: pa.DataType):
    """value (decoded JSON) as a Python value Arrow stores under typ; None where it does not fit."""
    if value is None:
        return None
    if pa.types.is_struct(typ):
        if not isinstance(value, dict):
            return None
        return {typ.field(i).name: convert(value.get(typ.field(i).name), typ.field(i).type)
                for i in range(typ.num_fields)}
    if pa.types.is_list(typ):
        return [convert(v, typ.value_type) for v in value] if isinstance(value, list) else None
    if pa.types.is_boolean(typ):
        return value if isinstance(value, bool) else None
    if pa.types.is_int64(typ):
        return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63 else None
    if pa.types.is_float64(typ):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        try:
            return float(value)
        except OverflowError:  # an integer past float64's range
            return None
    if pa.types.is_date32(typ):
        try:
            return date.fromisoformat(value) if isinstance(value, str) else None
        except ValueError:
            return None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def query_type(q) -> pa.DataType:
    if q.type == "number":
        return pa.float64()
    if q.type == "date":
        return pa.date32()
    if q.type == "json" and q.schema is not None:
        return arrow_type(json.loads(q.schema))
    return pa.string()


def _cell(q, typ: pa.DataType, value: str | None):
    if value is None:
        return None
    if q.type == "number":
        try:
            number = float(value)
        except (ValueError, OverflowError):
            return None
        return number if math.isfinite(number) else None  # (a decimal past float64's range)
    if q.type == "json":
        return value if q.schema is None else convert(json_value(value), typ)
    return convert(value, typ)


def documents_table(results: pa.Table, queries) -> pa.Table:
    """results.parquet's rows as one row per document, typed by the query set (see above). A
    query name that is also a document column (or another query's column), ignoring case, gets
    the prefix "query."."""
    used = {n.casefold() for n, _ in DOCUMENT_COLUMNS}  # (ignoring case: "Run_ID" beside run_id clashes in SQL)
    qcols = []
    for q in queries.queries:
        name = q.name
        while name.casefold() in used:  # ("path" and "query.path" both queries: one column each)
            name = "query." + name
        used.add(name.casefold())
        typ = query_type(q)
        qcols.append((q, name, pa.list_(typ) if q.per_page else typ))
    docs: dict[str, dict] = {}
    for r in results.to_pylist():
        d = docs.setdefault(r["path"], {n: r.get(n) for n, _ in DOCUMENT_COLUMNS})
        d.setdefault("_values", {})
        # by name, whatever type the row was asked under: a document of a root this run did not
        # search keeps the rows of an earlier query set, whose value goes into the current
        # column where it fits its type (it was null there for any change of type)
        if r["query"] is not None and r.get("page") is not None:  # a per-page query: its values in page order
            d["_values"].setdefault((r["query"], "pages"), []).append((r["page"], r["value"]))
        elif r["query"] is not None:
            d["_values"][r["query"]] = r["value"]
    fields = [pa.field(n, t) for n, t in DOCUMENT_COLUMNS] + [pa.field(c, t) for _, c, t in qcols]
    columns = {f.name: [] for f in fields}
    for d in docs.values():
        for n, _ in DOCUMENT_COLUMNS:
            columns[n].append(d[n])
        for q, c, t in qcols:
            if q.per_page:
                pages = sorted(d["_values"].get((q.name, "pages"), []), key=lambda x: x[0])
                columns[c].append([_cell(q, t.value_type, v) for _, v in pages] if pages else None)
            else:
                columns[c].append(_cell(q, t, d["_values"].get(q.name)))
    return pa.Table.from_pydict(columns, schema=pa.schema(fields))
