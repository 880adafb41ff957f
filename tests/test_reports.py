"""`docproc stats` and `docproc eval` on damaged or unfinished output folders and truth files:
every answer is a report or one line naming the file and the fix, never a traceback. The folders
are written by hand (RunStore, the result schema), without a model."""
from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from docproc.cli import app
from docproc.pipeline.runstore import RunStore, atomic_write_table
from docproc.pipeline.schema import to_table

cli = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """The report's text as a log file gets it (200 columns): the module's console is made once a
    process, and a test before this one may have run with COLUMNS set."""
    from docproc import cli as module

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(module, "out_console", module._console())
QUERIES = ("vendor", "total")
FIRST = "20250103T100000000000Z-aaaaaa"  # run ids as Pipeline makes them: their start time first
KILLED = "20250103T110000000000Z-bbbbbb"


def doc_rows(run_id: str, path: str, status: str = "ok", latency: float = 2.0) -> list[dict]:
    """One document's rows: a row per query, or one row of no query for a file that failed."""
    base = {"run_id": run_id, "path": path, "doc_sha256": "0" * 64, "pages": 2, "config_fingerprint": "cfg1",
            "part": 1}
    if status == "error":
        return [{**base, "pages": None, "doc_status": "error", "status": "error", "error": "not a PDF",
                 "error_kind": "input"}]
    return [{**base, "doc_status": status, "query": q, "query_type": "string", "answer": "x", "value": "x",
             "status": "ok", "prompt_tokens": 100, "cached_tokens": 40, "generated_tokens": 5, "draft_proposed": 0,
             "draft_accepted": 0, "draft_verifications": 0, "latency_s": latency} for q in QUERIES]


def manifest(run_id: str, started_at: str, documents: int) -> dict:
    totals = {"files": documents, "documents": documents, "ok": documents, "partial": 0, "errors": 0,
              "skipped": 0, "already_done": 0, "moved": 0, "removed": 0, "pages": 2 * documents,
              "unique_pages": 2 * documents, "generated_tokens": 10 * documents}
    return {"run_id": run_id, "started_at": started_at, "seconds": 3.5, "status": "completed", "fault": None,
            "totals": totals, "tokens_per_second": 12.5, "acceptance_rate": None, "prefix_cache_hit_rate": 0.4,
            "dedup": {"pages": 2 * documents, "unique_pages": 2 * documents, "vision_encodes": 2 * documents},
            "model": {"path": "m"}, "config_fingerprint": "cfg1", "stage_seconds": {"engine": 2.0},
            "peak_memory": {}, "exit_code": 0}


def stats(out, *args):
    return cli.invoke(app, ["stats", str(out), *args])


# ---- docproc eval: the truth file ------------------------------------------------------------

GOOD = json.dumps({"file": "a.pdf", "fields": {"vendor": "Acme"}})
RECORD = 'a record must be a JSON object with "file" (a string) and "fields" (an object)'


@pytest.fixture
def scored_out(tmp_path):
    out = tmp_path / "out"
    atomic_write_table(out / "results.parquet", to_table(doc_rows(FIRST, "a.pdf")))
    return out


@pytest.mark.parametrize("line, line_number, message", [
    ("[1, 2]", 3, f"{RECORD}; got a list"),
    ("null", 3, f"{RECORD}; got null"),
    ('"a.pdf"', 3, f"{RECORD}; got a string"),
    ("7", 3, f"{RECORD}; got a number"),
    ('{"file": "a.pdf", "fields": ["vendor"]}', 3, '"fields" must be an object (field name -> expected value); '
                                                   'got a list'),
    ('{"file": 7, "fields": {}}', 3, '"file" must be the document\'s file name (a string); got a number'),
    ('{"fields": {"vendor": "Acme"}}', 3, f'{RECORD}; "file" is missing'),
    ('{"file": "a.pdf"}', 3, f'{RECORD}; "fields" is missing'),
    ('{"file": "a.pdf", "fields": {', 3, "not JSON (Expecting property name enclosed in double quotes at column 30); "
                                                 f"{RECORD}, one per line"),
    ('{"file": "a.pdf", "fields": {"vendor": "Acme Ltd"}}', 3,  # (it was scored twice: two documents of one)
     "a second record for 'a.pdf' (the first is on line 1): one record per file"),
    ('{"file": "b.pdf", "fields": {"total": NaN}}', 3, f"not JSON (NaN is not a JSON number); {RECORD}, one per line"),
    ('{"file": "b.pdf", "fields": {"total": ' + "9" * 5000 + '}}', 3,  # (it told of sys.set_int_max_str_digits)
     f"not JSON (a whole number of more than 4,300 digits); {RECORD}, one per line"),
])
def test_eval_names_the_truth_line_and_what_it_must_hold(scored_out, tmp_path, line, line_number, message):
    """A bad record after a good one and a blank line: exit 2 and one line naming the file, the
    line (blank lines counted) and what a record must hold; nothing is scored."""
    truth = tmp_path / "truth.jsonl"
    truth.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(truth), "--json"])
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and isinstance(res.exception, SystemExit)
    assert res.stderr == f"error: {truth} line {line_number}: {message}\n"


def test_eval_refuses_a_truth_file_it_cannot_read(scored_out, tmp_path):
    folder = tmp_path / "truths"
    folder.mkdir()
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(GOOD.encode() + b"\n" + '{"file": "é.pdf", "fields": {}}'.encode("latin-1") + b"\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    for path, expected in [(folder, f"{folder} is a folder: pass the truth file itself"),
                           ("/dev/zero", "/dev/zero is over 256 MiB"),  # (read whole, it took all memory)
                           (not_utf8, f"{not_utf8} line 2: not UTF-8 text (byte 11 of the line is 0xe9)"),
                           (tmp_path / "none.jsonl", f"{tmp_path / 'none.jsonl'} does not exist"),
                           (empty, f"{empty} holds no records")]:
        res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(path)])
        assert res.exit_code == 2 and res.stderr.startswith(f"error: {expected}"), res.stderr
        assert res.stderr.count("\n") == 1 and res.stdout == ""


def test_eval_refuses_a_results_file_that_is_not_parquet(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.parquet").write_bytes(b"PAR1 cut short")
    truth = tmp_path / "truth.jsonl"
    truth.write_text(GOOD + "\n")
    res = cli.invoke(app, ["eval", str(tmp_path / "out"), "--truth", str(truth)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith(f"error: {tmp_path / 'out' / 'results.parquet'} cannot be read as Parquet (")
    assert res.stderr.endswith("again to rewrite it\n") and res.stderr.count("\n") == 1


def test_eval_scores_a_truth_file_with_blank_lines_and_a_bom(scored_out, tmp_path):
    truth = tmp_path / "truth.jsonl"
    truth.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n\r\n")
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(truth), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["per_field"]["vendor"] == {"exact_match": 0.0, "f1": 0.0, "n": 1}


def test_eval_reads_the_state_so_any_format_and_a_killed_run_are_scored(tmp_path):
    """The answers as they stand: an OUT written with --format csv (no results.parquet) and a run
    killed before its end are scored from the state's rows."""
    out = tmp_path / "out"
    RunStore(out).write_part(1, doc_rows(KILLED, "a.pdf"))
    truth = tmp_path / "truth.jsonl"
    truth.write_text(json.dumps({"file": "a.pdf", "fields": {"vendor": "x"}}) + "\n")
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["per_field"]["vendor"] == {"exact_match": 1.0, "f1": 1.0, "n": 1}
    res = cli.invoke(app, ["eval", str(tmp_path), "--truth", str(truth)])  # (a folder with no answers)
    assert res.exit_code == 2 and res.stderr == f"error: no answers in {tmp_path}: run `docproc run ... " \
                                                f"--out {tmp_path}` first\n"


def test_eval_with_nothing_to_compare_says_why_and_exits_1(scored_out, tmp_path):
    """No score of nothing: documents not in OUT, or queries that name none of the truth's fields,
    exit 1 with one line saying which (the JSON report has null scores and the reason)."""
    other_docs = tmp_path / "other.jsonl"
    other_docs.write_text(json.dumps({"file": "b.pdf", "fields": {"vendor": "Acme"}}) + "\n")
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(other_docs)])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr == (f"error: nothing to score: none of the 1 documents of the truth file is in {scored_out} "
                          f"(matched by path, or by file name where one document has it, e.g. 'b.pdf')\n")
    other_fields = tmp_path / "fields.jsonl"
    other_fields.write_text(json.dumps({"file": "a.pdf", "fields": {"iban": "X", "due_date": "Y"}}) + "\n")
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(other_fields), "--json"])
    assert res.exit_code == 1
    report = json.loads(res.stdout)
    assert report["overall_exact_match"] is None and report["documents"] == 1
    assert report["nothing_compared"] == "no answer names a field of the truth file: answers total, vendor; " \
                                         "truth fields due_date, iban"


def test_eval_names_the_truth_documents_it_did_not_find(scored_out, tmp_path):
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps({"file": f, "fields": {"vendor": "x"}}) + "\n"
                             for f in ["a.pdf", *(f"gone{i}.pdf" for i in range(7))]))
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(truth)])
    assert res.exit_code == 0, res.output
    assert "1 documents: exact match 100.0%" in res.stdout
    assert ("7 document(s) of the truth file not in OUT, not scored: gone0.pdf, gone1.pdf, gone2.pdf, gone3.pdf, "
            "gone4.pdf and 2 more (--json lists them)") in res.stdout


def test_eval_scores_a_failed_document_as_no_answer_and_a_damaged_part_from_results(tmp_path):
    """A truth document that failed in OUT (its error row) is wrong on every field (it was left
    out, which raised the score, and called "not in OUT"); a state part that cannot be read
    leaves its documents to results.parquet, with a warning (it hid them)."""
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf") + doc_rows(FIRST, "bad.pdf", status="error"))
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps({"file": f, "fields": {"vendor": "x"}}) + "\n" for f in ("a.pdf", "bad.pdf")))
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth)])
    assert res.exit_code == 0, res.output
    assert "2 documents: exact match 50.0%" in res.stdout
    assert "1 document(s) of the truth file failed or skipped in OUT, scored as no answer: bad.pdf" in res.stdout
    report = json.loads(cli.invoke(app, ["eval", str(out), "--truth", str(truth), "--json"]).stdout)
    assert report["failed_documents"] == ["bad.pdf"] and report["missing_documents"] == []
    assert report["per_field"]["vendor"] == {"exact_match": 0.5, "f1": 0.5, "n": 2}

    atomic_write_table(out / "results.parquet", to_table(doc_rows(FIRST, "a.pdf")))
    part = store.part_files()[0]
    part.write_bytes(b"not a table")
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["per_field"]["vendor"] == {"exact_match": 1.0, "f1": 1.0, "n": 1}
    assert res.stderr == f"warning: 1 part(s) of {out}'s state cannot be read ({part.name}): their documents are " \
                         f"scored from results.parquet where it holds them\n"


def test_eval_tells_failed_and_skipped_documents_by_their_status_not_by_their_answers(tmp_path):
    """A document is failed or skipped by its doc_status: a skipped file is listed with the failed
    ones; one with per-page answers only is neither (it was called failed); a failed document is
    scored under the queries the other documents were asked, those outside the truth too (when
    every truth document failed there was no score at all)."""
    out = tmp_path / "out"
    skipped = [{**doc_rows(FIRST, "notes.txt", status="error")[0], "doc_status": "skipped", "status": "skipped",
                "error_kind": "unsupported_type"}]
    per_page = [{**r, "page": 1} for r in doc_rows(FIRST, "pages.pdf")]
    RunStore(out).write_part(1, doc_rows(FIRST, "other.pdf") + doc_rows(FIRST, "bad.pdf", status="error")
                             + skipped + per_page)
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps({"file": f, "fields": {"vendor": "x"}}) + "\n"
                             for f in ("bad.pdf", "notes.txt", "pages.pdf")))
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["failed_documents"] == ["bad.pdf", "notes.txt"] and report["missing_documents"] == []
    assert report["per_field"] == {"vendor": {"exact_match": 0.0, "f1": 0.0, "n": 2}}
    # every document of OUT failed: no query to score them under, said so
    only_failed = tmp_path / "only_failed"
    RunStore(only_failed).write_part(1, doc_rows(FIRST, "bad.pdf", status="error"))
    res = cli.invoke(app, ["eval", str(only_failed), "--truth", str(truth), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["nothing_compared"] == (
        f"1 document(s) of the truth file failed or were skipped in {only_failed}, and no document there has an "
        f"answer to a document query (per-page answers are not compared with the truth)")


def test_eval_scores_a_failed_document_wrong_even_where_the_truth_is_null(tmp_path):
    """No answer is not the answer "absent": a failed document (or an errored query) is wrong on a
    field whose truth is null too; of two documents of one file name, the failed one is failed
    and the name alone names neither (listed as ambiguous, not scored); a JSON query whose
    answers are not objects gives no QUERY.FIELD keys."""
    out = tmp_path / "out"
    items = [{**r, "query": "line_items", "query_type": "json", "value": "[1, 2]"} for r in doc_rows(FIRST, "a/ok.pdf")[:1]]
    RunStore(out).write_part(1, doc_rows(FIRST, "a/ok.pdf") + items + doc_rows(FIRST, "a/inv.pdf")
                             + doc_rows(FIRST, "b/inv.pdf", status="error") + doc_rows(FIRST, "bad.pdf", status="error"))
    truth = tmp_path / "truth.jsonl"
    truth.write_text("".join(json.dumps({"file": f, "fields": {"vendor": None}}) + "\n"
                             for f in ("ok.pdf", "a/inv.pdf", "b/inv.pdf", "inv.pdf", "bad.pdf")))
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth), "--json"])
    report = json.loads(res.stdout)
    assert report["failed_documents"] == ["b/inv.pdf", "bad.pdf"] and report["ambiguous_documents"] == ["inv.pdf"]
    assert report["per_field"] == {"vendor": {"exact_match": 0.0, "f1": 0.0, "n": 4}}  # ("x" is not null either)
    shown = cli.invoke(app, ["eval", str(out), "--truth", str(truth)]).stdout
    assert "1 document(s) of the truth file name several documents of OUT (give their paths), not scored: inv.pdf" \
        in " ".join(shown.split())


def test_eval_says_answers_that_cannot_be_read_are_there(tmp_path):
    """Every part of the state unreadable and no results.parquet: the answers are there and
    cannot be read (it said to run docproc run first)."""
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf"))
    part = store.part_files()[0]
    part.write_bytes(b"not a table")
    truth = tmp_path / "truth.jsonl"
    truth.write_text(json.dumps({"file": "a.pdf", "fields": {"vendor": "x"}}) + "\n")
    res = cli.invoke(app, ["eval", str(out), "--truth", str(truth)])
    assert res.exit_code == 2 and res.stderr == (f"error: {out}'s answers cannot be read: 1 part(s) of its state "
                                                 f"({part.name}), and no readable results.parquet holds their "
                                                 f"documents\n")


def test_eval_escapes_control_characters_in_its_one_line(scored_out, tmp_path):
    truth = tmp_path / "truth.jsonl"
    truth.write_text(json.dumps({"file": "a.pdf", "fields": {"\x1b[31mRED\nerror: forged": "x"}}) + "\n")
    res = cli.invoke(app, ["eval", str(scored_out), "--truth", str(truth)])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "\x1b" not in res.stderr
    assert "truth fields \\x1b[31mRED\\nerror: forged" in res.stderr


# ---- docproc stats: damaged manifests, killed runs ---------------------------------------------

def test_stats_skips_a_damaged_manifest_with_a_warning_and_reports_the_others(tmp_path):
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf"))
    store.write_manifest(FIRST, manifest(FIRST, "2025-01-03T10:00:00.000000+00:00", 1))
    damaged = {"20250101T000000000000Z-000001": b"null", "20250101T000000000000Z-000002": b"[]",
               "20250101T000000000000Z-000003": b"{not json", "20250101T000000000000Z-000004": b"\xff\xfe{}"}
    for run_id, text in damaged.items():
        (out / "runs" / run_id).mkdir(parents=True)
        (out / "runs" / run_id / "manifest.json").write_bytes(text)
    # the latest run's manifest holds no figures: shown as "-", not a traceback
    sparse = "20250104T000000000000Z-cccccc"
    store.write_manifest(sparse, {"run_id": sparse, "started_at": None, "totals": None, "seconds": None,
                                  "stage_seconds": None, "dedup": None, "ray": {"workers": [None]}})
    res = stats(out)
    assert res.exit_code == 0, res.output
    warnings = res.stderr.splitlines()
    assert len(warnings) == 4 and all(w.startswith("warning: ") for w in warnings)
    for run_id in damaged:
        assert sum(str(out / "runs" / run_id / "manifest.json") in w for w in warnings) == 1
    assert "is null, not a JSON object" in res.stderr and "is a list, not a JSON object" in res.stderr
    assert "is not JSON" in res.stderr and "is not UTF-8 text" in res.stderr
    assert f"run {sparse} started -, - s, exit -" in res.stdout
    assert "documents - (ok -, already done -)" in res.stdout and FIRST in res.stdout  # in recent runs

    data = json.loads(stats(out, "--json").stdout)
    assert [r["run_id"] for r in data["recent_runs"]] == [FIRST, sparse]
    assert data["recent_runs"][0]["documents"] == 1 and data["run"]["seconds"] is None
    assert sorted(d["run_id"] for d in data["damaged_manifests"]) == sorted(damaged)
    assert json.loads(stats(out, "--run", FIRST, "--json").stdout)["per_query"]["vendor"]["rows"] == 1


def test_stats_says_how_a_run_stopped_and_what_an_unwritable_out_kept(tmp_path):
    """A run that stopped on a full disk counted the documents it answered, not the ones it could
    write: stats says it stopped, and how many of its documents OUT kept."""
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf") + doc_rows(FIRST, "b.pdf"))
    m = manifest(FIRST, "2025-01-03T10:00:00.000000+00:00", 8)
    m.update(status="failed", exit_code=5, fault={"kind": "output", "message": "no space left for out", "documents_kept": 2})
    store.write_manifest(FIRST, m)
    res = stats(out)
    assert res.exit_code == 0, res.output
    assert "fault: no space left for out; 2 of its documents kept (the others are redone by the next run)" in res.stdout
    m.update(status="interrupted", exit_code=143, fault={"kind": "signal", "message": "stopped by SIGTERM"})
    store.write_manifest(FIRST, m)
    assert "  fault: stopped by SIGTERM\n" in stats(out).stdout


def test_stats_reports_a_killed_first_run_from_its_rows(tmp_path):
    """kill -9 leaves no manifest: stats reports the documents the parts hold and says why."""
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(KILLED, "a.pdf") + doc_rows(KILLED, "b.pdf", "partial"))
    store.write_part(2, doc_rows(KILLED, "c.pdf", "error"))
    res = stats(out)
    assert res.exit_code == 0, res.output
    assert f"run {KILLED}: no manifest (the run was killed or is still running); figures from its rows" in res.stdout
    assert "documents 3 (ok 1, already done -), pages 4" in res.stdout and "failures 1, partial 1" in res.stdout
    data = json.loads(stats(out, "--json").stdout)
    run = data["run"]
    assert run["run_id"] == KILLED and run["status"] == "no manifest" and run["manifest"] is None
    assert run["started_at"] == "2025-01-03T11:00:00.000000+00:00"
    assert (run["documents"], run["ok"], run["partial"], run["failures"], run["generated_tokens"]) == (3, 1, 1, 1, 20)
    assert run["cache_hit_rate"] == 0.4 and run["seconds"] is None and run["config_fingerprint"] == "cfg1"
    assert data["per_query"]["vendor"] == {"rows": 2, "answered": 2, "errors": 0, "mean_generated_tokens": 5.0,
                                           "acceptance_rate": None, "mean_accepted_length": None,
                                           "mean_latency_s": 2.0}
    assert data["runs_without_manifest"] == [KILLED] and data["damaged_manifests"] == []


def test_stats_into_a_pipe_whose_reader_left_ends_quietly(tmp_path):
    """`docproc stats OUT | head -1`: the reader goes away; the command ends with 0, no traceback."""
    import subprocess
    import sys

    out = tmp_path / "out"
    RunStore(out).write_part(1, doc_rows(KILLED, "a.pdf"))

    def closed(*args, stream="stdout"):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first line
        try:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (stdout buffered, as by default)
            return subprocess.run([sys.executable, "-m", "docproc", "stats", *args], text=True, timeout=120, env=env,
                                  **{stream: w, ("stderr" if stream == "stdout" else "stdout"): subprocess.PIPE})
        finally:
            os.close(w)
    for args in ((str(out),), (str(out), "--json")):
        proc = closed(*args)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)
    # a closed stderr is not a reader that left: a usage error keeps its code
    assert closed(str(tmp_path / "no-runs-here"), stream="stderr").returncode != 0


def test_a_run_started_with_stdout_closed_leaves_with_its_own_code():
    """`docproc run ... >&-` (cron, daemons): Python has no sys.stdout then, and the run's quick
    exit (cli._leave) flushed it anyway, ending a completed run with exit 1 and a traceback."""
    import subprocess
    import sys

    code = "import sys; from docproc import cli; assert sys.stdout is None; cli._leave(0)"
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=120, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_stats_lists_a_killed_run_after_a_completed_one(tmp_path):
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf", latency=1.0))
    store.write_manifest(FIRST, manifest(FIRST, "2025-01-03T10:00:00.000000+00:00", 1))
    store.consolidate()
    store.write_part(store.next_part(), doc_rows(KILLED, "b.pdf", latency=3.0))  # results.parquet now stale
    data = json.loads(stats(out, "--json").stdout)
    assert data["run"]["run_id"] == KILLED and data["per_query"]["total"]["mean_latency_s"] == 3.0
    assert [(r["run_id"], r["status"]) for r in data["recent_runs"]] == [(FIRST, "completed"), (KILLED, "no manifest")]
    first = json.loads(stats(out, "--run", FIRST, "--json").stdout)
    assert first["run"]["manifest"] == str(out / "runs" / FIRST / "manifest.json")
    assert first["run"]["vision_encodes"] == 2 and first["per_query"]["total"]["mean_latency_s"] == 1.0
    res = stats(out, "--run", FIRST)
    assert res.exit_code == 0 and f"run {KILLED}: no manifest" in res.stdout and "completed" in res.stdout


def test_stats_names_what_latency_measures(tmp_path):
    """latency_s runs from a request's arrival in the engine to its last token (queueing
    included): the column says so; the JSON key stays mean_latency_s."""
    out = tmp_path / "out"
    store = RunStore(out)
    store.write_part(1, doc_rows(FIRST, "a.pdf"))
    store.write_manifest(FIRST, manifest(FIRST, "2025-01-03T10:00:00.000000+00:00", 1))
    res = stats(out)
    assert res.exit_code == 0 and "mean latency s (arrival to finish)" in res.stdout
    assert json.loads(stats(out, "--json").stdout)["per_query"]["vendor"]["mean_latency_s"] == 2.0


def test_stats_on_a_folder_with_no_readable_run_says_why(tmp_path):
    out = tmp_path / "out"
    (out / "runs" / "x").mkdir(parents=True)
    (out / "runs" / "x" / "manifest.json").write_text("[]")
    res = stats(out)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"error: no runs recorded in {out} ({out / 'runs' / 'x' / 'manifest.json'} is a list, not " \
                         f"a JSON object): run `docproc run ... --out {out}` first\n"


@pytest.mark.parametrize("locks_table", ["/proc/locks", "/nonexistent/locks"])
def test_stats_before_a_running_runs_first_document_says_a_run_is_in_progress(tmp_path, monkeypatch, locks_table):
    """Read from the kernel's table of locks, or (where that table names the file under another
    device, as on btrfs, or cannot be read) from the run whose ID the lock file holds."""
    from docproc.pipeline import runstore

    monkeypatch.setattr(runstore, "PROC_LOCKS", locks_table)
    out = tmp_path / "out"
    store = RunStore(out)
    store.lock()  # (a run that has not finished a document: no rows, no manifest)
    truth = tmp_path / "truth.jsonl"
    truth.write_text(GOOD + "\n")
    try:
        for what, res in (("runs recorded", stats(out)), ("results", stats(out, "--failures")),
                          ("answers", cli.invoke(app, ["eval", str(out), "--truth", str(truth)]))):
            assert res.exit_code == 75 and res.stderr == f"error: no {what} in {out} yet: a run is in progress " \
                                                         f"there (its first documents are not finished); try " \
                                                         f"again in a while\n"
    finally:
        store.unlock()
    res = stats(out)
    assert res.exit_code == 2 and res.stderr.startswith(f"error: no runs recorded in {out}: run `docproc run")
    (out / ".docproc" / "lock").write_text("1\n")  # a live process that does not hold it
    assert not RunStore(out).locked_by_a_run()


def test_failure_reasons_name_query_and_page_and_a_kept_answer_is_a_note(tmp_path):
    """A document's reasons say which query (and which page of a per-page query) failed; an answer
    closed at max_tokens that kept its value is no reason the document is partial: the JSON file
    lists it under notes, and `stats --failures` leaves it out."""
    from docproc.pipeline.schema import document_json
    from docproc.pipeline.stats import list_failures

    rows = doc_rows(KILLED, "a.pdf", "partial")
    rows[0].update(status="truncated", value='{"n": 1}', error="the answer reached max_tokens (16) and was closed")
    rows[1].update(status="parse_error", value=None, error="not a number: 'x'")
    page = {**rows[1], "query": "date", "page": 2, "error": "not a date: 'y'"}
    doc = document_json(rows + [page, {**page, "page": 3}])
    assert doc["errors"] == ["total: not a number: 'x'", "date (page 2): not a date: 'y'",
                             "date (page 3): not a date: 'y'"]
    assert doc["notes"] == ["vendor: the answer reached max_tokens (16) and was closed"]
    assert "notes" not in document_json(doc_rows(KILLED, "b.pdf")) and "errors" not in document_json(
        doc_rows(KILLED, "b.pdf"))
    # a document read to --max-pages: that remark once, the rest named as ever (a single query too)
    short = "; only the first 2 of 5 pages were read (--max-pages)"
    doc = document_json([{**rows[1], "error": rows[1]["error"] + short}])
    assert doc["errors"] == ["total: not a number: 'x'"] and doc["notes"] == [short[2:]]
    out = tmp_path / "out"
    RunStore(out).write_part(1, rows + [page])
    assert [(f["path"], f["status"], f["error"]) for f in list_failures(out)] == [
        ("a.pdf", "partial", "total: not a number: 'x'; date (page 2): not a date: 'y'")]
