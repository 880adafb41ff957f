"""The docproc CLI end to end on generated documents and a tiny random model (CPU)."""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pymupdf
import pytest
from PIL import Image
from typer.testing import CliRunner

from docproc.cli import app
from docproc.pipeline.runstore import RunStore
from fixtures.documents import generate

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    generate(d, 5, seed=11, formats=("pdf", "png"), max_pages=2)
    (d / "truth.jsonl").rename(d.parent / "truth.jsonl")
    return d


def run_cli(*args):
    res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return res


def manifest(out: Path) -> dict:
    return RunStore(out).manifests()[-1]


def rows(out: Path) -> list[dict]:
    return pq.read_table(out / "results.parquet").to_pylist()


@pytest.mark.slow
def test_full_run_then_incremental_then_force(docs, qwen2_vl_dir, tmp_path):
    out = tmp_path / "out"
    res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "pages" in res.output and "unique" in res.output  # the summary
    m = manifest(out)
    t = m["totals"]
    assert t["files"] == 5 and t["documents"] == 5 and t["errors"] == 0
    assert t["requests"] == 5 * 7 and t["generated_tokens"] > 0
    assert t["cached_tokens"] > 0  # the 7 queries of a document share its page prefix
    table = rows(out)
    assert len(table) == 5 * 7
    assert len({(r["path"], r["query"]) for r in table}) == len(table)
    for f in docs.iterdir():
        doc = json.loads((out / "json" / (f.name + ".json")).read_text())
        assert set(doc["fields"]) == {"vendor", "invoice_number", "date", "due_date", "currency", "total",
                                      "all_fields"}
    assert set(m["stage_seconds"]) >= {"discover", "open_render_hash", "engine", "write"}
    assert m["peak_memory"]["host_max_rss_bytes"] > 0
    assert m["peak_memory"]["gpu_alloc_retries"] is None  # (no CUDA here)
    assert m["model"]["text"] and m["query_set"]["fingerprint"]

    # a JSON file deleted by hand is written again from the rows, byte for byte, by a run with nothing
    # to do; one whose place a folder took is told, and the run still succeeds
    gone, blocked = (out / "json" / (f.name + ".json") for f in sorted(docs.iterdir())[:2])
    before = gone.read_bytes()
    gone.unlink()
    blocked.unlink()
    blocked.mkdir()
    again = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
    assert again.exit_code == 0, again.output
    m2 = manifest(out)
    assert m2["totals"]["already_done"] == 5 and m2["totals"]["requests"] == 0
    assert gone.read_bytes() == before
    assert "writing 2 document JSON file(s) missing from" in again.output
    assert "1 of them could not be written (first: " in again.output
    blocked.rmdir()
    # nothing to do: the configuration fingerprint came from the cache, the model was not loaded
    assert m["engine_loaded"] and not m2["engine_loaded"] and m2["stage_seconds"]["load_model"] == 0.0
    assert m2["config_fingerprint"] == m["config_fingerprint"] and m2["model"]["text"] == m["model"]["text"]
    assert len(rows(out)) == 5 * 7

    forced = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "--force")
    assert forced.exit_code == 0
    m3 = manifest(out)
    assert m3["totals"]["documents"] == 5 and m3["totals"]["requests"] == 35 and m3["engine_loaded"]
    table3 = rows(out)
    assert len(table3) == 35 and {r["run_id"] for r in table3} == {m3["run_id"]}
    # greedy decoding: the redo gives the same answers
    assert sorted((r["path"], r["query"], r["answer"]) for r in table3) == \
        sorted((r["path"], r["query"], r["answer"]) for r in table)

    stats = run_cli("stats", out, "--json")
    assert stats.exit_code == 0
    data = json.loads(stats.output)
    assert data["run"]["run_id"] == m3["run_id"] and len(data["recent_runs"]) == 3
    assert set(data["per_query"]) == {"vendor", "invoice_number", "date", "due_date", "currency", "total",
                                      "all_fields"}
    first = run_cli("stats", out, "--run", m["run_id"], "--json")
    assert json.loads(first.output)["run"]["documents"] == 5
    human = run_cli("stats", out)
    assert human.exit_code == 0 and "recent runs" in human.output
    assert run_cli("stats", out, "--run", "nope").exit_code == 2

    ev = run_cli("eval", out, "--truth", docs.parent / "truth.jsonl", "--json")
    assert ev.exit_code == 0
    res_eval = json.loads(ev.output)
    assert res_eval["documents"] == 5 and all(v["n"] == 5 for v in res_eval["per_field"].values())
    fields = res_eval["per_field"].values()  # overall: every (document, field) cell counted once
    assert res_eval["overall_exact_match"] == pytest.approx(
        sum(v["exact_match"] * v["n"] for v in fields) / sum(v["n"] for v in fields))


def test_second_run_on_a_locked_folder_exits_75(docs, qwen2_vl_dir, tmp_path):
    out = tmp_path / "locked"
    holder = RunStore(out)
    holder.lock()
    try:
        res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
        assert res.exit_code == 75
    finally:
        holder.unlock()


def test_usage_errors_exit_2(docs, qwen2_vl_dir, tmp_path):
    assert run_cli("run", docs, "--out", tmp_path / "o", "--model", qwen2_vl_dir, "--format", "xml").exit_code == 2
    assert run_cli("run", docs, "--out", tmp_path / "o", "--model", tmp_path / "missing").exit_code == 3  # model
    bad = tmp_path / "q.toml"
    bad.write_text("[[query]]\nname = 'x'\n")
    assert run_cli("run", docs, "--out", tmp_path / "o", "--model", qwen2_vl_dir, "--queries", bad).exit_code == 2
    assert run_cli("run", "--out", tmp_path / "o").exit_code == 2  # no inputs


def broken_corpus(root: Path, outside: Path) -> int:
    """Broken and odd files; returns the number of files (each must get one outcome)."""
    good = pymupdf.open()
    page = good.new_page()
    page.insert_text((72, 72), "Invoice INV-1 total 12.50 EUR")
    pdf = good.tobytes()
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "truncated.pdf").write_bytes(pdf[: len(pdf) // 3])
    (root / "random.pdf").write_bytes(os.urandom(3000))
    enc = pymupdf.open()
    enc.new_page().insert_text((72, 72), "secret")
    enc.save(root / "encrypted.pdf", encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw="pw", owner_pw="pw")
    (root / "empty.pdf").write_bytes(b"")
    Image.new("1", (20000, 20000)).save(root / "bomb.png")  # 400 Mpx in a few kB
    (root / "text.jpg").write_text("this is not a jpeg")
    (root / "notes.txt").write_text("not a document type")
    outside.mkdir(exist_ok=True)
    (outside / "secret.png").write_bytes(b"\x89PNG")
    os.symlink(outside / "secret.png", root / "link_out.png")
    (root / "façture_ü 名前.pdf").write_bytes(pdf)
    Image.new("RGB", (300, 200), "white").save(root / "nested" / "deeper" / "scan.png")
    return 10


@pytest.mark.slow
def test_broken_and_odd_files_give_one_outcome_each_and_no_traceback(qwen2_vl_dir, tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    n = broken_corpus(root, tmp_path / "outside")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "docproc", "run", str(root), "--out", str(out), "--model",
                           str(qwen2_vl_dir), "--device", "cpu", "--quiet"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.returncode == 1  # finished, some documents failed
    table = rows(out)
    outcomes = {}
    for r in table:
        outcomes.setdefault(r["path"], set()).add((r["doc_status"], r["error"] if r["query"] is None else None))
    assert len(outcomes) == n
    status = {p: next(iter(s))[0] for p, s in outcomes.items()}
    reason = {p: next(iter(s))[1] for p, s in outcomes.items()}
    assert status["random.pdf"] == "error" and "PDF" in reason["random.pdf"]
    assert status["encrypted.pdf"] == "error" and "password" in reason["encrypted.pdf"]
    assert status["empty.pdf"] == "error" and "empty" in reason["empty.pdf"]
    assert status["bomb.png"] == "error" and ("bomb" in reason["bomb.png"] or "cap" in reason["bomb.png"])
    assert status["text.jpg"] == "error"
    assert status["notes.txt"] == "skipped"
    assert status["link_out.png"] == "skipped" and "outside" in reason["link_out.png"]
    assert status["façture_ü 名前.pdf"] in ("ok", "partial")
    assert status[str(Path("nested") / "deeper" / "scan.png")] in ("ok", "partial")
    assert status["truncated.pdf"] in ("ok", "partial", "error")  # MuPDF may repair it; either way one row
    for p, s in outcomes.items():
        if status[p] in ("ok", "partial"):
            assert len([r for r in table if r["path"] == p]) == 7
        else:
            assert len([r for r in table if r["path"] == p]) == 1
    # nothing was written outside the output folder
    assert not any((tmp_path / "outside").glob("*.json"))


@pytest.mark.slow
def test_dedup_encodes_each_unique_page_once(qwen2_vl_dir, tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    page = Image.new("RGB", (400, 300), "white")
    for x in range(0, 400, 40):
        page.paste((x % 255, 30, 90), (x, 100, x + 20, 140))
    page.save(root / "a.png")
    shutil.copy(root / "a.png", root / "a_copy.png")  # byte-identical file
    other = Image.new("RGB", (400, 300), (200, 220, 240))
    other.paste((20, 20, 20), (50, 50, 250, 90))  # (a flat page would be blank: answered without the engine)
    other.save(root / "b.png")
    pdf = pymupdf.open()
    for _ in range(3):  # three identical pages in one PDF
        pdf.new_page(width=300, height=200).insert_text((20, 50), "same page")
    pdf.save(root / "repeat.pdf")
    out = tmp_path / "out"
    res = run_cli("run", root, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
    assert res.exit_code == 0, res.output
    m = manifest(out)
    assert m["dedup"]["pages"] == 6
    assert m["dedup"]["unique_pages"] == 3 < m["dedup"]["pages"]
    assert m["dedup"]["vision_encodes"] == 3  # the vision tower ran once per unique page
    a, a_copy = [[r for r in rows(out) if r["path"] == p] for p in ("a.png", "a_copy.png")]
    assert [r["answer"] for r in a] == [r["answer"] for r in a_copy]


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_the_clean_rows(docs, qwen2_vl_dir, tmp_path):
    clean = tmp_path / "clean"
    assert run_cli("run", docs, "--out", clean, "--model", qwen2_vl_dir, "--device", "cpu").exit_code == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--model", str(qwen2_vl_dir),
           "--device", "cpu", "--quiet", "--batch-pages", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(RunStore(out).parts_dir.glob("part-*.rows")) if RunStore(out).parts_dir.is_dir() else []:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts = list(RunStore(out).parts_dir.glob("part-*.rows"))
    assert parts, "the run was killed before it flushed anything"
    done_before = sum(pq.read_table(p).num_rows for p in parts)
    assert done_before < 35  # it really was killed mid-way
    assert run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu").exit_code == 0
    got = sorted((r["path"], r["query"], r["answer"]) for r in rows(out))
    want = sorted((r["path"], r["query"], r["answer"]) for r in rows(clean))
    assert got == want and len(got) == len(set(got)) == 35


@pytest.mark.slow
def test_run_with_a_draft_reports_acceptance(docs, qwen2_vl_dir, tmp_path):
    out = tmp_path / "spec"
    res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "--draft", qwen2_vl_dir,
                  "--spec-k", "3")
    assert res.exit_code == 0, res.output
    m = manifest(out)
    assert m["draft"]["draft_proposed"] > 0 and m["acceptance_rate"] == 1.0  # the draft is the target
    assert m["totals"]["draft_accepted"] == m["draft"]["draft_accepted"]
    assert all(r["draft_proposed"] > 0 for r in rows(out) if r["generated_tokens"] > 1)
    data = json.loads(run_cli("stats", out, "--json").output)
    assert data["run"]["acceptance_rate"] == 1.0
    assert all(v["acceptance_rate"] == 1.0 for v in data["per_query"].values())
    assert run_cli("run", docs, "--out", tmp_path / "x", "--model", qwen2_vl_dir, "--draft", qwen2_vl_dir,
                   "--spec-k", "0").exit_code == 2


@pytest.mark.slow
def test_anchor_text_and_batch_invariance_are_part_of_the_fingerprint(docs, qwen2_vl_dir, tmp_path):
    out = tmp_path / "out"
    assert run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "-q").exit_code == 0
    plain = {(r["path"], r["query"]): r for r in rows(out)}
    res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "-q", "--anchor-text",
                  "--enforce-eager")  # (no CUDA graphs on CPU anyway: the flag is accepted and recorded)
    assert res.exit_code == 0, res.output
    m = manifest(out)
    assert m["settings"]["anchor_text"] is True and m["settings"]["enforce_eager"] is True
    # the PDFs are redone; the scan is not (anchor text cannot reach an image)
    assert m["totals"]["already_done"] == 1 and m["totals"]["documents"] == 4
    anchored = {(r["path"], r["query"]): r for r in rows(out)}
    assert anchored.keys() == plain.keys()
    for key, r in anchored.items():
        if key[0].endswith(".pdf"):
            assert r["prompt_tokens"] > plain[key]["prompt_tokens"] + 50
        else:  # scans have no text layer: the very same prompt
            assert r["prompt_tokens"] == plain[key]["prompt_tokens"]
    assert any(k[0].endswith(".pdf") for k in anchored) and any(k[0].endswith(".png") for k in anchored)
    again = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "-q", "--anchor-text")
    assert again.exit_code == 0 and manifest(out)["totals"]["already_done"] == 5
    # --batch-invariant is part of the fingerprint too (its kernels sum in their own order): all redone
    inv = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "-q", "--anchor-text",
                  "--batch-invariant")
    m = manifest(out)
    assert inv.exit_code == 0 and m["totals"]["already_done"] == 0 and m["totals"]["documents"] == 5
    assert m["settings"]["batch_invariant"] is True and m["engine"]["batch_invariant"] is True


@pytest.mark.slow
def test_fp4_runs_keep_the_value_slot_entry_of_their_fingerprints(docs, qwen2_vl_dir, tmp_path):
    """FP4 values have no outlier slots (an option for two is gone); an FP4 fingerprint still holds
    the entry at 0, as runs made when it was the default did, so that their documents are not
    redone, and an entry-less one (the older default of 2) never matches."""
    out = tmp_path / "out"
    assert run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "-q",
                   "--kv-cache", "fp4").exit_code == 0
    known = json.loads((out / ".docproc" / "fingerprints.json").read_text())
    (components,) = [v["components"] for v in known.values()]
    assert components["kv_cache"] == "fp4" and components["fp4_value_slots"] == 0


def test_consoles_are_wide_when_the_output_is_not_a_terminal(monkeypatch):
    """Piped or logged output (cron) gets tables at their full width, not squeezed into 80 columns
    with cut headers; COLUMNS, when set, still decides."""
    import io

    from docproc import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    wide = cli._console()
    assert wide.width == cli.WIDE_OUTPUT
    table = cli.Table(title="per query")
    for c in ("query", "rows", "answered", "errors", "mean tokens", "acceptance", "accepted/step", "mean latency s"):
        table.add_column(c)
    table.add_row("invoice_number", "15", "15", "0", "9.07", "-", "-", "28.4")
    wide.print(table)
    assert "answered" in sys.stdout.getvalue() and "mean latency s" in sys.stdout.getvalue()
    monkeypatch.setenv("COLUMNS", "100")
    assert cli._console().width == 100


@pytest.mark.slow
def test_config_cache_follows_the_model_files_and_settings(docs, qwen2_vl_dir, tmp_path):
    """The cached configuration fingerprint is used only for the same model files and settings; a
    stale entry is corrected as soon as the engine loads, and rows carry the real fingerprint."""
    model = tmp_path / "model"
    shutil.copytree(qwen2_vl_dir, model)
    few = tmp_path / "docs"
    few.mkdir()
    for f in sorted(docs.iterdir())[:2]:
        shutil.copy(f, few / f.name)
    out = tmp_path / "out"
    base = ("run", few, "--out", out, "--model", model, "--device", "cpu")
    assert run_cli(*base).exit_code == 0
    first = manifest(out)
    assert first["engine_loaded"] and first["totals"]["documents"] == 2

    # a model file touched: the key changes, so the engine loads; the fingerprint is the same
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert run_cli(*base).exit_code == 0
    touched = manifest(out)
    assert touched["engine_loaded"] and touched["totals"]["already_done"] == 2 and touched["totals"]["requests"] == 0
    assert touched["config_fingerprint"] == first["config_fingerprint"]
    assert run_cli(*base).exit_code == 0 and not manifest(out)["engine_loaded"]  # cached again

    # another setting that changes the fingerprint: not from the cache, documents redone
    assert run_cli(*base, "--dpi", "100").exit_code == 0
    dpi = manifest(out)
    assert dpi["engine_loaded"] and dpi["totals"]["documents"] == 2
    assert dpi["config_fingerprint"] != first["config_fingerprint"]

    # a stale entry (what a key could miss): corrected when the engine loads for work
    cache = RunStore(out).config_cache_path
    entries = json.loads(cache.read_text())
    for v in entries.values():
        v["config_fingerprint"] = "stale"
    cache.write_text(json.dumps(entries))
    res = run_cli(*base)
    assert res.exit_code == 0 and "stale" in res.output
    fixed = manifest(out)
    assert fixed["config_fingerprint"] == first["config_fingerprint"] and fixed["engine_loaded"]
    # this run's entry (written last) holds the real fingerprint again
    assert list(json.loads(cache.read_text()).values())[-1]["config_fingerprint"] == first["config_fingerprint"]
    assert {r["config_fingerprint"] for r in rows(out)} <= {first["config_fingerprint"], dpi["config_fingerprint"]}


def test_schema_and_choices_queries_are_answered_within_their_constraint(docs, qwen2_vl_dir, tmp_path):
    """A json query with a schema_file (relative to the query file) and a string query with
    choices, on a random model that would otherwise write noise: every answer that ended by itself
    is valid JSON for the schema, every choice answer is one of the choices; the constraints are
    part of the query set's fingerprint."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "additionalProperties": False, "required": ["kind", "paid"],
              "properties": {"kind": {"enum": ["invoice", "receipt"]}, "paid": {"type": "boolean"}}}
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "doc.json").write_text(json.dumps(schema))
    qfile = tmp_path / "q.toml"
    qfile.write_text('[[query]]\nname = "doc"\nquestion = "Describe it as JSON."\ntype = "json"\n'
                     'schema_file = "schemas/doc.json"\nmax_tokens = 40\n\n'
                     '[[query]]\nname = "status"\nquestion = "Is it paid?"\nchoices = ["paid", "unpaid"]\n')
    out = tmp_path / "out"
    res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu", "--queries", qfile)
    assert res.exit_code in (0, 1), res.output
    table = rows(out)
    assert len(table) == 5 * 2
    for r in table:
        if r["query"] == "status":
            assert r["answer"] in ("paid", "unpaid") and r["value"] == r["answer"], r
        elif r["status"] != "parse_error":  # (a parse error: an answer cut by max_tokens)
            value = json.loads(r["value"])
            assert set(value) == {"kind", "paid"} and value["kind"] in ("invoice", "receipt"), r
            assert isinstance(value["paid"], bool)
    from docproc.pipeline.queries import load_queries

    q = load_queries(qfile)
    assert q.constrained == ["doc", "status"]
    (tmp_path / "schemas" / "doc.json").write_text(json.dumps({**schema, "required": ["kind"]}))
    assert load_queries(qfile).fingerprint != q.fingerprint


def test_a_qwen3_vl_run_with_a_draft_fp4_kv_fp8_weights_and_a_schema(docs, qwen3_vl_dir, tmp_path):
    """docproc run --model QWEN3_VL with a Qwen3-VL draft, --kv-cache fp4, --quantization fp8 and
    a schema query: every document answered, each answer that ended by itself valid for its schema,
    the manifest naming the formats; then the bundled (Qwen2-VL) draft for it: one line, exit 3."""
    pytest.importorskip("xgrammar")
    from fixtures.checkpoints import make_model

    draft = make_model(tmp_path / "q3draft", "qwen3_vl", geometry="tiny-qwen3", seed=4)
    qfile = tmp_path / "q.toml"
    qfile.write_text('[[query]]\nname = "doc"\nquestion = "Describe it as JSON."\ntype = "json"\nmax_tokens = 24\n'
                     'schema = { type = "object", additionalProperties = false, required = ["kind"], '
                     'properties = { kind = { enum = ["invoice", "receipt"] } } }\n\n'
                     '[[query]]\nname = "total"\nquestion = "What is the total?"\nmax_tokens = 12\n')
    out = tmp_path / "out"
    res = run_cli("run", docs, "--out", out, "--model", qwen3_vl_dir, "--device", "cpu", "--draft", draft,
                  "--kv-cache", "fp4", "--quantization", "fp8", "--queries", qfile)
    assert res.exit_code in (0, 1), res.output
    table = rows(out)
    assert len(table) == 5 * 2, table
    assert {r["status"] for r in table if r["query"] == "total"} <= {"ok", "truncated"}  # (12 tokens of noise)
    assert {r["status"] for r in table if r["query"] == "doc"} <= {"ok", "parse_error"}
    for r in table:
        if r["query"] == "doc" and r["status"] == "ok":
            assert json.loads(r["value"])["kind"] in ("invoice", "receipt"), r
    m = manifest(out)
    assert m["draft"]["draft_proposed"] > 0
    assert m["engine"]["kv_cache_dtype"] == "fp4" and m["engine"]["weights_fp8"] == "online"
    res = run_cli("run", docs, "--out", tmp_path / "x", "--model", qwen3_vl_dir, "--device", "cpu",
                  "--draft", ROOT / "docproc" / "assets" / "models" / "draft")
    assert res.exit_code == 3 and "a Qwen2-VL model and the target a Qwen3-VL" in res.output, res.output


@pytest.mark.parametrize("body,message", [
    ('type = "string"\nschema = { type = "object" }', 'a schema needs type = "json"'),
    ('type = "json"\nschema_file = "missing.json"', "does not exist"),
    ('type = "json"\nschema = { type = "object" }\nschema_file = "x.json"', "not both"),
    ('choices = ["a", "a"]', "distinct non-empty strings"),
    ('type = "number"\nchoices = ["1"]', 'choices need type = "string"'),
    ('type = "json"\nschema_file = "/dev/zero"', "not a regular file"),
    ('type = "json"\nschema_file = "."', "not a regular file"),
    ('type = "json"\nschema_file = "loop1.json"', "cannot be followed"),
])
def test_bad_constraints_in_a_query_file_are_usage_errors(tmp_path, body, message):
    from docproc.pipeline.queries import QueryFileError, load_queries

    (tmp_path / "loop1.json").symlink_to(tmp_path / "loop2.json")
    (tmp_path / "loop2.json").symlink_to(tmp_path / "loop1.json")
    qfile = tmp_path / "q.toml"
    qfile.write_text(f'[[query]]\nname = "x"\nquestion = "?"\n{body}\n')
    with pytest.raises(QueryFileError, match=re.escape(message)):
        load_queries(qfile)


def test_a_schema_keeps_its_property_order(tmp_path):
    from docproc.pipeline.queries import load_queries

    qfile = tmp_path / "q.toml"
    qfile.write_text('[[query]]\nname = "x"\nquestion = "?"\ntype = "json"\n'
                     'schema = { type = "object", properties = { zeta = { type = "string" }, alpha = { type = "string" } } }\n')
    schema = load_queries(qfile).queries[0].structured_outputs().json
    assert list(json.loads(schema)["properties"]) == ["zeta", "alpha"]


@pytest.mark.slow
def test_without_xgrammar_answers_are_checked_against_their_rules(docs, qwen2_vl_dir, tmp_path, monkeypatch):
    """With xgrammar missing the run says so once, decodes free text and checks every answer
    against its query's rule (a random model's noise: parse errors naming the rule); the manifest
    and the fingerprint tell the two modes apart. `--format documents` adds documents.parquet, one
    typed row per document (not written by default: a reader of OUT finds one table of rows)."""
    import pyarrow.parquet as _pq

    pytest.importorskip("xgrammar")
    monkeypatch.setattr("docproc.pipeline.documents.xgrammar_available", lambda: False)
    out = tmp_path / "checked"
    res = run_cli("run", docs, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
    assert res.exit_code in (0, 1), res.output
    assert res.output.count("xgrammar, a dependency of docproc, is missing") == 1, res.output
    m = manifest(out)
    assert m["query_set"]["constraints"] == "checked"
    table = rows(out)
    broken = [r for r in table if r["status"] == "parse_error" and r["query_type"] in ("date", "number")]
    assert broken and all(r["error"].startswith(f"not a {r['query_type']} answer") for r in broken)
    monkeypatch.undo()
    out2 = tmp_path / "decoded"
    res = run_cli("run", docs, "--out", out2, "--model", qwen2_vl_dir, "--device", "cpu",
                  "--format", "json,parquet,documents")
    assert res.exit_code in (0, 1), res.output
    assert manifest(out2)["query_set"]["constraints"] == "decoded" and "warning" not in res.output
    assert not (out / "documents.parquet").exists()
    assert manifest(out2)["config_fingerprint"] != m["config_fingerprint"]
    decoded = rows(out2)
    # every answer whole, those that met max_tokens too: closed within it (truncated; a JSON or
    # string answer with its value, a number or date with none: closed where it was cut, not the model's)
    assert not [r for r in decoded if r["status"] in ("parse_error", "schema_violation")
                or r["status"] == "truncated" and (r["value"] is None) != (r["query_type"] in ("number", "date"))]
    docs_table = _pq.read_table(out2 / "documents.parquet")
    assert docs_table.num_rows == len({r["path"] for r in decoded})
    assert str(docs_table.schema.field("total").type) == "double" and str(docs_table.schema.field("date").type) == "date32[day]"
    assert docs_table.schema.field("all_fields").type.num_fields == 6


def test_blank_pages_are_answered_empty_without_the_engine(qwen2_vl_dir, tmp_path):
    """A document whose pages are blank (white, or flat grey with scanner noise) gets every query
    empty with no tokens spent; a page with one line of text is read."""
    from PIL import Image, ImageDraw

    root = tmp_path / "in"
    root.mkdir()
    Image.new("RGB", (400, 520), "white").save(root / "white.png")
    Image.effect_noise((400, 520), 6).convert("RGB").save(root / "grey_scan.png")
    line = Image.new("RGB", (400, 520), "white")
    ImageDraw.Draw(line).text((40, 40), "Invoice 42, total 10.00", fill="black")
    line.save(root / "one_line.png")
    out = tmp_path / "out"
    res = run_cli("run", root, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu")
    assert res.exit_code in (0, 1), res.output
    by_doc: dict[str, list[dict]] = {}
    for r in rows(out):
        by_doc.setdefault(r["path"], []).append(r)
    for blank in ("white.png", "grey_scan.png"):
        assert all(r["status"] == "empty" and r["value"] is None and r["generated_tokens"] == 0 and r["prompt_tokens"] == 0
                   for r in by_doc[blank]), by_doc[blank]
        assert {r["doc_status"] for r in by_doc[blank]} == {"ok"}
    assert sum(r["generated_tokens"] for r in by_doc["one_line.png"]) > 0
    assert manifest(out)["totals"]["blank_pages"] == 2


def test_documents_parquet_follows_the_results_once_written(qwen2_vl_dir, tmp_path):
    """Once OUT has documents.parquet, every run rewrites it (with or without --format documents),
    so that it never lists documents results.parquet no longer has."""
    import pyarrow.parquet as _pq
    from PIL import Image, ImageDraw

    root = tmp_path / "in"
    root.mkdir()
    for name in ("a.png", "b.png"):
        im = Image.new("RGB", (300, 200), "white")
        ImageDraw.Draw(im).text((20, 20), f"page {name}", fill="black")
        im.save(root / name)
    out = tmp_path / "out"
    assert run_cli("run", root, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu",
                   "--format", "json,parquet,documents").exit_code in (0, 1)
    assert sorted(_pq.read_table(out / "documents.parquet").column("path").to_pylist()) == ["a.png", "b.png"]
    (root / "b.png").unlink()
    assert run_cli("run", root, "--out", out, "--model", qwen2_vl_dir, "--device", "cpu").exit_code in (0, 1)
    assert _pq.read_table(out / "documents.parquet").column("path").to_pylist() == ["a.png"]
    assert sorted({r["path"] for r in rows(out)}) == ["a.png"]
