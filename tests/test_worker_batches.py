"""A `--ray` engine actor's batches, driven here without Ray: each goes through the plain run's
loop, and one that fails leaves nothing behind in the actor (no request in its engine, no render
thread), so that the next batch runs as if it had not happened."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from docproc.pipeline import streamer
from docproc.pipeline.distributed import _WorkerPipeline
from docproc.pipeline.ingest import discover
from docproc.pipeline.queries import load_queries
from docproc.pipeline.settings import RunSettings, bundled_model

SAMPLES = Path(__file__).resolve().parent.parent / "sample_docs"


def render_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "docproc-render" and t.is_alive()]


@pytest.mark.slow
def test_a_failed_batch_leaves_no_request_and_no_render_thread(tmp_path, one_query, monkeypatch):
    docs = tmp_path / "in"
    docs.mkdir()
    for name in ("doc_2026_00002.pdf", "doc_2026_00003.jpg", "doc_2026_00006.jpg"):
        shutil.copy(SAMPLES / name, docs / name)
    settings = RunSettings(inputs=[str(docs)], out=str(tmp_path / "out"), model=str(bundled_model("target")),
                           queries=str(one_query), device="cpu")
    p = _WorkerPipeline(settings, load_queries(one_query), "run", None, None)
    batch = [(c, None) for c in discover([str(docs)])]
    before = len(render_threads())

    step = streamer._Streamer._step

    def step_then_bug(self):  # a bug of the loop itself, with the first window's requests in the engine
        step(self)
        raise RuntimeError("a bug")

    monkeypatch.setattr(streamer._Streamer, "_step", step_then_bug)
    failed = p.process(batch)
    assert {d[0] for d in failed["docs"]} == {c.rel for c, _ in batch}  # every document: an error row
    assert not p.llm.scheduler.has_unfinished  # nothing of the batch left running in the actor's engine
    monkeypatch.setattr(streamer._Streamer, "_step", step)

    def breaks(state):  # a bug after the engine, outside the per-document boundary
        raise RuntimeError("a bug")

    # one page in flight: the render thread waits for a credit that the dropped windows never give back
    p._finish_document = breaks
    p.s.batch_pages = 1
    failed = p.process(batch)
    assert {d[0] for d in failed["docs"]} == {c.rel for c, _ in batch}
    assert len(render_threads()) == before  # it gave up as the batch's feed closed
    del p._finish_document
    good = p.process(batch)
    rows = [r for _, rs, _ in good["docs"] for r in rs]
    assert len(good["docs"]) == 3 and all(r["doc_status"] == "ok" for r in rows), rows
    assert good["totals"]["documents"] == 3 and good["stage_seconds"]["engine"] > 0
    assert len(render_threads()) == before


def test_an_actors_document_work_is_the_plain_runs(tmp_path, one_query):
    """The actor's document work is built by the same constructor as the plain run's
    (pipeline/documents.py): whatever state that work needs, the actor has, and it keeps none of
    the plain run's output-folder side (discovery, removals, the manifest)."""
    from docproc.pipeline.documents import DocumentWork
    from docproc.pipeline.run import Pipeline

    settings = RunSettings(inputs=[str(SAMPLES)], out=str(tmp_path / "out"), model=str(bundled_model("target")),
                           queries=str(one_query), device="cpu")
    plain = Pipeline(settings)
    actor = _WorkerPipeline(settings, load_queries(one_query), "run", "cfg", None)
    shared = set(vars(DocumentWork(settings, load_queries(one_query), "run", lambda e, d: None)))
    assert shared <= set(vars(plain)) and shared <= set(vars(actor))
    assert actor.cfg == "cfg" and actor.run_id == "run" and actor.store is None
    assert not any(hasattr(actor, m) for m in ("run", "_start", "_remove_gone", "_manifest"))
    actor.totals.pages = 3
    actor.warnings.append("w")
    actor.new_figures()
    assert actor.totals.pages == 0 and actor.warnings == [] and set(actor.stage_seconds) == {
        "open_render_hash", "engine", "load_model"}
    assert set(plain.stage_seconds) == {"discover", "open_render_hash", "engine", "write", "load_model"}
