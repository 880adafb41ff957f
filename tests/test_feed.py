"""The feed ahead of the engine (pipeline/feed.py): render processes that die fail only their
document, and the pages held are bounded whatever a document's length."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def _events(feed, until, timeout=60.0) -> list[tuple]:
    got, deadline = [], time.time() + timeout
    while time.time() < deadline and not until(got):
        event = feed.next_event(block=True)
        if event is not None:
            got.append(event)
    return got


@pytest.mark.slow
def test_a_render_process_that_dies_fails_its_document_and_the_next_is_rendered(tmp_path):
    """A worker stuck in a document (here a FIFO nothing writes to) and then killed, as the
    out-of-memory killer or a crash in MuPDF would: that document comes back failed ("crashed"),
    a new worker takes its place and renders the next one."""
    from docproc.pipeline.settings import bundled_model
    from docproc.pipeline.feed import Feed, WindowRules
    from docproc.pipeline.ingest import Candidate

    stuck = tmp_path / "stuck.png"
    os.mkfifo(stuck)
    good = tmp_path / "good.png"
    Image.new("RGB", (64, 64), "white").save(good)
    feed = Feed([Candidate(stuck, "stuck.png"), Candidate(good, "good.png")],
                lambda c: ("render", "sha-" + c.rel), pages_in_flight=8, workers=1)
    try:
        feed.start_rendering(WindowRules(str(bundled_model("target")), 16384, 2, 120, None, False))
        started = _events(feed, lambda got: any(e[0] == "start" and e[1] == 0 for e in got))
        assert any(e[0] == "start" for e in started)
        time.sleep(0.3)  # (inside the open of the FIFO)
        feed._procs[0].kill()
        got = _events(feed, lambda got: any(e[0] == "window" and e[1] == 1 and e[5] for e in got))
    finally:
        feed.close()
    failed = [e for e in got if e[0] == "failed"]
    assert [(e[1], e[2]) for e in failed] == [(0, "crashed")] and "render process died" in failed[0][3]
    window = [e for e in got if e[0] == "window"][0]
    assert window[1] == 1 and len(window[3]) == 1 and window[3][0].blank  # the next document, rendered


def _run(docs: Path, out: Path, *extra) -> dict:
    proc = subprocess.run([sys.executable, "-m", "docproc", "run", str(docs), "--out", str(out), "--device", "cpu",
                           "--quiet", "--dpi", "30", *extra], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=600)
    # (the process ends without Python's teardown: multiprocessing's exit work still ran, or its
    # resource tracker would report the render queues' locks leaked)
    assert proc.returncode == 0 and "leaked" not in proc.stderr, proc.stderr
    run = sorted((out / "runs").iterdir())[-1]
    return json.loads((run / "manifest.json").read_text())


@pytest.mark.slow
def test_a_2000_page_pdf_holds_a_bounded_number_of_pages_and_rendering_overlaps_the_load(tmp_path):
    """2,000 blank pages (answered without the engine, so the feed runs as fast as it renders):
    the run's memory grows by the pages in flight (16, and a window of up to 150 such pages per
    render process: about 0.25 MB a page at 30 dpi), not by the document (500 MB)."""
    import pymupdf

    for name, pages in (("small", 4), ("big", 2000)):
        (tmp_path / name).mkdir()
        pdf = pymupdf.open()
        for _ in range(pages):
            pdf.new_page(width=612, height=792)
        pdf.save(tmp_path / name / f"{name}.pdf")
    small = _run(tmp_path / "small", tmp_path / "out-small", "--render-workers", "1")
    # a first run into an empty OUT: the fingerprint waits for the engine, whose load (torch's
    # import included) runs while the workers render
    timeline = small["stage_timeline"]
    assert timeline["open_render_hash"][0] < timeline["load_model"][1], timeline
    assert timeline["discover"][1] < timeline["load_model"][0], timeline
    assert small["config_fingerprint"] and small["engine_loaded"]
    big = _run(tmp_path / "big", tmp_path / "out-big", "--batch-pages", "16", "--render-workers", "1")
    assert big["totals"]["pages"] == big["totals"]["blank_pages"] == 2000 and big["totals"]["documents"] == 1
    grew = big["peak_memory"]["host_max_rss_bytes"] - small["peak_memory"]["host_max_rss_bytes"]
    assert grew < 160 << 20, grew
