"""Pure helpers of the pipeline and the CLI."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import typer

from docproc.cli import parse_formats
from docproc.pipeline.evaluate import _f1, _norm
from docproc.pipeline.normalize import normalize_amount, normalize_date
from docproc.pipeline.queries import QueryFileError, build_prompt, load_queries, parse_answer
from docproc.pipeline.runstore import json_relpath

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,iso", [("2024-03-01", "2024-03-01"), ("01.03.2024", "2024-03-01"),
                                      ("March 01, 2024", "2024-03-01"), ("1 Mar 2024", "2024-03-01"),
                                      ("31/12/2024", "2024-12-31"), ("2024-02-30", None), ("soon", None),
                                      ("2023/09/02", "2023-09-02"), ("2023.09.02", "2023-09-02"),
                                      ("02-09-2023", "2023-09-02"), ("2023-09-02T00:00:00", "2023-09-02"),
                                      ("2023-09-02 14:30:00+02:00", "2023-09-02"), ("20230902", "2023-09-02"),
                                      ("2023/09-02", None), ("20231302", None), ("2023-09-02T", None)])
def test_normalize_date(text, iso):
    assert normalize_date(text) == iso


@pytest.mark.parametrize("text,value", [("1,234.56", "1234.56"), ("1.234,56", "1234.56"), ("1 234,56", "1234.56"),
                                        ("EUR 12.5", "12.50"), ("1.000", "1000.00"), ("-3,5", "-3.50"),
                                        ("n/a", None), ("12-34", None)])
def test_normalize_amount(text, value):
    assert normalize_amount(text) == value


def test_parse_answer_by_type():
    assert parse_answer("number", "Total: 1.234,50 EUR") == ("1234.50", None)
    assert parse_answer("date", "None") == (None, None)
    assert parse_answer("date", "tomorrow")[1].startswith("not a date")
    assert parse_answer("json", 'here {"b": 1, "a": "x"} done') == ('{"a": "x", "b": 1}', None)
    assert parse_answer("json", "[1, 2]")[1] == "no JSON object in the answer"
    assert parse_answer("string", "  Acme Corp ") == ("Acme Corp", None)


def test_query_file_errors(tmp_path):
    qs = load_queries()
    assert [q.name for q in qs.queries][:2] == ["vendor", "invoice_number"] and len(qs.fingerprint) == 16
    for body, msg in [("x = 1", "unknown top-level key(s) 'x'"), ("name = 'x'", "no [[query]]"),
                      ("[[query]]\nname='a'", "needs a question"),
                      ("[[query]]\nname='a'\nquestion='q'\ntype='int'", "type 'int'"),
                      ("[[query]]\nname='a'\nquestion='q'\n[[query]]\nname='a'\nquestion='r'", "appears twice"),
                      ("[[query]]\nname=\"a\\nb\"\nquestion='q'", "holds a control character"),
                      ("[[query]]\nname=\"a\u2028b\"\nquestion='q'", "holds a control character"),
                      ("[[query]]\nname='Total'\nquestion='q'\n[[query]]\nname='total'\nquestion='r'",
                       "'Total' and 'total' differ only in case"),
                      ("[[query]]\nname='caf\u00e9'\nquestion='q'\n[[query]]\nname='cafe\u0301'\nquestion='r'",
                       "differ only in case or Unicode composition"),
                      ("[[query", "not valid TOML"),
                      ("[[query]]\nname='a'\nquestion='q'\ntype='json'\nschema={type='number', maximum=nan}",
                       "its schema cannot be used: nan or inf is not a JSON number"),
                      ("[[query]]\nname='a'\nquestion='q'\ntype='json'\nschema={maximum=" + "9" * 5000 + "}",
                       "is not valid TOML: a whole number of more than 4,300 digits"),
                      ("[[query]]\nname='a'\nquestion='q'\ntype='json'\nschema={type='string', const=2023-01-01}",
                       "2023-01-01 is a TOML date or time, not a JSON value"),
                      ("[[query]]\nname='a'\nquestion='q'\ntype='json'\nschema_file='nan.json'",
                       "nan.json is not valid JSON: NaN is not a JSON number")]:
        (tmp_path / "nan.json").write_text('{"type": "number", "maximum": NaN}')
        f = tmp_path / "q.toml"
        f.write_text(body)
        with pytest.raises(QueryFileError, match=re.escape(msg)):
            load_queries(f)
    with pytest.raises(QueryFileError, match="does not exist"):
        load_queries(tmp_path / "none.toml")
    f.write_text("[[query]]\nname='m\u06cc\u200c\u062e'\nquestion='q'")  # a zero-width non-joiner (Persian)
    assert load_queries(f).queries[0].name == "m\u06cc\u200c\u062e"
    # the question as the prompt takes it: a multi-line string's newline, or spaces around it, are
    # not an edit (they would change the fingerprint and redo every document)
    f.write_text("[[query]]\nname='a'\nquestion='What is it?'")
    plain = load_queries(f)
    f.write_text('[[query]]\nname=\'a\'\nquestion="""\n  What is it?\n"""')
    assert load_queries(f).queries[0].question == "What is it?" and load_queries(f).fingerprint == plain.fingerprint


def test_prompt_has_one_placeholder_per_page():
    p = build_prompt(3, "What is the total?")
    assert p.count("<|image_pad|>") == 3 and p.endswith("<|im_start|>assistant\n")


def test_parse_formats():
    assert parse_formats("json,parquet") == ("json", "parquet")
    assert parse_formats(" parquet ") == ("parquet",)
    assert parse_formats("CSV,jsonl,csv") == ("csv", "jsonl")
    with pytest.raises(typer.BadParameter):
        parse_formats("xlsx")
    with pytest.raises(typer.BadParameter):
        parse_formats("")


def test_json_names_never_leave_the_folder_fail_or_clash():
    assert str(json_relpath("a/b.png")) == "a/b.png.json"
    assert str(json_relpath("/abs/x.pdf")) == "abs/x.pdf.json"
    keys = ["../../etc/passwd", "a/../b.png", "a/./b.png", "r\\xe4.png", "x" * 300 + ".png", "tab\there.png",
            "a.png.json/b.png", "a/b.png", "a/b.png~0123456789ab"]
    names = [json_relpath(k) for k in keys]
    assert len(set(names)) == len(keys)  # distinct keys, distinct files
    for n in names:
        assert ".." not in n.parts and not n.is_absolute() and all(len(p.encode()) <= 143 for p in n.parts)
    assert names[0].name.startswith("passwd~") and names[3].name.startswith("r_xe4.png~")


def test_eval_normalisation_and_f1():
    assert _norm("number", "EUR 1.234,50") == _norm("number", "1234.5") == "1234.50"
    assert _norm("date", "March 1, 2024") == "2024-03-01"
    assert _norm("string", "  ACME  Corp ") == "acme corp"
    assert _f1("acme corp", "acme corp ltd") == pytest.approx(0.8)
    assert _f1(None, None) == 1.0 and _f1("x", None) == 0.0


@pytest.mark.slow
def test_anchor_text_holds_every_printed_field_with_coordinates(tmp_path):
    from fixtures.documents import generate

    from docproc.pipeline.ingest import ANCHOR_MAX_CHARS, discover, open_document

    records = {r["file"]: r for r in generate(tmp_path, 4, seed=5, formats=("pdf", "png"), max_pages=2)}
    seen = set()
    for cand in discover([str(tmp_path)]):
        if cand.skip_reason:
            continue
        doc = open_document(cand, with_text=True)
        texts = [doc.page(i).text for i in range(doc.num_pages)]
        rec = records[cand.path.name]
        seen.add(rec["format"])
        if rec["format"] != "pdf":
            assert texts == [None] * doc.num_pages  # a scan has no text layer
            continue
        assert all(t.startswith("Page size: ") and len(t) <= ANCHOR_MAX_CHARS + 6 for t in texts)
        joined = "\n".join(texts)
        for value in rec["fields"].values():
            if value is not None and not any("[...]" in t for t in texts):
                assert value in joined
        first = texts[0].splitlines()[1]
        assert first.startswith("[") and "]" in first  # [x,y]text
        doc.close()
        assert open_document(cand).page(0).text is None  # only on request
    assert seen == {"pdf", "png"}


def test_a_pdf_named_as_an_image_is_read_as_a_pdf(tmp_path):
    from docproc.pipeline.ingest import discover, open_document

    shutil.copy(ROOT / "sample_docs" / "doc_2026_00001.pdf", tmp_path / "scan.png")
    (tmp_path / "bad.png").write_bytes(b"not an image %PDF-1.7")
    found = {c.path.name: c for c in discover([str(tmp_path)])}
    assert found["scan.png"].doc_type == "pdf" and found["bad.png"].doc_type == "image"
    doc = open_document(found["scan.png"])
    assert doc.num_pages >= 1 and doc.page(0).image.width > 100
    doc.close()


def test_a_folder_that_can_be_listed_but_not_searched_is_one_error_row(tmp_path, monkeypatch):
    """A folder of mode r-- names entries that lstat refuses: the folder is one unlistable_folder
    row (OUT keeps what it holds from it, as for a folder that cannot be listed), not an error row
    per file over each finished document; the rest of the input is found."""
    import errno
    import os

    from docproc.pipeline.ingest import discover

    (tmp_path / "sub" / "deep").mkdir(parents=True)
    for name in ("a.png", "sub/b.png", "sub/deep/c.png"):
        (tmp_path / name).write_bytes(b"x")
    lstat = os.lstat

    def refusing(path, *a, **kw):
        if os.path.dirname(os.fspath(path)) == str(tmp_path / "sub"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return lstat(path, *a, **kw)

    monkeypatch.setattr(os, "lstat", refusing)
    found = {c.rel: c for c in discover([str(tmp_path)])}
    assert set(found) == {"a.png", "sub/"} and not found["a.png"].skip_reason
    assert found["sub/"].kind == "unlistable_folder" and "listed but not searched" in found["sub/"].skip_reason


def test_a_json_folder_linked_into_an_input_is_not_searched(tmp_path):
    from docproc.pipeline.ingest import discover
    from docproc.pipeline.runstore import RunStore

    (tmp_path / "in" / "answers").mkdir(parents=True)
    (tmp_path / "in" / "a.png").write_bytes(b"x")
    (tmp_path / "in" / "answers" / "a.png.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "json").symlink_to(tmp_path / "in" / "answers")
    found = [c.rel for c in discover([str(tmp_path / "in")], exclude=RunStore(tmp_path / "out").own_folders())]
    assert found == ["a.png"]


def test_anchor_text_goes_between_the_images_and_the_question():
    p = build_prompt(2, "What is the total?", "Page 1:\nPage size: 595x842\n[36,76]Total 12.00")
    assert p.index("<|vision_end|>Document text:\nPage 1:") > 0
    assert p.index("[36,76]Total 12.00\nWhat is the total?") > p.rindex("<|vision_end|>")
    assert build_prompt(1, "Q?", None) == build_prompt(1, "Q?")


def test_compare_runs_scores_the_documents_both_runs_finished(tmp_path):
    """scripts/compare_runs.py: exact match per run and identical answers, on common documents only."""
    import subprocess
    import sys

    def run(name, docs):
        (tmp_path / name / "json").mkdir(parents=True)
        for doc, values in docs.items():
            rec = {"path": doc, "doc_status": "ok",
                   "queries": [{"query": q, "value": v} for q, v in values.items()]}
            (tmp_path / name / "json" / f"{doc}.json").write_text(json.dumps(rec))

    run("a", {"d1.pdf": {"total": "1,000.00", "vendor": "Acme"}, "d2.pdf": {"total": "5", "vendor": "X"},
              "d3.pdf": {"total": "9", "vendor": "Y"}})
    run("b", {"d1.pdf": {"total": "1000", "vendor": "Acme"}, "d2.pdf": {"total": "6", "vendor": "X"}})
    truth = tmp_path / "truth.jsonl"
    truth.write_text("\n".join(json.dumps({"file": f"docs/{d}", "fields": f}) for d, f in
                               (("d1.pdf", {"total": "1000.00", "vendor": "Acme"}),
                                ("d2.pdf", {"total": "5", "vendor": "X"}),
                                ("d3.pdf", {"total": "9", "vendor": "Y"}))))
    script = Path(__file__).resolve().parent.parent / "scripts" / "compare_runs.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "a"), str(tmp_path / "b"), "--truth",
                          str(truth)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["documents"] == 2 and r["fields"] == 4  # d3 is not in b
    assert r["exact_match"] == {str(tmp_path / "a"): 1.0, str(tmp_path / "b"): 0.75}  # amounts normalised
    assert r["identical_answers"] == 0.5 and r["difference_points"] == -25.0


def test_query_rules_accept_what_the_normaliser_reads_and_nothing_else():
    """The date and number rules (decoded under with xgrammar, checked after without it) accept
    every printed form of the generator's truth and of sample_docs, and refuse what the
    normaliser cannot read; every accepted date normalises to ISO, every number to a decimal."""
    from docproc.pipeline.constraints import answer_allowed
    from docproc.pipeline.normalize import normalize_amount, normalize_date

    truth = [json.loads(x) for x in (Path(__file__).parent.parent / "sample_docs" / "truth.jsonl").read_text().splitlines()]
    dates = [r["fields"][f] for r in truth for f in ("date", "due_date") if r["fields"][f]]
    amounts = [r["fields"]["total"] for r in truth]
    dates += ["2024-12-31", "31.12.2024", "12/31/2024", "December 31, 2024", "Dec. 31, 2024", "31 Dec 2024", "none"]
    amounts += ["$1,234.56", "1 234,56 EUR", "CHF 99.90", "-5.00", "1'000.50", "none"]
    for d in dates:
        assert answer_allowed("date", d) is None, d
        assert d == "none" or normalize_date(d) is not None, d
    for a in amounts:
        assert answer_allowed("number", a) is None, a
        assert a == "none" or normalize_amount(a) is not None, a
    for bad in ["next Tuesday", "2024", "31.12.24", "31x12x2024", "12 12 2024", "Dec 31 2024 at noon"]:
        assert answer_allowed("date", bad) is not None, bad
    for bad in ["twelve", "1.234.5678", "12 items", "1,2,3", "(12.00)"]:
        assert answer_allowed("number", bad) is not None, bad
    # printed forms of other places (Indian grouping, a Unicode minus, a no-break space, lower case)
    for a in ["1,23,456.00", "-$12.00", "\u221212.00", ".50", "1\u00a0234,56", "chf 12", "\u20b91,234.00"]:
        assert answer_allowed("number", a) is None and normalize_amount(a) is not None, a
    for d in ["december 31, 2024", "31  December 2024", "31.12.2024."]:
        assert answer_allowed("date", d) is None and normalize_date(d) is not None, d
    # what the parser reads as no answer is no breach when answers are checked
    for none in ["", "N/A", "-", "None.", " none "]:
        assert answer_allowed("date", none) is None and parse_answer("date", none) == (None, None), none
    assert answer_allowed("string", "Acme GmbH") is None and answer_allowed("string", "two\nlines") is not None
    assert answer_allowed("string", "two\nlines", constrained=False) is None
    assert answer_allowed("string", "maybe", choices=("yes", "no")) is not None


def test_schema_violation_finds_the_first_broken_rule():
    from docproc.pipeline.json_schema import violation

    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                             "c": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
    assert violation({"a": 1, "b": None}, schema) is None
    assert violation({"a": 1, "b": "s", "c": ["x"]}, schema) is None
    assert "'b' is a required property" in violation({"a": 1}, schema)
    assert violation({"a": 1.5, "b": None}, schema).startswith("$.a:")
    assert "minimum" in violation({"a": -1, "b": None}, schema)
    assert violation({"a": 1, "b": 3}, schema).startswith("$.b:")
    assert violation({"a": 1, "b": None, "c": ["z"]}, schema).startswith("$.c[0]:")
    assert "too long" in violation({"a": 1, "b": None, "c": ["x", "y", "x"]}, schema)
    assert "'d' was unexpected" in violation({"a": 1, "b": None, "d": 0}, schema)
    # JSON's own rules: true is not 1, NaN is no number, oneOf means exactly one
    assert violation(True, {"enum": [1, 2]}) and violation(False, {"const": 0})
    assert violation(1, {"enum": [1, 2]}) is None
    assert violation(float("nan"), {"type": "number"})
    assert violation(3, {"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert violation({"x": "s"}, {"type": "object", "additionalProperties": {"type": "integer"}})


def test_documents_table_types_each_query_by_its_type_and_schema(tmp_path):
    """documents.parquet: one row per document; number -> float64, date -> date32, a schema's
    object -> a struct typed by it (integer, number, boolean, format date, nested, arrays); a
    value that does not fit its type is null."""
    import datetime
    import pyarrow as pa

    from docproc.pipeline.queries import load_queries
    from docproc.pipeline.schema import to_table
    from docproc.pipeline.typed import documents_table

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "ok": {"type": "boolean"},
        "d": {"type": "string", "format": "date"}, "tags": {"type": "array", "items": {"type": "string"}},
        "who": {"type": "object", "properties": {"name": {"type": "string"}}}}}
    qfile = tmp_path / "q.toml"
    qfile.write_text('[[query]]\nname = "total"\nquestion = "?"\ntype = "number"\n\n'
                     '[[query]]\nname = "date"\nquestion = "?"\ntype = "date"\n\n'
                     '[[query]]\nname = "path"\nquestion = "?"\n\n'
                     '[[query]]\nname = "obj"\nquestion = "?"\ntype = "json"\nschema_file = "s.json"\n')
    (tmp_path / "s.json").write_text(json.dumps(schema))
    qs = load_queries(qfile)
    obj = {"n": 3, "x": 2.5, "ok": True, "d": "2024-02-29", "tags": ["a"], "who": {"name": "Bo"}}
    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1}
    rows = [{**base, "path": "a.pdf", "query": "total", "query_type": "number", "value": "12.50"},
            {**base, "path": "a.pdf", "query": "date", "query_type": "date", "value": "2024-01-31"},
            {**base, "path": "a.pdf", "query": "path", "query_type": "string", "value": "text"},
            {**base, "path": "a.pdf", "query": "obj", "query_type": "json", "value": json.dumps(obj)},
            {**base, "path": "b.pdf", "query": "obj", "query_type": "json", "value": json.dumps({"n": "three"})},
            {**base, "path": "c.pdf", "doc_status": "error", "status": "error", "query": None}]
    t = documents_table(to_table(rows), qs)
    assert t.num_rows == 3 and t.column_names[:5] == ["path", "root", "doc_sha256", "doc_status", "run_id"]
    assert t.schema.field("total").type == pa.float64() and t.schema.field("date").type == pa.date32()
    assert t.schema.field("query.path").type == pa.string()  # the document's own column keeps its name
    st = t.schema.field("obj").type
    assert [(st.field(i).name, str(st.field(i).type)) for i in range(st.num_fields)] == [
        ("n", "int64"), ("x", "double"), ("ok", "bool"), ("d", "date32[day]"), ("tags", "list<item: string>"),
        ("who", "struct<name: string>")]
    a, b, c = t.to_pylist()
    assert a["total"] == 12.5 and a["date"] == datetime.date(2024, 1, 31) and a["query.path"] == "text"
    assert a["obj"] == {**obj, "d": datetime.date(2024, 2, 29)}
    assert b["obj"]["n"] is None and b["total"] is None and c["obj"] is None and c["doc_status"] == "error"


def test_eval_scores_a_json_answer_field_by_field(tmp_path):
    """`docproc eval` scores each property of a JSON answer as QUERY.FIELD beside the per-field
    queries; a JSON answer with no object is wrong for every field the truth has."""
    import pyarrow.parquet as _pq

    from docproc.pipeline.evaluate import evaluate
    from docproc.pipeline.schema import to_table

    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1}
    rows = [{**base, "path": "a.pdf", "query": "total", "query_type": "number", "value": "10.00"},
            {**base, "path": "a.pdf", "query": "all_fields", "query_type": "json",
             "value": json.dumps({"total": "10,00", "date": "January 2, 2024", "vendor": None})},
            {**base, "path": "b.pdf", "query": "total", "query_type": "number", "value": "5.00"},
            {**base, "path": "b.pdf", "query": "all_fields", "query_type": "json", "value": None,
             "status": "parse_error"}]
    (tmp_path / "out").mkdir()
    _pq.write_table(to_table(rows), tmp_path / "out" / "results.parquet")
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps(r) + "\n" for r in [
        {"file": "a.pdf", "fields": {"total": "10.00", "date": "2024-01-02", "vendor": "Acme"}},
        {"file": "b.pdf", "fields": {"total": "5.00", "date": "2024-01-03", "vendor": None}}]))
    res = evaluate(tmp_path / "out", truth)
    pf = res["per_field"]
    assert pf["total"] == {"exact_match": 1.0, "f1": 1.0, "n": 2}
    assert pf["all_fields.total"]["exact_match"] == 0.5 and pf["all_fields.date"]["exact_match"] == 0.5
    # a's vendor null against Acme: wrong; b has no object, but its truth vendor is null: right
    assert pf["all_fields.vendor"]["exact_match"] == 0.5 and pf["all_fields.vendor"]["n"] == 2


def test_eval_reads_lists_collisions_and_non_object_roots(tmp_path):
    """Lists compare as JSON on both sides; a query's own answer wins over a JSON property of the
    same name; a schema whose root is a string is scored by its string; a failed JSON answer counts
    only for the fields its query answers elsewhere."""
    import pyarrow.parquet as _pq

    from docproc.pipeline.evaluate import evaluate
    from docproc.pipeline.schema import to_table

    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1}
    rows = [{**base, "path": "a.pdf", "query": "obj", "query_type": "json", "value": json.dumps({"items": ["a", "b"], "total": "1.00"})},
            {**base, "path": "a.pdf", "query": "obj.total", "query_type": "number", "value": "9.00"},
            {**base, "path": "a.pdf", "query": "vendor", "query_type": "json", "value": json.dumps("Acme Corp")},
            {**base, "path": "a.pdf", "query": "parties", "query_type": "json", "value": json.dumps({"vendor": "Acme Corp"})},
            {**base, "path": "b.pdf", "query": "parties", "query_type": "json", "value": None, "status": "parse_error"}]
    (tmp_path / "out").mkdir()
    _pq.write_table(to_table(rows), tmp_path / "out" / "results.parquet")
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps(r) + "\n" for r in [
        {"file": "a.pdf", "fields": {"items": ["a", "b"], "total": "9.00", "vendor": "Acme Corp"}},
        {"file": "b.pdf", "fields": {"total": "5.00", "vendor": "Bolt"}}]))
    pf = evaluate(tmp_path / "out", truth)["per_field"]
    assert pf["obj.items"]["exact_match"] == 1.0
    assert pf["obj.total"] == {"exact_match": 1.0, "f1": 1.0, "n": 1}  # the query's 9.00, not the property's 1.00
    assert pf["vendor"]["exact_match"] == 1.0
    assert pf["parties.vendor"] == {"exact_match": 0.5, "f1": 0.5, "n": 2} and "parties.total" not in pf


def test_eval_matches_documents_by_path_and_normalises_by_query_type(tmp_path):
    """Two documents of one file name in two folders: a truth record naming one by its path scores
    that one, a bare name they share is listed as ambiguous (not scored, not "missing"), a path
    from elsewhere that ends with a document's path names it, an unknown path is missing. A
    custom `number` or `date` query is normalised as its type says whatever its name; strings
    compare across Unicode composition; the format group is the document's own."""
    from docproc.pipeline.evaluate import _norm

    # a list is not an amount or a date (["7213.84"] matched the answer 7213.84)
    assert _norm("number", ["7213.84"]) != _norm("number", "7213.84") == _norm("number", 7213.84) == "7213.84"
    assert _norm("date", {"d": "2024-01-31"}) != _norm("date", "31.01.2024") == "2024-01-31"
    import unicodedata

    import pyarrow.parquet as _pq

    from docproc.pipeline.evaluate import evaluate, match_document
    from docproc.pipeline.schema import to_table

    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1}
    rows = [{**base, "path": "sub1/x.jpg", "query": "vendor", "query_type": "string", "value": "Tyrell"},
            {**base, "path": "sub2/x.jpg", "query": "vendor", "query_type": "string", "value": "Wayne"},
            {**base, "path": "a.pdf", "query": "amount", "query_type": "number", "value": "7213.84"},
            {**base, "path": "a.pdf", "query": "issued", "query_type": "date", "value": "2022-11-30"},
            {**base, "path": "a.pdf", "query": "label", "query_type": "string", "value": "café"}]
    (tmp_path / "out").mkdir()
    _pq.write_table(to_table(rows), tmp_path / "out" / "results.parquet")
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [
        {"file": "sub1/x.jpg", "fields": {"vendor": "Tyrell"}},
        {"file": "x.jpg", "fields": {"vendor": "Wayne"}},
        {"file": "sub9/x.jpg", "fields": {"vendor": "Wayne"}},
        {"file": "corpus/a.pdf", "fields": {"amount": "7 213,84", "issued": "30.11.2022",
                                             "label": unicodedata.normalize("NFD", "café")}}]))
    res = evaluate(tmp_path / "out", truth)
    assert res["per_field"]["vendor"] == {"exact_match": 1.0, "f1": 1.0, "n": 1}  # sub1's, not sub2's
    # sub9/x.jpg: no such folder, and its file name is two documents'
    assert res["ambiguous_documents"] == ["x.jpg", "sub9/x.jpg"] and res["documents"] == 2
    assert res["missing_documents"] == []
    assert all(res["per_field"][f]["exact_match"] == 1.0 for f in ("amount", "issued", "label"))
    assert res["by_format"] == {"pdf": {"exact_match": 1.0, "n": 3}, "scan": {"exact_match": 1.0, "n": 1}}
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"file": "a.pdf", "fields": {}}\n{"file": "./corpus/a.pdf", "fields": {}}\n')
    with pytest.raises(ValueError, match="'a.pdf' and './corpus/a.pdf' name one document"):
        evaluate(tmp_path / "out", twice)
    paths = {"sub1/x.jpg", "sub2/x.jpg", "a/b/c.pdf", "b/c.pdf"}
    by_name = {"x.jpg": ["sub1/x.jpg", "sub2/x.jpg"], "c.pdf": ["a/b/c.pdf", "b/c.pdf"]}
    assert match_document("./sub2/x.jpg", paths, by_name) == ("sub2/x.jpg", ["sub2/x.jpg"])
    assert match_document("in/a/b/c.pdf", paths, by_name)[0] == "a/b/c.pdf"  # the longest common ending
    assert match_document("z/b/c.pdf", paths, by_name)[0] == "b/c.pdf"
    assert match_document("z/c.pdf", paths, by_name) == (None, ["a/b/c.pdf", "b/c.pdf"])  # no folder lines up
    # folders that do not line up (another input's name): the one document of that file name
    assert match_document("corpus/y.pdf", paths | {"in2023/y.pdf"}, {"y.pdf": ["in2023/y.pdf"]})[0] == "in2023/y.pdf"
    assert match_document("sub//sub2/./x.jpg", paths, by_name)[0] == "sub2/x.jpg"
    assert match_document("q.pdf", paths, by_name) == (None, [])
    assert match_document("b/c.pdf", paths - {"b/c.pdf"}, {"c.pdf": ["a/b/c.pdf", "x/b/c.pdf"]}) == \
        (None, ["a/b/c.pdf", "x/b/c.pdf"])


def test_documents_table_keeps_colliding_names_apart_and_survives_odd_values():
    from docproc.pipeline.queries import Query, QuerySet
    from docproc.pipeline.schema import to_table
    from docproc.pipeline.typed import documents_table

    qs = QuerySet("x", (Query("path", "?"), Query("query.path", "?"), Query("Run_ID", "?"), Query("total", "?", "number"),
                        Query("o", "?", "json", schema=json.dumps({"type": "object", "properties": {"n": {"type": "number"}}}))), "")
    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1, "path": "a.pdf"}
    rows = [{**base, "query": "path", "query_type": "string", "value": "p"},
            {**base, "query": "query.path", "query_type": "string", "value": "qp"},
            {**base, "query": "Run_ID", "query_type": "string", "value": "r"},
            {**base, "query": "total", "query_type": "number", "value": "1" * 400},
            {**base, "query": "o", "query_type": "json", "value": '{"n": ' + "9" * 400 + "}"}]
    t = documents_table(to_table(rows), qs)
    row = t.to_pylist()[0]
    assert row["query.path"] == "p" and row["query.query.path"] == "qp"
    assert row["query.Run_ID"] == "r" and row["run_id"] == "r"  # (a column that differs from run_id by case only)
    assert row["total"] is None and row["o"] == {"n": None}  # past float64: null, not a crash or infinity


def test_documents_table_keeps_values_asked_under_an_earlier_type_where_they_fit():
    """A document of a root the run did not search keeps its rows of an earlier query set: a
    value asked as a number shows in the current string column, one asked as a string in a date
    column where it is a date; one that does not fit (text in a number column) is null."""
    import datetime

    from docproc.pipeline.queries import Query, QuerySet
    from docproc.pipeline.schema import to_table
    from docproc.pipeline.typed import documents_table

    qs = QuerySet("x", (Query("total", "?", "string"), Query("date", "?", "date"), Query("vendor", "?", "number")), "")
    base = {"run_id": "r", "doc_status": "ok", "status": "ok", "config_fingerprint": "c", "part": 1, "path": "a.pdf"}
    rows = [{**base, "query": "total", "query_type": "number", "value": "7213.84"},
            {**base, "query": "date", "query_type": "string", "value": "2023-01-11"},
            {**base, "query": "vendor", "query_type": "string", "value": "Acme"}]
    row = documents_table(to_table(rows), qs).to_pylist()[0]
    assert row["total"] == "7213.84" and row["date"] == datetime.date(2023, 1, 11) and row["vendor"] is None


def test_a_page_is_blank_only_without_ink_and_text():
    from PIL import Image

    from docproc.pipeline.ingest import Page

    white = Image.new("RGB", (400, 500), "white")
    assert Page(0, white, "", 400, 500).blank
    assert not Page(0, white, "", 400, 500, text="Invoice 42 (a text layer)").blank
    faint = Image.open(Path(__file__).parent.parent / "sample_docs" / "doc_2026_00003.jpg").convert("RGB")
    faint = Image.eval(faint, lambda v: 191 + v * 64 // 255)  # every pixel 191 or lighter, still legible
    assert not Page(0, faint, "", faint.width, faint.height).blank


def test_ray_options_are_checked_before_anything_runs(tmp_path, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from docproc.cli import app

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.png").write_bytes(b"x")
    out = tmp_path / "out"
    for extra, says in ((["--ray-address", "auto"], "go with --ray"),
                        (["--data-parallel-size", "2"], "go with --ray"),
                        (["--ray", "--data-parallel-size", "0"], "from 1 to 4096"),
                        (["--ray", "--device", "cuda:1"], "own GPU")):
        res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), *extra])
        assert res.exit_code == 2 and says in res.output, (extra, res.output)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--ray"])
    assert res.exit_code == 2 and "pip install 'docproc[ray]'" in res.output, res.output
    assert not out.exists()  # nothing was done


def test_byte_identical_files_renamed_together_each_move_their_own_rows():
    """Two removed documents with the same bytes and configuration: each later file with those
    bytes takes one of them (the one whose file it is, where known), none is left 'removed'."""
    from docproc.pipeline.reconcile import reconcile

    def rows(key):
        return [{"path": key, "root": "/in", "doc_sha256": "s1", "config_fingerprint": "c", "doc_status": "ok",
                 "pages": 1, "answer": "42"}]
    stored = rows("a.png") + rows("b.png") + rows("c.png")
    # b.png's file is found under another key now (a second root label); a.png and c.png are gone
    plan = reconcile(stored, found={"in/b.png": "/in", "x.png": "/in"}, searched_roots={"/in"}, unlisted=[],
                     files={"/in/b.png": "in/b.png"})
    assert set(plan.removed) == {"a.png", "b.png", "c.png"}
    assert plan.take_rename("s1", "c", "x.png")[0]["path"] == "a.png"  # a gone one first
    assert plan.take_rename("s1", "c", "y.png")[0]["path"] == "c.png"
    assert plan.take_rename("s1", "c", "z.png")[0]["path"] == "b.png"  # a copy: b's own file comes next
    assert plan.take_rename("s1", "c", "in/b.png")[0]["path"] == "b.png"  # its own file's rows
    assert plan.take_rename("s1", "c", "w.png") is None and not plan.renamed_from
