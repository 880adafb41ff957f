"""Per-page queries: a query asked of each page alone, one row per page (a page's text, as olmOCR
and marker users expect), beside the queries asked of the whole document."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent

QUERIES = '''name = "per-page"
[[query]]
name = "total"
question = "What is the total amount?"
type = "number"
max_tokens = 12

[[query]]
name = "page_text"
question = "Transcribe this page."
type = "string"
per_page = true
max_tokens = 6
'''


def test_a_per_page_query_answers_each_page_in_its_own_row(tmp_path, qwen2_vl_dir):
    """A 2-page PDF: the document query has one row, the per-page query one row a page (page 1,
    2), each asked of its page alone; the JSON file lists the pages'
    values, documents.parquet holds them as a list, the fingerprint changes with per_page."""
    import pyarrow.parquet as pq

    from docproc.cli import app
    from docproc.pipeline.queries import load_queries

    import pymupdf

    docs = tmp_path / "in"
    docs.mkdir()
    shutil.copy(ROOT / "sample_docs" / "doc_2026_00001.pdf", docs / "two.pdf")
    src, mid = pymupdf.open(docs / "two.pdf"), pymupdf.open()  # its two pages with a blank one between
    mid.insert_pdf(src, from_page=0, to_page=0)
    mid.new_page(width=src[0].rect.width, height=src[0].rect.height)
    mid.insert_pdf(src, from_page=1, to_page=1)
    mid.save(tmp_path / "mid.pdf")
    q = tmp_path / "q.toml"
    q.write_text(QUERIES)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(q), "--device", "cpu",
                                   "--model", str(qwen2_vl_dir), "--format", "json,parquet,documents", "--quiet"])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    got = sorted((r["path"], r["query"], r["page"]) for r in rows)
    assert got == [("two.pdf", "page_text", 1), ("two.pdf", "page_text", 2), ("two.pdf", "total", None)]
    # each page asked alone: a one-page prompt (fewer prompt tokens than the two-page document's)
    two = {(r["query"], r["page"]): r for r in rows if r["path"] == "two.pdf"}
    assert two[("page_text", 1)]["prompt_tokens"] < two[("total", None)]["prompt_tokens"]
    doc = json.loads((out / "json" / "two.pdf.json").read_text())
    assert doc["fields"]["page_text"] == [two[("page_text", 1)]["value"], two[("page_text", 2)]["value"]]
    table = pq.read_table(out / "documents.parquet").to_pylist()
    assert {d["path"]: len(d["page_text"]) for d in table} == {"two.pdf": 2}
    # a blank page inside a document: its per-page row is empty, never asked (a model asked about
    # a page with nothing on it invents an answer); the pages around it are asked as before
    shutil.move(tmp_path / "mid.pdf", docs / "mid.pdf")
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(q), "--device", "cpu",
                                   "--model", str(qwen2_vl_dir), "--format", "json,parquet,documents", "--quiet"])
    assert res.exit_code == 0, res.output
    mid = {r["page"]: r for r in pq.read_table(out / "results.parquet").to_pylist()
           if r["path"] == "mid.pdf" and r["query"] == "page_text"}
    assert sorted(mid) == [1, 2, 3] and mid[2]["status"] == "empty" and mid[2]["value"] is None
    assert mid[2]["prompt_tokens"] == 0 and mid[1]["prompt_tokens"] > 0 and mid[3]["prompt_tokens"] > 0
    assert mid[1]["answer"] == two[("page_text", 1)]["answer"] and mid[3]["answer"] == two[("page_text", 2)]["answer"]
    plain = tmp_path / "plain.toml"
    plain.write_text(QUERIES.replace("per_page = true\n", ""))
    assert load_queries(plain).fingerprint != load_queries(q).fingerprint
    bad = tmp_path / "bad.toml"
    bad.write_text(QUERIES.replace("per_page = true", 'per_page = "yes"'))
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(tmp_path / "o2"), "--queries", str(bad)])
    assert res.exit_code == 2 and "per_page must be true or false" in res.output
