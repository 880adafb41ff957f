"""`docproc run`: documents in, extractions out.

Flow: discovery and the plan against OUT's stored rows, then a feed (pipeline/feed.py: triage on
a thread, rendering ahead of the engine within the pages-in-flight bound) and the run's loop
(pipeline/streamer.py): each window's requests -- one per (query, window), a document's requests
together so its page prefix is computed once -- enter the engine as the window is rendered, the
answers are parsed as they come back, and finished documents are flushed as atomic parts. A
document whose pages exceed the prompt's image-token budget is split into consecutive windows of
pages; each query is asked of every window and the first window (in page order) with a non-empty
parsed answer wins. With --anchor-text, each born-digital PDF page's text layer (with
coordinates) follows the images in the prompt, inside the shared prefix.

Reliability: whatever one document raises, at any stage (discovery, open, render, hash,
preprocessing, encode, write), becomes that document's error row and the run goes on; requests
whose engine step fails are run again document by document (_run_batch) so that only the document
at fault fails. Only faults of the environment (docproc.errors) stop a run; SIGTERM and SIGINT drop the
batch in flight. Either way the run ends with a manifest saying how it ended, and the lock freed.
"""
from __future__ import annotations

import os
import resource
from pathlib import Path
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

from docproc.errors import EnvironmentFault, OutputUnwritable
from docproc.pipeline.constraints import xgrammar_available
from docproc.pipeline.engine_setup import PROMPT_VERSION, EngineSetup, load_fault
from docproc.pipeline.feed import Feed, WindowRules
from docproc.pipeline.streamer import _Streamer
from docproc.pipeline.rows import DocumentRows, _Window, window_requests
from docproc.pipeline.ingest import (Candidate, DocumentError, discover, display_name, file_digest,
                                     searched_roots)
from docproc.pipeline.queries import QuerySet, build_prompt, load_queries
from docproc.pipeline.reconcile import ConfigHistory, Reconciliation, reconcile
from docproc.pipeline.runstore import REMOVED, RunStore
from docproc.pipeline.settings import RunSettings, RunTotals
from docproc.pipeline.signals import EXIT_INTERRUPTED, RunInterrupted, signals_raise
from docproc.pipeline.typed import documents_table

__all__ = ["Pipeline", "RunSettings", "RunTotals", "UsageError", "PROMPT_VERSION"]

FAILURES_LISTED = 20  # failed files named in a manifest (docproc stats --failures lists all)


class UsageError(ValueError):
    """The run cannot start as asked (inputs, output folder); nothing was done."""


def window_anchor(pages) -> str | None:
    """The anchor text of a window: each page's text layer under its page number; None when no
    page has one (scans), so their prompts stay exactly the plain ones."""
    parts = [f"Page {p.index + 1}:\n{p.text}" for p in pages if p.text]
    return "\n".join(parts) if parts else None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


Reporter = Callable[[str, dict], None]  # (event, data): "start", "load_start", "load_end", "page", "requests",
#                                         "document", "batch", "warning", "note", "end"


def _quiet_on_failure(reporter: Reporter) -> Reporter:
    """The reporter, silenced for the rest of the run by its first failure (a closed stdout under
    --log-json, a progress display that breaks): what it shows must never stop the work."""
    broken = []

    def report(event: str, data: dict) -> None:
        if not broken:
            try:
                reporter(event, data)
            except Exception:  # noqa: BLE001 -- display only
                broken.append(True)
    report.close = getattr(reporter, "close", lambda: None)  # type: ignore[attr-defined]
    return report


def _now() -> str:
    # microseconds: runs that start within one second (cron, tests) must still order
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclass
class LiveFigures:
    """The engine's figures as they move within a batch (RunTotals counts a batch once it ends)."""
    submitted: int = 0  # requests handed to the engine so far
    answered: int = 0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0

    def answered_one(self, out) -> None:
        """Count a finished request (a RequestOutput)."""
        m = out.metrics
        self.answered += 1
        self.generated_tokens += m.num_generated_tokens
        self.draft_proposed += m.draft_proposed
        self.draft_accepted += m.draft_accepted


class Pipeline(EngineSetup, DocumentRows):
    _history: ConfigHistory | None = None  # this run's configuration against the stored documents'
    _live: LiveFigures | None = None  # made when the first batch goes to the engine
    config_changed: dict | None = None  # documents done before and redone since the configuration changed
    # with nothing done in OUT and no cached fingerprint, the fingerprint waits for the engine's
    # load (which then overlaps rendering) instead of loading the model before discovery
    defer_fingerprint = True

    def __init__(self, settings: RunSettings, llm=None, reporter: Reporter | None = None) -> None:
        """Checks the inputs, the output folder's place and the query set; UsageError or
        QueryFileError before anything is loaded or written."""
        self.s = settings
        self._check_paths()
        self.store = RunStore(settings.out)
        self.queries: QuerySet = load_queries(settings.queries)
        # without xgrammar answers are decoded free and checked against their query's rule after
        # (an answer that breaks it is a parse error); the mode is part of the fingerprint
        self.constrain = xgrammar_available()
        self.llm = llm
        self.report = _quiet_on_failure(reporter or (lambda event, data: None))
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ") + "-" + uuid.uuid4().hex[:6]
        self.totals = RunTotals()
        self.stage_seconds = {"discover": 0.0, "open_render_hash": 0.0, "engine": 0.0, "write": 0.0,
                              "load_model": 0.0}
        self.page_hashes: set[str] = set()
        self.failures: list[dict] = []  # this run's failed files: path, kind, error
        self._plan = Reconciliation()  # the stored rows against the inputs (made after discovery)
        self._roots: dict[str, str] = {}  # key -> root of every outcome discovery made
        self.timeline: dict[str, list[float]] = {}  # stage -> [first start, last end], seconds from the start
        self._t0 = time.perf_counter()

    def _check_paths(self) -> None:
        out = os.path.realpath(self.s.out)
        for inp in self.s.inputs:
            if not os.path.lexists(inp):
                raise UsageError(f"input {inp} does not exist")
            if not os.path.exists(inp):
                raise UsageError(f"input {inp} is a broken symbolic link")
            real = os.path.realpath(inp)
            if real == out:
                raise UsageError(f"the output folder {self.s.out} is also an input: pass another --out "
                                 f"(a folder inside the input is fine: it is never read as input)")
            if _within(real, out):
                raise UsageError(f"input {inp} is inside the output folder {self.s.out}: docproc never reads "
                                 f"its own outputs; pass another --out")

    # ---- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        """Run to the end (or to a signal or an environment fault) and return the manifest; its
        status is completed, interrupted or failed, and exit_code says the same."""
        started = _now()
        t_start = self._t0 = time.perf_counter()
        self.store.lock()  # LockedError, OutputUnwritable: nothing started, no manifest
        status, fault, exit_code = "completed", None, None
        self._pending: list[tuple[str, list[dict], bool]] = []  # (key, rows, write its JSON)
        try:
            with signals_raise() as signals:
                try:
                    self._part = self.store.next_part()
                    self._process()
                except RunInterrupted as e:
                    signals.calm()
                    status, exit_code = "interrupted", EXIT_INTERRUPTED.get(e.signum, 128 + e.signum)
                    fault = {"kind": "signal", "message": f"stopped by {e}"}
                    self._wind_down()  # the batch in flight is dropped; documents it had finished are written
                except EnvironmentFault as e:
                    signals.calm()
                    status, exit_code = "failed", e.exit_code
                    fault = {"kind": e.kind, "message": str(e)}
                    if self.s.debug:
                        traceback.print_exc()
                    if not isinstance(e, OutputUnwritable):  # documents finished so far are kept
                        self._wind_down()
                signals.calm()
                manifest = self._manifest(started, time.perf_counter() - t_start, status, fault, exit_code)
                try:
                    self.store.write_manifest(self.run_id, manifest)
                except OutputUnwritable as e:
                    if status == "completed":
                        manifest.update(status="failed", exit_code=e.exit_code,
                                        fault={"kind": e.kind, "message": str(e)})
                self.report("end", manifest)
                return manifest
        finally:
            self.store.unlock()

    def _wind_down(self) -> None:
        """After a signal or a fault: write what is finished (removals wait for a whole run). A run
        that stopped before any row was written leaves no results.parquet behind. One stopped before
        its fingerprint was known (the engine had not loaded) drops its pending rows rather than load
        the model now: they can only be files settled without the engine (skips, unreadable files),
        which the next run settles again in moments."""
        if self.cfg is None:
            self._pending = []
        if not self._pending and not self.store.part_files():
            return
        try:
            self._flush()
            self._consolidate()
        except OutputUnwritable:
            pass

    NO_XGRAMMAR = ("xgrammar, a dependency of docproc, is missing from this install: answers are decoded as free "
                   "text and checked against their query's rule afterwards (those that break it are parse errors); "
                   "pip install xgrammar to decode under the rules")

    def _start(self) -> list[Candidate]:
        """The configuration fingerprint, discovery and the plan against the stored rows: the
        candidates, in order."""
        self.check_models()
        self.cfg = self.cached_config()  # read at each use below: loading the engine may correct it
        t0 = time.perf_counter()
        candidates = discover(self.s.inputs, exclude=[self.s.out])
        self.stage_seconds["discover"] += time.perf_counter() - t0
        self.mark("discover", t0, time.perf_counter())
        self.totals.files = len(candidates)
        self.report("start", {"run_id": self.run_id, "files": len(candidates)})
        if not self.constrain and self.queries.constrained:
            self.report("warning", {"message": self.NO_XGRAMMAR})
        for message in self.queries.warnings:
            self.report("warning", {"message": message})
        self._reconcile(candidates)
        if self.cfg is None and (self._plan.done or self._plan.renamed_from or not self.defer_fingerprint):
            self.cfg = self._config()  # what is done already turns on it: the model loads now to know it
        if self.cfg is not None:
            self._history = ConfigHistory(self.cfg, self.config_components_known(), self.stored_components(),
                                          bool(self.queries.constrained), self.queries.name)
            if not self.s.force:
                self._say_config_changed(candidates)
        return candidates

    def fingerprint_now(self) -> str:
        """The configuration fingerprint, worked out now if it was left until the engine loaded (an
        output folder with nothing done in it: no outcome turns on it before then)."""
        if self.cfg is None:
            self.cfg = self._config()
        return self.cfg

    def _say_config_changed(self, candidates: list[Candidate]) -> None:
        """Documents done before under a configuration whose changes reach them are done again:
        a warning and the manifest say how many, and which components changed."""
        by_cfg: dict[str, int] = {}
        for c in candidates:
            stored = self._plan.done.get(c.rel)
            if c.skip_reason or stored is None:
                continue
            if not self._history.same_answers(stored[1], pdf=c.doc_type == "pdf", pages=stored[2]):
                by_cfg[stored[1]] = by_cfg.get(stored[1], 0) + 1
        if not by_cfg:
            return
        groups = sorted(by_cfg.items(), key=lambda kv: (-kv[1], kv[0]))
        total = sum(by_cfg.values())
        self.config_changed = {"documents": total, "from": [
            {"config_fingerprint": old, "documents": n, "changed": self._history.changes(old)} for old, n in groups]}
        if len(groups) == 1:
            what = self._history.describe(groups[0][0])
        else:
            what = "; ".join(f"{n} from {self._history.describe(old)}" for old, n in groups)
        self.report("warning", {"message": (
            f"{total} document(s) done before are redone: the configuration changed ({what}); run with the "
            f"settings they were done with to keep their answers")})

    def _is_done(self, cand: Candidate, sha: str) -> bool:
        """Done before with these bytes, under this configuration or one whose differences cannot
        reach this document (reconcile.same_answers)."""
        stored = self._plan.done.get(cand.rel)
        if stored is None or stored[0] != sha:
            return False
        if stored[1] == self.cfg:
            return True
        h = self._history  # (made for the fingerprint the run started with; the engine may correct it)
        return h is not None and h.cfg == self.cfg and \
            h.same_answers(stored[1], pdf=cand.doc_type == "pdf", pages=stored[2])

    def _process(self) -> None:
        candidates = self._start()
        feed = Feed(candidates, self._verdict, self.s.batch_pages, self.render_workers())
        try:
            _Streamer(self, feed).run()
        finally:
            feed.close()
        self._flush()
        self._remove_gone()
        self._consolidate()

    def render_workers(self) -> int:
        """--render-workers, or by default: on a GPU a quarter of the cores in processes (1 to 4),
        on a CPU engine one thread (the engine's matrix work takes every core and releases the
        GIL; a process would cost its start-up on every small run)."""
        from docproc.engine.device import gpu_nodes_visible
        from docproc.pipeline.feed import default_workers

        if self.s.render_workers is not None:
            return self.s.render_workers
        if self.s.device == "cpu" or (self.s.device == "auto" and not gpu_nodes_visible()):
            return 0
        return default_workers()

    def window_rules(self) -> WindowRules:
        """How documents are cut into windows for this run's model: its prompt's image-token
        budget and merge size, read from its config (the engine that loads will agree)."""
        import json as _json

        from docproc.models.hf_config import qwen2_vl_config

        try:
            raw = _json.loads((Path(self.s.model) / "config.json").read_text())
            if raw.get("model_type") == "qwen2_vl":  # (torch-free: the workers start before the model's imports)
                hf = qwen2_vl_config(raw)
            else:
                from docproc.models.loader import read_config

                hf = read_config(self.s.model)
        except EnvironmentFault:
            raise
        except Exception as e:  # noqa: BLE001 -- as loading the model would say
            raise load_fault(e, self.s.model, self.s.draft) from e
        text = getattr(hf, "text_config", hf)
        budget = min(self.s.max_image_tokens, text.max_position_embeddings - 1024)
        return WindowRules(self.s.model, budget, hf.vision_config.spatial_merge_size, self.s.dpi, self.s.max_pages,
                           self.s.anchor_text)

    def window_prompts(self, w: _Window) -> tuple[list, list]:
        """The prompts and sampling parameters of a window's requests (window_requests), in order."""
        from docproc import SamplingParams

        prompts, params = [], []
        for q, page in window_requests(w, self.queries):  # (a per-page query: the page alone)
            pages = w.pages if page is None else [page]
            anchor = window_anchor(pages) if self.s.anchor_text else None
            prompts.append({"prompt": build_prompt(len(pages), q.question, anchor),
                            "multi_modal_data": {"image": [p.image for p in pages]},
                            "multi_modal_uuids": {"image": [p.sha256 for p in pages]}})
            params.append(SamplingParams(temperature=0.0, max_tokens=q.max_tokens,
                                         structured_outputs=q.structured_outputs() if self.constrain else None))
        return prompts, params

    def mark(self, stage: str, start: float, end: float | None = None) -> None:
        """The stage timeline: when (seconds from the run's start) a stage first and last ran."""
        start -= self._t0
        end = start if end is None else end - self._t0
        was = self.timeline.get(stage)
        self.timeline[stage] = [round(min(start, was[0]) if was else start, 3),
                                round(max(end, was[1]) if was else end, 3)]

    def _triage(self, cand: Candidate) -> str | None:
        """The file's hash when the document needs the engine; None when its outcome is settled
        here (recorded): discovery's skip or error, already done, a rename of a stored document,
        a file that cannot be read."""
        t0 = time.perf_counter()
        outcome = self._verdict(cand)
        self.stage_seconds["open_render_hash"] += time.perf_counter() - t0
        if outcome[0] == "render":
            return outcome[1]
        self._settle(cand, *outcome[1:])
        return None

    def _verdict(self, cand: Candidate) -> tuple:
        """("render", sha) for a document the engine must read, else ("settled", sha, kind, data):
        kind skip, done, move (data: the stored rows) or error (data: (kind, message)). Reads the
        plan and hashes the file, records nothing: the feed's triage thread runs it."""
        if cand.skip_reason:  # discovery's own outcome: a skip, or a folder it could not list
            return ("settled", None, "skip", None)
        sha = None
        try:
            sha = file_digest(cand)  # before opening: a document already done is not rendered
            if not self.s.force and self._is_done(cand, sha):
                return ("settled", sha, "done", None)
            moved = None if self.s.force else self._plan.take_rename(sha, self.cfg)
            if moved is not None:
                return ("settled", sha, "move", moved)
            return ("render", sha)
        except (EnvironmentFault, RunInterrupted):
            raise
        except Exception as e:  # noqa: BLE001 -- the per-document boundary
            if isinstance(e, DocumentError):
                return ("settled", sha, "error", (e.kind, str(e)))
            if self.s.debug:
                traceback.print_exception(e)
            return ("settled", sha, "error", ("internal", f"{type(e).__name__}: {e}"))

    def _settle(self, cand: Candidate, sha: str | None, kind: str, data) -> None:
        """Record a document whose outcome needs no engine (a verdict's)."""
        if kind == "skip":
            if not cand.is_error:
                self.totals.skipped += 1
                if not self.s.force and self._plan.skipped.get(cand.rel, False) == cand.skip_reason:
                    self.report("document", {"path": cand.rel, "status": "skipped"})  # recorded so already
                    return
            self._file_row(cand, None, "error" if cand.is_error else "skipped", cand.skip_reason, cand.kind)
        elif kind == "done":
            self.totals.already_done += 1
            self.report("document", {"path": cand.rel, "status": "already done"})
        elif kind == "move":
            self._move(cand, data)
        else:
            self._file_row(cand, sha, "error", data[1], data[0])

    def _reconcile(self, candidates: list[Candidate], rows: list[dict] | None = None) -> None:
        """What the stored rows (rows: OUT's current rows, read here when not given) say against
        what discovery found (docproc.pipeline.reconcile)."""
        if rows is None:
            rows = self.store.current().to_pylist()
        found = {c.rel: c.root for c in candidates}
        unlisted = ["" if c.rel == "./" else c.rel for c in candidates if c.kind == "unlistable_folder"]
        files = {display_name(os.path.realpath(c.path)): c.rel for c in candidates if not c.skip_reason}
        roots = searched_roots(self.s.inputs)
        # a root with no file at all whose documents OUT holds is more likely an unmounted share or
        # a failed sync than a folder emptied on purpose: its rows stay (said below)
        empty = {r for r in roots if r not in {c.root for c in candidates}}
        stored = {row.get("root") for row in rows}
        kept = empty & stored
        self._plan = reconcile(rows, found, roots - kept, unlisted, files=files,
                               default_root=next(iter(roots)) if len(roots) == 1 else None)
        for root in sorted(kept):
            self.report("warning", {"message": (
                f"input {root} holds no files now, but OUT has documents from it: they are kept (an "
                f"unmounted or emptied folder?); a run that finds any file there removes the ones gone")})
        self._roots = found
        if self._plan.other_root:
            first = min(self._plan.other_root)
            self.report("warning", {"message": (
                f"{len(self._plan.other_root)} document(s) of this run have the path of a document that OUT holds "
                f"from another input root (first: {first!r} from {self._plan.other_root[first]}); this run's rows "
                f"replace those. Give one --out per input root, or give the roots to one run (their paths then "
                f"start with each root's name)")})

    def _remove_gone(self) -> None:
        """Documents whose files are gone from a searched root: JSON files first (a crash between
        the two steps leaves rows the next run removes again, never a JSON file without rows),
        then one tombstone each. A JSON file that is also a live document's is kept."""
        removed = self._plan.removed
        if not removed:
            return
        live = {self.store.json_path(k) for k in self._roots}
        for k in removed:
            if self.store.json_path(k) not in live:
                self.store.remove_document_json(k)
        self._pending.append(("", [{"run_id": self.run_id, "path": k, "root": root, "doc_status": REMOVED,
                                    "status": REMOVED, "config_fingerprint": self.cfg or ""}
                                   for k, root in removed.items()], False))
        self._flush()
        self.totals.removed = len(removed) - self.totals.moved  # a rename is a move, not a removal
        self._plan.removed = {}

    def _consolidate(self) -> None:
        t0 = time.perf_counter()
        table = self.store.consolidate(fill_roots={k: self._roots[k] for k in self._plan.missing_roots},
                                       formats=self.s.formats)
        if self.store.writes_documents(self.s.formats):
            self.store.write_documents(documents_table(table, self.queries), self.s.formats)
        self.stage_seconds["write"] += time.perf_counter() - t0

    def live_figures(self) -> LiveFigures:
        self._live = self._live or LiveFigures()
        return self._live

    def _requests_handed(self, num: int) -> Callable:
        """Report num requests handed to the engine, and return the callback that reports each as
        it finishes (LLM.generate's on_request_done): the run's requests answered and handed over,
        tokens generated, the draft's figures and the engine's seconds so far, as they move."""
        live = self.live_figures()
        live.submitted += num
        before, t0 = self.stage_seconds["engine"], time.perf_counter()

        def done(out) -> None:
            live.answered_one(out)
            self.report("requests", {**asdict(live), "engine_seconds": before + time.perf_counter() - t0})

        self.report("requests", {**asdict(live), "engine_seconds": before})
        return done

    def _run_batch(self, batch: list[_Window]) -> None:
        """Run a batch; if the engine raises, run it again document by document so that only the
        documents it fails on get error rows. Whatever turning one document's outputs into rows
        raises fails that document alone (never a second engine run)."""
        # a window of blank pages is answered without the engine: every query empty
        live = [w for w in batch if not all(p.blank for p in w.pages)]
        try:
            outs = self._generate(live) if live else []
        except (EnvironmentFault, RunInterrupted):
            raise
        except Exception as e:  # noqa: BLE001 -- one document's request broke the engine step
            states = list({id(w.doc): w.doc for w in batch}.values())
            if len(states) > 1:
                for state in states:
                    self._run_batch([w for w in batch if w.doc is state])
                return
            states[0].failure = ("internal", f"{type(e).__name__}: {e}")
            if self.s.debug:
                traceback.print_exception(e)
            outs = None
        at, start = {}, 0  # a window's outputs: its requests' (window_requests), in order
        for w in live:
            at[id(w)] = (start, start + len(window_requests(w, self.queries)))
            start = at[id(w)][1]
        for w in batch:
            if outs is not None and w.doc.failure is None:
                try:
                    if id(w) in at:
                        self._answers(w, outs[at[id(w)][0]: at[id(w)][1]])
                    else:
                        self._blank_answers(w)
                except Exception as e:  # noqa: BLE001 -- the per-document boundary, after the engine
                    w.doc.failure = ("internal", f"{type(e).__name__}: {e}")
                    if self.s.debug:
                        traceback.print_exception(e)
            w.doc.windows_done += 1
        for state in {id(w.doc): w.doc for w in batch}.values():
            if state.finished_adding and state.windows_done == state.windows_total:
                self._finish_document(state)
        self.report("batch", {"totals": asdict(self.totals), "unique_pages": len(self.page_hashes),
                              "engine_seconds": self.stage_seconds["engine"]})
        self._flush()

    def _generate(self, batch: list[_Window]) -> list:
        """The engine's outputs for every request of the batch's windows (window_requests), in order."""
        llm = self._engine()
        prompts, params = [], []
        for w in batch:  # a document's queries stay together: its prefix is computed once
            p, sp = self.window_prompts(w)
            prompts.extend(p)
            params.extend(sp)
        t0 = time.perf_counter()
        try:
            return llm.generate(prompts, params, on_request_done=self._requests_handed(len(prompts)))
        finally:
            self.stage_seconds["engine"] += time.perf_counter() - t0

    def _manifest(self, started: str, seconds: float, status: str, fault: dict | None,
                  exit_code: int | None) -> dict:
        from docproc.engine.device import peak_gpu_memory

        self.totals.unique_pages = len(self.page_hashes)
        t = self.totals
        info = self.llm.cache_info() if self.llm is not None else {}
        peak_gpu = peak_gpu_memory()
        return {
            "run_id": self.run_id, "started_at": started, "finished_at": _now(), "seconds": round(seconds, 3),
            # completed | interrupted (a signal) | failed (a fault of the environment: see fault)
            "status": status, "fault": fault,
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.s).items()},
            "query_set": {"name": self.queries.name, "fingerprint": self.queries.fingerprint,
                          "queries": [q.name for q in self.queries.queries], "source": self.queries.source,
                          # decoded under their rules (xgrammar), or checked against them after
                          "constraints": "decoded" if self.constrain else "checked"},
            "model": {"path": self.s.model, **(self.model_info() or {})},
            "draft": self.llm.spec_info() if self.llm is not None else None,
            "config_fingerprint": self.cfg,
            # documents done before, redone: how many under each earlier fingerprint, and what changed
            "config_changed": self.config_changed,
            "totals": asdict(t),
            "failures": self.failures[:FAILURES_LISTED],  # the first ones; docproc stats --failures: all
            "tokens_per_second": round(t.generated_tokens / self.stage_seconds["engine"], 2)
            if self.stage_seconds["engine"] > 0 else None,
            "acceptance_rate": (t.draft_accepted / t.draft_proposed) if t.draft_proposed else None,
            "prefix_cache_hit_rate": round(t.cached_tokens / t.prompt_tokens, 4) if t.prompt_tokens else None,
            "dedup": {"pages": t.pages, "unique_pages": t.unique_pages,
                      "vision_encodes": info.get("num_encoded_images")},
            "engine": info,
            "engine_loaded": self.llm is not None,  # false: nothing to do, the fingerprint came from the cache
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            # when each stage ran (seconds from the start: first start, last end); stages overlap
            "stage_timeline": self.timeline,
            "peak_memory": {"host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "gpu_max_allocated_bytes": peak_gpu},
            # failures: files that could not be read and documents with no usable answer at all;
            # a partial document (some fields unparseable or failed) is reported, not failed
            "exit_code": exit_code if exit_code is not None else (1 if t.errors else 0),
        }
