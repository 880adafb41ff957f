"""The run's loop: the feed's documents into the engine as they are ready, rows out as each
document's last answer comes back.

One thread does everything but triage and rendering (pipeline/feed.py): it records the
documents the triage settles, loads the model when the first document needs it (the feed goes on
rendering meanwhile), hands each window's requests to the engine as the window arrives (the
engine's continuous batching takes them in between its steps; a document's requests go in
together, so its pages' prefix is computed once), steps the engine, turns finished windows into
rows and writes finished documents in parts: once they hold --batch-pages pages, or
FLUSH_DOCUMENTS documents, or FLUSH_SECONDS after the last part, so that a run killed with -9
loses at most the documents in the engine (their pages are within --batch-pages, plus one window
per render process) and those finished since the last part (the same bound). The engine waits for the feed only when it has nothing to run.

If an engine step raises (one document's request broke it), the requests in flight are dropped
and their documents are run again one by one (Pipeline._run_batch), so that only the document at
fault gets an error row.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

from docproc.errors import EnvironmentFault
from docproc.pipeline.feed import RenderedDocument
from docproc.pipeline.rows import _DocState, _Window
from docproc.pipeline.signals import RunInterrupted, reraise_swallowed

FLUSH_SECONDS = 2.0
FLUSH_DOCUMENTS = 64


class _Streamer:
    def __init__(self, pipeline, feed) -> None:
        self.p = pipeline
        self.feed = feed
        self.docs: dict[int, _DocState] = {}  # feed key -> the document being rendered or answered
        self.ready: deque[_Window] = deque()  # windows rendered, not yet handed to the engine
        self.flight: dict[int, tuple[_Window, list]] = {}  # id(window) -> (window, its outputs so far)
        self.stream = None
        self.ended = False
        self.last_flush = time.perf_counter()
        self.unflushed_pages = 0  # pages of the documents finished since the last part
        self.flush_pages = feed.pages_in_flight  # a part is written once it holds this many pages
        self.first_request: float | None = None
        self.last_answer: float | None = None

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        ended = False
        try:
            while True:
                busy = self.stream is not None and self.stream.unfinished > 0
                event = self.feed.next_event(block=not busy and not self.ready and not self._done())
                while event is not None:
                    self._on(event)
                    event = self.feed.next_event(block=False)
                if self.ready:
                    self._hand_over()
                if self.stream is not None and self.stream.unfinished:
                    self._step()
                elif self._done():
                    break
                self._maybe_flush()
            self._maybe_flush(now=True)
            ended = True
        finally:  # (a run stopped by a signal or a fault: its engine stage until then, in the manifest)
            if self.first_request is not None:
                end = self.last_answer if ended and self.last_answer is not None else time.perf_counter()
                self.p.mark("engine", self.first_request, end)

    def _done(self) -> bool:
        return self.ended and not self.feed.jobs and not self.ready and not self.flight

    # ---- events from the feed ------------------------------------------------------------------
    def _on(self, event: tuple) -> None:
        p = self.p
        kind = event[0]
        if kind == "settled":
            _, cand, sha, what, data = event
            p._settle(cand, sha, what, data)
        elif kind == "job":
            if not self.feed.rendering:
                self._start_engine()
        elif kind == "opened":
            _, key, num_pages, total, truncated = event
            if key not in self.feed.jobs:  # (failed already: its worker was found dead)
                return
            cand, sha = self.feed.jobs[key]
            self.docs[key] = _DocState(RenderedDocument(cand, sha, num_pages, total, truncated))
        elif kind == "window":
            _, key, index, pages, credits, last, seconds, began = event
            now = time.perf_counter()
            p.stage_seconds["open_render_hash"] += seconds
            p.mark("open_render_hash", now - (time.time() - began), now)  # (from when a worker began it)
            state = self.docs.get(key)
            if state is None:  # (failed already)
                self.feed.give_back(credits)
                return
            w = _Window(state, index, pages, credits)
            p.totals.pages += len(pages)
            p.page_hashes.update(pg.sha256 for pg in pages)
            p.report("page", {"pages": p.totals.pages})
            state.windows_total += 1
            if last:
                state.finished_adding = True
                self.docs.pop(key)
                self.feed.taken(key)
            if state.dropped:
                self._window_done(w)
            else:
                self.ready.append(w)
        elif kind == "failed":
            _, key, doc_kind, message, trace = event
            if key not in self.feed.jobs:
                return
            cand, sha = self.feed.jobs[key]
            state = self.docs.pop(key, None)
            if state is not None:  # windows of it in the engine or waiting: their answers go unused
                state.dropped = True
            if trace and p.s.debug:
                print(trace, flush=True)
            p._file_row(cand, sha, "error", message, doc_kind or "internal")
            self.feed.taken(key)
        elif kind == "end":
            self.ended = True
        elif kind == "bug":
            raise event[1]

    def _start_engine(self) -> None:
        """The first document needs the engine: the workers start rendering, then the model loads
        (torch's import included: nothing of it before the workers start)."""
        p = self.p
        self.feed.start_rendering(p.window_rules())
        llm = p._engine()
        from docproc.engine.stream import RequestStream

        p.fingerprint_now()  # (from the loaded engine, where it was left until now)
        self.stream = RequestStream(llm)

    # ---- the engine ---------------------------------------------------------------------------
    def _hand_over(self) -> None:
        p = self.p
        t0 = time.perf_counter()
        while self.ready:
            w = self.ready.popleft()
            if w.doc.dropped:
                self._window_done(w)
                continue
            if all(pg.blank for pg in w.pages):  # a window of blank pages: every query empty, no engine
                p._blank_answers(w)
                self._window_done(w)
                continue
            prompts, params = p.window_prompts(w)
            self.flight[id(w)] = (w, [None] * len(prompts))
            self.stream.add(prompts, params, [(id(w), i) for i in range(len(prompts))])
            live = p.live_figures()
            live.submitted += len(prompts)
            p.report("requests", {**asdict(live), "engine_seconds": p.stage_seconds["engine"]})
        if self.first_request is None and self.flight:
            self.first_request = t0
        p.stage_seconds["engine"] += time.perf_counter() - t0

    def _step(self) -> None:
        p = self.p
        t0 = time.perf_counter()
        try:
            done = self.stream.step()
        except (EnvironmentFault, RunInterrupted):
            p.stage_seconds["engine"] += time.perf_counter() - t0  # (the step the signal or fault ended)
            raise
        except Exception as e:  # noqa: BLE001 -- a request broke the step: its documents one by one
            reraise_swallowed()
            p.stage_seconds["engine"] += time.perf_counter() - t0
            docs = len({id(w.doc) for w, _ in self.flight.values()})
            p.report("warning", {"message": f"an engine step raised {type(e).__name__}: {e}; its {docs} document(s) "
                                            f"in flight are run again one at a time"})
            if p.s.debug:
                import traceback

                traceback.print_exception(e)
            self._rerun_in_flight()
            return
        now = time.perf_counter()
        p.stage_seconds["engine"] += now - t0
        live = p.live_figures()
        for (wid, i), out in done:
            w, outs = self.flight[wid]
            outs[i] = out
            live.answered_one(out)
            if all(o is not None for o in outs):
                del self.flight[wid]
                self.last_answer = now
                if not w.doc.dropped:
                    self._answers(w, outs)
                self._window_done(w)
        if done:
            p.report("requests", {**asdict(live), "engine_seconds": p.stage_seconds["engine"]})

    def _answers(self, w: _Window, outs: list) -> None:
        try:
            self.p._answers(w, outs)
        except Exception as e:  # noqa: BLE001 -- the per-document boundary, after the engine
            reraise_swallowed()
            w.doc.failure = ("internal", f"{type(e).__name__}: {e}")
            if self.p.s.debug:
                import traceback

                traceback.print_exception(e)

    def _window_done(self, w: _Window) -> None:
        w.doc.windows_done += 1
        self.feed.give_back(w.credits)
        w.credits = 0
        state = w.doc
        if state.finished_adding and state.windows_done == state.windows_total and not state.dropped:
            self.p._finish_document(state)
            self.unflushed_pages += state.doc.num_pages

    def _rerun_in_flight(self) -> None:
        """The step raised and the engine dropped every request: each document with windows in
        flight runs again alone (the batch path), so only the one at fault fails."""
        windows = [w for w, _ in self.flight.values()]
        self.flight.clear()
        by_doc: dict[int, list[_Window]] = {}
        for w in windows:
            by_doc.setdefault(id(w.doc), []).append(w)
        for group in by_doc.values():
            if group[0].doc.dropped:  # (its error row is written)
                for w in group:
                    self._window_done(w)
                continue
            group.sort(key=lambda w: w.index)
            credits = sum(w.credits for w in group)
            for w in group:
                w.credits = 0
            self.p._run_batch(group)  # counts the windows done and finishes the document when whole
            self.feed.give_back(credits)
        self.last_flush = time.perf_counter()

    # ---- writing -----------------------------------------------------------------------------
    def _maybe_flush(self, now: bool = False) -> None:
        p = self.p
        t = time.perf_counter()
        if p.store is None:
            return  # no output folder (a Ray actor's batch): the rows go back to the caller whole
        if p.cfg is None and not now:
            return  # (the fingerprint comes with the engine: rows wait for it rather than load the model)
        if p._pending and (now or self.unflushed_pages >= self.flush_pages or len(p._pending) >= FLUSH_DOCUMENTS
                           or t - self.last_flush >= FLUSH_SECONDS):
            t0 = t
            p._flush()
            self.unflushed_pages = 0
            self.last_flush = time.perf_counter()
            p.mark("write", t0, self.last_flush)
            p.report("batch", {"totals": asdict(p.totals), "unique_pages": len(p.page_hashes),
                               "engine_seconds": p.stage_seconds["engine"]})
