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

import errno
import os
import time
import traceback
import uuid
from dataclasses import asdict
from datetime import datetime, timezone

from docproc.errors import EnvironmentFault, OutputUnwritable
from docproc.pipeline.documents import DocumentWork, Reporter
from docproc.pipeline.engine_setup import PROMPT_VERSION
from docproc.pipeline.feed import Feed
from docproc.pipeline.streamer import _Streamer
from docproc.pipeline.ingest import Candidate, discover, display_name, searched_roots
from docproc.pipeline.queries import load_queries
from docproc.pipeline.reconcile import ConfigHistory, reconcile
from docproc.pipeline.runstore import RunStore
from docproc.pipeline.settings import RunSettings, RunTotals
from docproc.pipeline.signals import EXIT_INTERRUPTED, RunInterrupted, signals_raise
from docproc.pipeline.typed import documents_table

__all__ = ["Pipeline", "RunSettings", "RunTotals", "UsageError", "PROMPT_VERSION"]

FAILURES_LISTED = 20  # failed files named in a manifest (docproc stats --failures lists all)


class UsageError(ValueError):
    """The run cannot start as asked (inputs, output folder); nothing was done."""


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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


class Pipeline(DocumentWork):
    """A run over OUT: discovery against OUT's stored rows, the document work (DocumentWork),
    rows written as documents finish, removals, the manifest."""
    config_changed: dict | None = None  # documents done before and redone since the configuration changed
    # with nothing done in OUT and no cached fingerprint, the fingerprint waits for the engine's
    # load (which then overlaps rendering) instead of loading the model before discovery
    defer_fingerprint = True
    STAGES = ("discover", "open_render_hash", "engine", "write", "load_model")

    def __init__(self, settings: RunSettings, llm=None, reporter: Reporter | None = None) -> None:
        """Checks the inputs, the output folder's place and the query set; UsageError or
        QueryFileError before anything is loaded or written."""
        self.s = settings
        self._check_paths()
        self.store = RunStore(settings.out)
        run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ") + "-" + uuid.uuid4().hex[:6]
        super().__init__(settings, load_queries(settings.queries), run_id,
                         _quiet_on_failure(reporter or (lambda event, data: None)), llm)

    def _check_paths(self) -> None:
        out = os.path.realpath(self.s.out)
        for inp in self.s.inputs:
            for look in (os.lstat, os.stat):  # the path itself, then what a link names
                try:
                    look(inp)
                except OSError as e:
                    raise UsageError(
                        f"input {inp} is (or passes through) a symbolic link loop" if e.errno == errno.ELOOP else
                        f"input {inp} does not exist" if look is os.lstat and e.errno in (errno.ENOENT, errno.ENOTDIR)
                        else f"input {inp} is a broken symbolic link" if e.errno in (errno.ENOENT, errno.ENOTDIR)
                        else f"input {inp} cannot be read: {e.strerror}") from None
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
        self._json_gone: list[str] = []
        self.documents_written = 0
        self._part = self._first_part = None  # (the part numbers this run writes from)
        try:
            with signals_raise() as signals:
                try:
                    self._part = self._first_part = self.store.next_part()
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
                    else:  # those whose rows were written before it (the rest are redone next time)
                        fault["documents_kept"] = self.documents_written
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
        that stopped before it wrote any row leaves the tables as the runs before it left them (none
        at all before a first row): a run refused for its query set (a schema the grammar backend
        cannot compile) must not rewrite documents.parquet with that set's columns. One stopped before
        its fingerprint was known (the engine had not loaded) drops its pending rows rather than load
        the model now: they can only be files settled without the engine (skips, unreadable files),
        which the next run settles again in moments."""
        if self.cfg is None:
            self._pending, self._json_gone = [], []
        if not self._pending and self._part == self._first_part:
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
        candidates = discover(self.s.inputs, exclude=self.store.own_folders())
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

    def _say_config_changed(self, candidates: list[Candidate]) -> None:
        """Documents done before under a configuration whose changes reach them are done again:
        a warning and the manifest say how many, and which components changed."""
        by_cfg: dict[str, int] = {}
        for c in candidates:
            stored = self._plan.done.get(c.rel)
            if c.skip_reason or stored is None or stored[1] == self.cfg:  # (the same: nothing to read)
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

    def _process(self) -> None:
        candidates = self._start()
        feed = Feed(candidates, self._verdict, self.pages_in_flight(), self.render_workers())
        try:
            _Streamer(self, feed).run()
        finally:
            feed.close()
        self._finish()

    def _finish(self) -> None:
        """A completed run's end: what is finished written, documents gone removed, the tables
        written, what a killed run left behind removed, missing JSON files written."""
        self._flush()
        self._remove_gone()
        table = self._consolidate()
        self._remove_stray(table)
        self._write_missing_json(table)

    def _reconcile(self, candidates: list[Candidate], rows: list[dict] | None = None) -> None:
        """What the stored rows (rows: OUT's current rows, read here when not given) say against
        what discovery found (docproc.pipeline.reconcile)."""
        if rows is None:
            rows = self.store.current().to_pylist()
        for f in sorted(self.store.damaged_parts):
            self.report("warning", {"message": f"{f} is damaged or is not one of docproc's tables: the documents "
                                               f"only it recorded are redone, and a run sets it aside as "
                                               f"{f.name}.damaged"})
        for f in sorted(self.store.unreadable_parts):
            self.report("warning", {"message": f"{f} cannot be read now: the documents only it recorded are redone, "
                                               f"and it is left where it is"})
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
        live = self._live_json()
        for k in removed:
            if self.store.json_path(k) not in live:
                self.store.remove_document_json(k)
        self._pending.append(("", [self._tombstone(k, root) for k, root in removed.items()], False))
        self._flush()
        self.totals.removed = len(removed)  # (a rename's old key went with its move)
        self._plan.removed = {}

    def _consolidate(self):
        """The result tables and documents.parquet written from every part; returns the current rows."""
        t0 = time.perf_counter()
        table = self.store.consolidate(fill_roots={k: self._roots[k] for k in self._plan.missing_roots},
                                       formats=self.s.formats)
        if self.store.writes_documents(self.s.formats):
            self.store.write_documents(documents_table(table, self.queries), self.s.formats)
        self.stage_seconds["write"] += time.perf_counter() - t0
        return table

    def _remove_stray(self, table) -> None:
        """At a completed run's end: what a killed run left between two writes (a JSON file of a
        document with no rows, temporary files) is removed, and said."""
        stray = self.store.stray_files(table)
        if stray:
            json_files = [p for p in stray if not p.name.startswith(".tmp-")]
            self.report("note", {"message": f"removing {len(stray)} file(s) an interrupted run left in {self.store.out}"
                                            + (f" ({len(json_files)} JSON file(s) of documents with no rows, first: "
                                               f"{json_files[0].name})" if json_files else "")})
            failed = self.store.remove_stray(stray)
            if failed:
                self.report("warning", {"message": f"{len(failed)} of them could not be removed (first: "
                                                   f"{failed[0][0]}: {failed[0][1]}); remove them by hand"})

    def _write_missing_json(self, table) -> None:
        """At a completed run's end: the JSON files of documents that have none (deleted by hand,
        or from runs without json in --format) are written from their rows, and said."""
        if "json" not in self.s.formats:
            return
        t0 = time.perf_counter()
        missing = self.store.missing_document_json(table)
        if missing:
            self.report("note", {"message": f"writing {len(missing)} document JSON file(s) missing from "
                                            f"{self.store.json_dir} from the rows"})
            failed = self.store.write_missing_json(missing)
            if failed:
                self.report("warning", {"message": (
                    f"{len(failed)} of them could not be written (first: {failed[0][0]}: {failed[0][1]}); "
                    f"results.parquet holds their answers")})
        self.stage_seconds["write"] += time.perf_counter() - t0

    def _manifest(self, started: str, seconds: float, status: str, fault: dict | None,
                  exit_code: int | None) -> dict:
        from docproc.engine.device import gpu_alloc_retries, peak_gpu_memory, peak_host_memory

        self.totals.unique_pages = len(self.page_hashes)
        t = self.totals
        info = self.llm.cache_info() if self.llm is not None else {}
        peak_gpu = peak_gpu_memory()
        return {
            "run_id": self.run_id, "started_at": started, "finished_at": _now(), "seconds": round(seconds, 3),
            # completed | interrupted (a signal) | failed (a fault of the environment: see fault)
            "status": status, "fault": fault,
            "settings": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.s).items()},
                         "batch_pages": self.pages_in_flight()},  # (the bound the run held, its default resolved)
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
            "peak_memory": {"host_max_rss_bytes": peak_host_memory(),
                            "gpu_max_allocated_bytes": peak_gpu, "gpu_alloc_retries": gpu_alloc_retries()},
            # failures: files that could not be read and documents with no usable answer at all;
            # a partial document (some fields unparseable or failed) is reported, not failed
            "exit_code": exit_code if exit_code is not None else (1 if t.errors else 0),
        }
