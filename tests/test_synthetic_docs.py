"""The synthetic document generator: deterministic per seed, and its truth is on the page."""
from __future__ import annotations

import hashlib
import json
import random

import pymupdf
import pytest
from PIL import Image

from fixtures.documents import FIELDS, generate, make_spec, render_pdf
from docproc.pipeline.normalize import normalize_amount, normalize_date


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn")
    return out, generate(out, 16, seed=7)


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_deterministic_per_seed(corpus, tmp_path):
    out, _ = corpus
    again = tmp_path / "again"
    generate(again, 16, seed=7)
    assert digest(out) == digest(again)
    other = tmp_path / "other"
    generate(other, 4, seed=8)  # (four are enough to differ)
    theirs = (other / "truth.jsonl").read_text().splitlines()
    assert theirs != (out / "truth.jsonl").read_text().splitlines()[:4]


def test_truth_file_describes_every_document(corpus):
    out, records = corpus
    lines = [json.loads(x) for x in (out / "truth.jsonl").read_text().splitlines()]
    assert lines == records and len(lines) == 16
    for r in lines:
        assert (out / r["file"]).is_file()
        assert set(r["fields"]) == set(FIELDS)
        assert r["kind"] in ("invoice", "receipt")
        assert (r["fields"]["due_date"] is None) == (r["kind"] == "receipt")
        assert r["normalized"]["date"] == normalize_date(r["fields"]["date"])
        assert r["normalized"]["total"] == normalize_amount(r["fields"]["total"])
    assert {r["format"] for r in lines} >= {"pdf"}


@pytest.mark.slow
def test_pdf_text_layer_contains_every_truth_value():
    for i in range(30):
        spec = make_spec(random.Random(f"t{i}"), f"d{i}")
        doc = pymupdf.open(stream=render_pdf(spec), filetype="pdf")
        text = "\n".join(page.get_text() for page in doc)
        for name, value in spec.printed.items():
            if value is not None:
                assert value in text, (name, value)
        assert 1 <= doc.page_count <= 3


@pytest.mark.slow
def test_totals_add_up_and_page_counts_vary():
    specs = [make_spec(random.Random(f"p{i}"), f"d{i}") for i in range(60)]
    for s in specs:
        assert abs(s.total - (s.subtotal + s.tax)) < 0.011
        assert float(normalize_amount(s.printed["total"])) == pytest.approx(s.total)
    pages = {pymupdf.open(stream=render_pdf(s), filetype="pdf").page_count for s in specs}
    assert pages == {1, 2, 3}
    assert {s.kind for s in specs} == {"invoice", "receipt"}
    assert len({s.fonts for s in specs}) == 3 and len({s.date_format for s in specs}) == 4


def test_scans_are_images_with_all_pages(corpus):
    out, records = corpus
    for r in records:
        if r["format"] == "pdf":
            continue
        img = Image.open(out / r["file"])
        assert getattr(img, "n_frames", 1) == r["pages"]
        assert img.size[0] > 200


def test_sample_docs_are_complete_and_small():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "sample_docs"
    truth = [json.loads(x) for x in (root / "truth.jsonl").read_text().splitlines()]
    files = {r["file"] for r in truth}
    assert len(truth) >= 12 and all((root / f).is_file() for f in files)
    assert {r["format"] for r in truth} >= {"pdf", "jpeg", "tiff"}
    assert any(r["pages"] > 1 for r in truth)
    blobs = [(root / f).read_bytes() for f in sorted(files)]
    assert len(set(blobs)) < len(blobs)  # two byte-identical files
    assert sum(p.stat().st_size for p in root.iterdir()) <= 5 * 1024 * 1024
    # the default query set shipped beside them is the bundled one
    bundled = root.parent / "docproc" / "assets" / "queries" / "default.toml"
    assert (root / "queries.toml").read_text() == bundled.read_text()
