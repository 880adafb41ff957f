"""Progress as things move (the model load, each page, each request answered; one plain line at a
time off a terminal) and `docproc run --dry-run` (what a run would do to each document, and why,
with nothing written)."""
from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from docproc import cli
from docproc.cli import app
from docproc.pipeline.settings import bundled_model

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_docs"
TARGET = str(bundled_model("target"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plain_display(clock, **kw) -> tuple[cli._Display, io.StringIO]:
    err = io.StringIO()
    display = cli._Display(quiet=kw.pop("quiet", False), log_json=False, console=Console(file=err, width=300),
                           clock=clock, line_seconds=30, **{"tick_seconds": None, **kw})
    return display, err


def requests(answered: int, submitted: int, tokens: int, seconds: float, proposed: int = 0, accepted: int = 0):
    return {"answered": answered, "submitted": submitted, "generated_tokens": tokens, "draft_proposed": proposed,
            "draft_accepted": accepted, "engine_seconds": seconds}


# ---- the display -------------------------------------------------------------------------------------
def test_off_a_terminal_one_plain_line_every_30_s_and_at_the_end():
    clock = FakeClock()
    display, err = plain_display(clock)
    display("load_start", {"model": "m", "draft": None})
    clock.now += 31
    display("load_end", {"seconds": 31.2})
    display("start", {"run_id": "r", "files": 240})
    for i in range(48):
        clock.now += 0.5
        display("page", {"pages": i + 1})
    display("requests", requests(0, 1680, 0, 0.0))
    assert err.getvalue().splitlines() == ["docproc: model loaded in 31.2 s"]  # no line is due yet
    clock.now += 10  # 35 s since the last line
    display("requests", requests(310, 1680, 30720, 60.0, proposed=1000, accepted=620))
    for _ in range(12):
        display("document", {"path": "x", "status": "ok"})
    clock.now += 29  # not due: one line at most every 30 s, whatever the events
    display("requests", requests(311, 1680, 30800, 61.0, proposed=1000, accepted=620))
    clock.now += 2
    display("end", {})
    assert err.getvalue().splitlines() == [
        "docproc: model loaded in 31.2 s",
        "docproc: 0/240 documents, 48 pages, 310/1680 requests, 512 tok/s, acceptance 62%, 65 s",
        "docproc: 12/240 documents, 48 pages, 311/1680 requests, 505 tok/s, acceptance 62%, 96 s"]
    assert "\x1b" not in err.getvalue()
    display.close()


def test_a_line_comes_during_a_long_load_with_no_event():
    clock = FakeClock()
    display, err = plain_display(clock, tick_seconds=0.01)
    display("load_start", {"model": "m", "draft": None})
    clock.now += 30
    deadline = time.monotonic() + 5
    while not err.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    display.close()
    assert err.getvalue().splitlines()[0] == \
        "docproc: loading model, 0/? documents, 0 pages, 0/0 requests, - tok/s, acceptance -, 30 s"


def test_a_ray_driver_shows_the_figures_each_batch_brings():
    clock = FakeClock()
    display, err = plain_display(clock)
    display("start", {"run_id": "r", "files": 4})
    totals = {"pages": 6, "requests": 14, "generated_tokens": 700, "draft_proposed": 0, "draft_accepted": 0}
    clock.now += 30
    display("batch", {"totals": totals, "unique_pages": 6, "engine_seconds": 7.0})
    display.close()
    assert err.getvalue() == "docproc: 0/4 documents, 6 pages, 14/14 requests, 100 tok/s, acceptance -, 30 s\n"


def test_quiet_shows_no_progress_but_warnings():
    clock = FakeClock()
    display, err = plain_display(clock, quiet=True)
    shown = io.StringIO()
    cli.err_console, saved = Console(file=shown, width=300), cli.err_console
    try:
        display("load_start", {"model": "m", "draft": None})
        clock.now += 100
        display("load_end", {"seconds": 100.0})
        display("page", {"pages": 1})
        display("warning", {"message": "a warning"})
        display("end", {})
    finally:
        cli.err_console = saved
    assert err.getvalue() == ""
    assert shown.getvalue() == "warning: a warning\n"


# ---- the engine's callback, and a run's events --------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from docproc import LLM

    # as the pipeline loads it (run.py's _engine): its fingerprint is the CLI's
    return LLM(TARGET, device="auto", kv_cache_dtype="auto", max_num_batched_tokens=8192, seed=0)


@pytest.mark.slow
def test_on_request_done_is_called_once_per_request(llm):
    from docproc import SamplingParams

    seen = []
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3),
              SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1)]
    outs = llm.generate(["Hello", 42, "The total is"], params, on_request_done=seen.append)
    assert sorted(o.request_id for o in seen) == ["0", "1", "2"]  # 42 is refused at once: finished too
    by_id = {o.request_id: o for o in seen}
    for o in outs:
        assert [c.text for c in by_id[o.request_id].outputs] == [c.text for c in o.outputs]
    assert len(by_id["2"].outputs) == 2 and by_id["1"].error is not None


def settings(docs: Path, out: Path, one_query: Path, **kw):
    from docproc.pipeline.settings import RunSettings

    return RunSettings(inputs=[str(docs)], out=str(out), model=TARGET, queries=str(one_query), **kw)


@pytest.fixture(scope="module")
def done(tmp_path_factory, llm, one_query):
    """Three documents done by the bundled model in one batch, on a terminal display: (inputs,
    OUT, what the display showed at each event)."""
    from docproc.pipeline.run import Pipeline

    base = tmp_path_factory.mktemp("done")
    docs = base / "in"
    docs.mkdir()
    for name in ("doc_2026_00003.jpg", "doc_2026_00002.pdf", "doc_2026_00006.jpg"):
        shutil.copy(SAMPLES / name, docs / name)
    display = cli._Display(quiet=False, log_json=False,
                           console=Console(file=io.StringIO(), force_terminal=True, width=200))
    shown = []

    def reporter(event, data):
        display(event, data)
        if display.progress is not None:
            task = display.progress.tasks[0]
            shown.append((event, task.completed, task.fields["info"]))

    # one page in flight at a time: each document's request is answered before the next is handed over, so
    # the display's request count moves 0, 1, 2, 3 (with more in flight, requests that entered together can
    # finish in one step)
    p = Pipeline(settings(docs, base / "out", one_query, batch_pages=1), llm=llm, reporter=reporter)
    try:
        assert p.run()["exit_code"] == 0
    finally:
        display.close()
    return docs, base / "out", shown


@pytest.mark.slow
def test_a_terminal_shows_pages_and_requests_as_they_move(done):
    """Pages as they are rendered, requests as they are handed to the engine and as each is
    answered, before the rows are written."""
    import re

    _, _, shown = done
    batch = [i for i, (event, _, _) in enumerate(shown) if event == "batch"]
    assert batch  # rows written as documents finish
    before = [info for event, _, info in shown[:batch[-1]]]
    for pages in (1, 2, 3):
        assert any(info.startswith(f"pages {pages}  ") for info in before), before
    assert any("requests 0/" in info for info in before), before  # handed over, not yet answered
    answered = {int(m.group(1)) for info in before for m in [re.search(r"requests (\d)/\d ", info)] if m}
    assert {0, 3} < answered, "\n".join(before)  # (0, some as they finish, all 3)
    assert "requests 3/3 " in before[-1] and " 0.0 tok/s" not in before[-1] and "- tok/s" not in before[-1]


# ---- docproc run --dry-run -----------------------------------------------------------------------------
def listing(folder: Path) -> list[tuple]:
    out = []
    for dirpath, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            st = os.lstat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), folder), st.st_size, st.st_mtime_ns))
    return sorted(out)


@pytest.mark.slow
def test_dry_run_lists_each_document_and_why_and_writes_nothing(done, llm, one_query, tmp_path):
    from docproc.pipeline.plan import dry_run
    from docproc.pipeline.run import Pipeline

    docs, out0, _ = done  # its inputs change here (the stored rows name their root: no copy)
    out = tmp_path / "out"
    shutil.copytree(out0, out)
    (docs / "doc_2026_00003.jpg").unlink()  # removed
    shutil.copy(SAMPLES / "doc_2026_00010.jpg", docs / "doc_2026_00006.jpg")  # its bytes changed
    shutil.copy(SAMPLES / "doc_2026_00005.pdf", docs / "new.pdf")  # new
    (docs / "notes.txt").write_text("hi")  # skipped
    (out / "json" / "doc_2026_00002.pdf.json").unlink()  # a run writes it again from the rows
    before = listing(out)
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(one_query),
                                   "--dry-run", "--log-json"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    plan = {d["path"]: (d["action"], d["reason"]) for d in lines if d["event"] == "plan"}
    assert plan == {"doc_2026_00002.pdf": ("already done", None),
                    "doc_2026_00006.jpg": ("redo", "its bytes changed"),
                    "new.pdf": ("new", None),
                    "notes.txt": ("skipped", "not a supported document type (.txt)"),
                    "doc_2026_00003.jpg": ("removed", f"its file is gone from {os.path.realpath(docs)}")}
    end = lines[-1]
    # (cached though `done` ran with another --batch-pages: how fast, not what, so not part of the key)
    assert end["event"] == "plan_end" and end["fingerprint"]["source"] == "cache" and end["json_missing"] == 1
    assert end["counts"] == {"new": 1, "redo": 1, "already done": 1, "moved": 0, "removed": 1, "skipped": 1,
                             "error": 0}
    text = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--queries", str(one_query),
                                    "--dry-run"])
    assert text.exit_code == 0 and "would process 2 (new 1, redo 1); already done 1" in text.stdout
    assert "; would write 1 document JSON file(s) missing from OUT/json from their rows." in text.stdout

    # another DPI: not cached, so the engine computes the fingerprint; it reaches the PDF only
    p = Pipeline(settings(docs, out, one_query, dpi=150), llm=llm)
    planned = dry_run(p)
    assert planned["fingerprint"]["source"] == "model"
    assert {d["path"]: (d["action"], d["reason"]) for d in planned["documents"]}["doc_2026_00002.pdf"] == \
        ("redo", "the configuration changed (--dpi 120 -> 150)")
    assert listing(out) == before  # no lock, manifest, part, cache entry or fingerprint kept

    fresh = tmp_path / "never"
    res = CliRunner().invoke(app, ["run", str(docs), "--out", str(fresh), "--queries", str(one_query),
                                   "--dry-run"])
    assert res.exit_code == 0 and "new 3" in res.stdout and not fresh.exists()
