"""The tables of OUT as their readers see them: docs/outputs.md's reader snippets, run against the OUT of
a small run of the bundled model; results.csv and results.jsonl holding results.parquet's rows
and columns; each table rewritten with the results once it exists, following the umask."""
from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from docproc.cli import app
from docproc.pipeline.runstore import RunStore, atomic_write_table
from docproc.pipeline.schema import COLUMNS, RESULT_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
QUERIES = """
[[query]]
name = "total"
question = "What is the total amount?"
type = "number"
max_tokens = 16

[[query]]
name = "date"
question = "What is the invoice date?"
type = "date"
max_tokens = 20
"""


def readme_snippets() -> list[str]:
    """docs/outputs.md's Python blocks that read OUT, cut at blank lines: one snippet per reader."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs/outputs.md").read_text(), re.S | re.M)
    return [s.strip() for b in blocks if '"out/results.' in b for s in re.split(r"\n\s*\n", b) if s.strip()]


SNIPPETS = readme_snippets()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """OUT of `docproc run --format json,parquet,csv,jsonl,documents` over one page, a damaged PDF
    (an error row, nulls) and a text file (a skipped row), at TMP/out."""
    tmp = tmp_path_factory.mktemp("readers")
    inputs = tmp / "in"
    inputs.mkdir()
    page = Image.new("RGB", (300, 200), "white")
    ImageDraw.Draw(page).text((20, 20), "Total: 12.50 EUR  Date: 2024-01-31", fill="black")
    page.save(inputs / "a.png")
    (inputs / "broken.pdf").write_bytes(b"%PDF-1.7 not really")
    (inputs / "notes.txt").write_text("not a document, \"quoted\",\nover two lines")
    (tmp / "queries.toml").write_text(QUERIES)
    res = CliRunner().invoke(app, ["run", str(inputs), "--out", str(tmp / "out"), "--device", "cpu", "--quiet",
                                   "--queries", str(tmp / "queries.toml"),
                                   "--format", "json,parquet,csv,jsonl,documents"])
    assert res.exit_code == 1, res.output  # broken.pdf
    return tmp / "out"


def test_the_docs_have_a_snippet_for_each_reader():
    imports = {re.match(r"(?:import|from) (\w+)", s).group(1) for s in SNIPPETS}
    assert imports >= {"pyarrow", "pandas", "polars", "duckdb", "json"}
    assert any("results.csv" in s for s in SNIPPETS) and any("results.jsonl" in s for s in SNIPPETS)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.splitlines()[0] + (" csv" if ".csv" in s else "")
                                                   for s in SNIPPETS])
def test_each_reader_snippet_reads_every_row_once(snippet, out, monkeypatch):
    for module in re.findall(r"^(?:import|from) (\w+)", snippet, re.M):
        pytest.importorskip(module)
    monkeypatch.chdir(out.parent)
    names: dict = {}
    exec(snippet, names)
    results = pq.read_table(out / "results.parquet")
    assert results.num_rows == 4  # a.png x 2 queries, broken.pdf, notes.txt
    assert len(names["results"]) == results.num_rows
    if "documents" in names:
        assert len(names["documents"]) == 3


@pytest.mark.slow
def test_the_folder_is_not_one_parquet_dataset(out):
    """What docs/outputs.md says of reading OUT as a folder: its JSON files are taken for Parquet."""
    import pyarrow.dataset as ds

    with pytest.raises(pa.ArrowInvalid):
        ds.dataset(out).to_table()
    assert not [p for p in out.rglob("*.parquet") if p.name not in ("results.parquet", "documents.parquet")]


def _read_csv(path: Path, schema: pa.Schema) -> pa.Table:
    options = pcsv.ConvertOptions(column_types={f.name: f.type for f in schema}, strings_can_be_null=True,
                                  quoted_strings_can_be_null=False)
    return pcsv.read_csv(path, convert_options=options)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _as_json(rows: list[dict]) -> list[dict]:
    return json.loads(json.dumps(rows, default=lambda v: v.isoformat()))


@pytest.mark.slow
def test_csv_and_jsonl_hold_the_parquet_rows_and_columns(out):
    parquet = pq.read_table(out / "results.parquet")
    csv = _read_csv(out / "results.csv", RESULT_SCHEMA)
    assert csv.column_names == COLUMNS == parquet.column_names
    assert csv.to_pylist() == parquet.to_pylist()
    assert _jsonl(out / "results.jsonl") == parquet.to_pylist()
    rows = parquet.to_pylist()
    # nulls and texts in the same columns (null and "" stay apart in CSV)
    assert {r["status"] for r in rows} >= {"error", "skipped"} and any(r["query"] is None for r in rows)
    assert any(r["value"] is None for r in rows) and any(r["value"] is not None for r in rows)

    documents = pq.read_table(out / "documents.parquet")
    assert documents.schema.field("date").type == pa.date32() and documents.schema.field("total").type == pa.float64()
    assert _read_csv(out / "documents.csv", documents.schema).to_pylist() == documents.to_pylist()
    assert _jsonl(out / "documents.jsonl") == _as_json(documents.to_pylist())


def _row(path: str, query: str | None, value, part: int = 1) -> dict:
    return {"run_id": "r1", "path": path, "root": "/in", "doc_status": "ok", "query": query, "query_type": "string",
            "answer": value, "value": value, "status": "ok", "config_fingerprint": "cfg", "part": part}


def test_each_table_is_rewritten_with_the_results_once_it_exists_and_follows_the_umask(tmp_path):
    store = RunStore(tmp_path / "out")
    store.write_part(1, [_row("a.png", "q", "=1+1"), _row("b.png", "q", 'say "hi",\nthen go'),
                         _row("c.png", "q", "")])
    saved = os.umask(0o027)
    try:
        store.consolidate(formats=("json", "csv"))  # csv without parquet: results.csv alone
        assert not (store.out / "results.parquet").exists() and not (store.out / "results.jsonl").exists()
        assert (store.out / "results.csv").stat().st_mode & 0o777 == 0o640
        csv = _read_csv(store.out / "results.csv", RESULT_SCHEMA).to_pylist()
        assert [r["value"] for r in csv] == ["=1+1", 'say "hi",\nthen go', ""]  # "" is not null
        assert csv[0]["error"] is None

        store.write_part(2, [_row("b.png", "q", "again", part=2)])
        store.consolidate(formats=("parquet", "jsonl"))  # results.csv is there: rewritten too
    finally:
        os.umask(saved)
    want = pq.read_table(store.out / "results.parquet").to_pylist()
    assert [(r["value"], r["part"]) for r in want] == [("=1+1", 1), ("again", 2), ("", 1)]
    assert _read_csv(store.out / "results.csv", RESULT_SCHEMA).to_pylist() == want
    assert _jsonl(store.out / "results.jsonl") == want
    assert not [p for p in store.out.iterdir() if p.name.startswith(".tmp-")]


def test_documents_tables_where_asked_and_wherever_one_exists(tmp_path):
    store = RunStore(tmp_path / "out")
    table = pa.table({"path": ["a.png"], "total": [1.5]})
    store.write_documents(table, ("parquet", "csv", "documents"))
    assert sorted(p.name for p in store.out.iterdir()) == ["documents.csv", "documents.parquet"]
    assert store.writes_documents(("parquet", "jsonl"))  # documents.parquet and .csv are there
    store.write_documents(table.set_column(1, "total", pa.array([2.0])), ("json",))
    assert _read_csv(store.out / "documents.csv", table.schema).column("total").to_pylist() == [2.0]
    assert not RunStore(tmp_path / "other").writes_documents(("parquet", "csv"))


def test_nested_and_typed_columns_in_csv_and_jsonl(tmp_path):
    """documents.parquet's typed columns: a struct and a list as JSON text in CSV and as JSON in
    JSON lines, dates as ISO text, booleans, text beyond ASCII."""
    struct = pa.struct([("vendor", pa.string()), ("due", pa.date32()), ("lines", pa.list_(pa.float64()))])
    table = pa.table({
        "path": ["a.pdf", "b.pdf"],
        "date": pa.array([datetime.date(2024, 1, 31), None], type=pa.date32()),
        "paid": pa.array([True, None], type=pa.bool_()),
        "vendor": ["Müller & Söhne, \"GmbH\"", None],
        "all": pa.array([{"vendor": "Ünal", "due": datetime.date(2024, 2, 1), "lines": [1.5, 2.0]}, None],
                        type=struct),
    })
    atomic_write_table(tmp_path / "t.csv", table)
    atomic_write_table(tmp_path / "t.jsonl", table)
    rows = _jsonl(tmp_path / "t.jsonl")
    assert rows == _as_json(table.to_pylist())
    assert rows[0]["all"] == {"vendor": "Ünal", "due": "2024-02-01", "lines": [1.5, 2.0]}
    flat = pa.schema([f if f.name != "all" else pa.field("all", pa.string()) for f in table.schema])
    csv = _read_csv(tmp_path / "t.csv", flat).to_pylist()
    assert json.loads(csv[0]["all"]) == rows[0]["all"] and csv[1]["all"] is None
    assert [{k: v for k, v in r.items() if k != "all"} for r in csv] == \
        [{k: v for k, v in r.items() if k != "all"} for r in table.to_pylist()]
