"""A run's document work, shared by the plain run (pipeline/run.py) and the engine actors of a
`--ray` run (pipeline/distributed.py): a document's verdict (done, renamed, to render), its
windows' prompts, the engine's batches and the rows they give, the run's figures as they move.
What only the plain run does (the output folder, discovery against its stored rows, removals, the
manifest) is in run.py; the actors hand their rows to the driver instead of writing them.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Callable

from docproc.errors import EnvironmentFault
from docproc.pipeline.constraints import xgrammar_available
from docproc.pipeline.engine_setup import EngineSetup, load_fault
from docproc.pipeline.feed import WindowRules
from docproc.pipeline.ingest import Candidate, DocumentError, file_digest
from docproc.pipeline.queries import QuerySet, build_prompt
from docproc.pipeline.reconcile import ConfigHistory, Reconciliation
from docproc.pipeline.rows import DocumentRows, _Window, engine_requests
from docproc.pipeline.settings import RunSettings, RunTotals
from docproc.pipeline.signals import RunInterrupted, reraise_swallowed

Reporter = Callable[[str, dict], None]  # (event, data): "start", "load_start", "load_end", "page", "requests",
#                                         "document", "batch", "warning", "note", "end"


def window_anchor(pages) -> str | None:
    """The anchor text of a window: each page's text layer under its page number; None when no
    page has one (scans), so their prompts stay exactly the plain ones."""
    parts = [f"Page {p.index + 1}:\n{p.text}" for p in pages if p.text]
    return "\n".join(parts) if parts else None


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


GPU_PAGES_IN_FLIGHT = 128  # --batch-pages by default with a GPU
CPU_PAGES_IN_FLIGHT = 32  # and on a CPU


class DocumentWork(EngineSetup, DocumentRows):
    """Documents to rows: what a run does between a file and its rows, wherever the rows go."""
    _history: ConfigHistory | None = None  # this run's configuration against the stored documents'
    _live: LiveFigures | None = None  # made when the first batch goes to the engine
    STAGES = ("open_render_hash", "engine", "load_model")  # the stages timed (stage_seconds), in order

    def __init__(self, settings: RunSettings, queries: QuerySet, run_id: str, report: Reporter,
                 llm=None, cfg: str | None = None) -> None:
        self.s = settings
        self.queries = queries
        # without xgrammar answers are decoded free and checked against their query's rule after
        # (an answer that breaks it is a parse error); the mode is part of the fingerprint
        self.constrain = xgrammar_available()
        self.llm = llm
        self.report = report
        self.run_id = run_id
        self.cfg = cfg
        self._plan = Reconciliation()  # the stored rows against the inputs (the plain run's, after discovery)
        self._roots: dict[str, str] = {}  # key -> root of every outcome discovery made
        self.new_figures()

    def new_figures(self) -> None:
        """This run's figures from zero: totals, stage seconds and timeline, pages seen, failures,
        rows not yet written."""
        self.totals = RunTotals()
        self.stage_seconds = {stage: 0.0 for stage in self.STAGES}
        self.page_hashes: set[str] = set()
        self.failures: list[dict] = []  # this run's failed files: path, kind, error
        self._pending: list[tuple[str, list[dict], bool]] = []  # (key, rows, write its JSON)
        self._json_gone: list[str] = []  # keys moved away: their JSON files go at the next flush
        self.documents_written = 0  # documents whose rows are in a part (kept whatever happens next)
        self._live = None
        self.timeline: dict[str, list[float]] = {}  # stage -> [first start, last end], seconds from the start
        self._t0 = time.perf_counter()

    def fingerprint_now(self) -> str:
        """The configuration fingerprint, worked out now if it was left until the engine loaded (an
        output folder with nothing done in it: no outcome turns on it before then)."""
        if self.cfg is None:
            self.cfg = self._config()
        return self.cfg

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

    def cpu_engine(self) -> bool:
        """Whether the engine will run on the CPU (decided without importing torch)."""
        from docproc.engine.device import gpu_nodes_visible

        return self.s.device == "cpu" or (self.s.device == "auto" and not gpu_nodes_visible())

    def pages_in_flight(self) -> int:
        """--batch-pages, or by default 128 pages with a GPU (an engine step's rows come from
        pages waiting on their slowest answer: 32 pages kept about 50 requests running on a 7B model,
        128 about 180 and took a fifth off the GPU's work; BENCHMARKS.md), 32 on a CPU (what a kill
        can lose is what is in flight, and a CPU answers a page in seconds, not milliseconds)."""
        if self.s.batch_pages is not None:
            return self.s.batch_pages
        return CPU_PAGES_IN_FLIGHT if self.cpu_engine() else GPU_PAGES_IN_FLIGHT

    def render_workers(self) -> int:
        """--render-workers, or by default: on a GPU a quarter of the cores in processes (1 to 4),
        on a CPU engine one thread (the engine's matrix work takes every core and releases the
        GIL; a process would cost its start-up on every small run)."""
        from docproc.pipeline.feed import default_workers

        if self.s.render_workers is not None:
            return self.s.render_workers
        if self.cpu_engine():
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
        """The prompts and sampling parameters of a window's requests the engine answers
        (engine_requests), in order."""
        from docproc import SamplingParams

        prompts, params = [], []
        for q, page in engine_requests(w, self.queries):  # (a per-page query: the page alone)
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
            moved = None if self.s.force else self._plan.take_rename(sha, self.cfg, cand.rel)
            if moved is not None:
                return ("settled", sha, "move", moved)
            return ("render", sha)
        except (EnvironmentFault, RunInterrupted):
            raise
        except Exception as e:  # noqa: BLE001 -- the per-document boundary
            reraise_swallowed()
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
            reraise_swallowed()
            states = list({id(w.doc): w.doc for w in batch}.values())
            if len(states) > 1:
                for state in states:
                    self._run_batch([w for w in batch if w.doc is state])
                return
            states[0].failure = ("internal", f"{type(e).__name__}: {e}")
            if self.s.debug:
                traceback.print_exception(e)
            outs = None
        at, start = {}, 0  # a window's outputs: its requests' (engine_requests), in order
        for w in live:
            at[id(w)] = (start, start + len(engine_requests(w, self.queries)))
            start = at[id(w)][1]
        for w in batch:
            if outs is not None and w.doc.failure is None:
                try:
                    if id(w) in at:
                        self._answers(w, outs[at[id(w)][0]: at[id(w)][1]])
                    else:
                        self._blank_answers(w)
                except Exception as e:  # noqa: BLE001 -- the per-document boundary, after the engine
                    reraise_swallowed()
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
        """The engine's outputs for every request of the batch's windows (engine_requests), in order."""
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
