"""What a run writes for each document: its rows from the engine's answers (the first window
with an answer wins per query), error rows, moved rows, and the flush that writes a batch's
finished documents (their JSON files, then one Parquet part). A mixin of Pipeline (pipeline/run.py),
which holds the state these methods use: totals, failures, the run store and the pending rows."""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

from docproc.pipeline.ingest import Candidate, Document
from docproc.pipeline.constraints import SCHEMA_PROBLEM
from docproc.pipeline.queries import parse_answer
from docproc.pipeline.runstore import REMOVED
from docproc.pipeline.schema import document_json, is_bad, row_problem, to_table


@dataclass
class _Window:
    doc: "_DocState"
    index: int
    pages: list  # ingest.Page
    credits: int = 0  # the feed's page credits it holds (pipeline/feed.py): given back once answered


@dataclass
class _DocState:
    doc: Document
    windows_total: int = 0
    windows_done: int = 0
    answers: dict = field(default_factory=dict)  # query name -> list of (window, row)
    finished_adding: bool = False
    failure: tuple[str, str] | None = None  # (kind, message): the engine failed on this document
    dropped: bool = False  # failed as it was rendered (its error row is written): answers of its windows go unused


def answer_row(q, text: str, cut: bool, constrained: bool) -> dict:
    """value, status and error of a query's answer. Every answer is checked against its query's
    rule, choices or whole schema, decoded under them or not: a decoded answer can still break a
    schema keyword that decoding does not enforce (schema_violation). A constrained answer that
    met max_tokens is truncated: closed there by the engine. A JSON or string answer keeps its
    value (it parses; what it was writing may be cut, and what came after is null); a number or a
    date keeps none: closed where it was cut it would be one the model did not write (an amount
    with its last digits gone, a date with the shortest valid ending). Cut short of valid: no value."""
    problem = q.check(text)
    value, err = parse_answer(q.type, text, schema=q.schema is not None) if problem is None else (None, problem)
    if cut and constrained and q.structured_outputs() is not None:
        if err is not None:
            closed = f"cut short of valid ({err})"
        elif q.type not in ("number", "date"):
            closed = "closed there: its last value may be cut short"
        else:
            closed, value = (f"closed there: a {q.type} cut short is no value (the answer column holds the text)",
                             None)
        return {"value": value, "status": "truncated",
                "error": f"the answer reached max_tokens ({q.max_tokens}) and was {closed}; raise the query's "
                         f"max_tokens"}
    if err is None:
        return {"value": value, "status": "ok" if value is not None else "empty", "error": None}
    if problem is not None and q.schema is not None and problem.startswith(SCHEMA_PROBLEM):
        return {"value": None, "status": "schema_violation", "error": problem}
    return {"value": None, "status": "parse_error", "error": err}


def window_requests(w: _Window, queries) -> list[tuple]:
    """The requests a window asks, in order: (query, None) for each query asked of the window's
    pages together, then (query, page) for each per-page query and page of the window."""
    whole = [(q, None) for q in queries.queries if not q.per_page]
    return whole + [(q, page) for q in queries.queries if q.per_page for page in w.pages]


def engine_requests(w: _Window, queries) -> list[tuple]:
    """The window's requests the engine answers (window_requests but a per-page query's request
    for a blank page: asked about a page with nothing on it, a model invents an answer)."""
    return [(q, page) for q, page in window_requests(w, queries) if page is None or not page.blank]


def _page_number(page) -> int | None:
    return None if page is None else page.index + 1


def _blank_row(q, page) -> dict:
    """A query's row for pages with nothing on them: empty, no engine work."""
    return {"query": q.name, "query_type": q.type, "page": _page_number(page), "answer": "", "value": None,
            "status": "empty", "error": None, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
            "draft_proposed": 0, "draft_accepted": 0, "draft_verifications": 0, "latency_s": 0.0}


class DocumentRows:
    def _answers(self, w: _Window, outs: list) -> None:
        """One window's outputs (one per request of engine_requests) as rows of its document,
        counted in the totals; a per-page query's row for a blank page is empty."""
        rows = []
        for q, page in window_requests(w, self.queries):
            if page is not None and page.blank:
                w.doc.answers.setdefault(q.name, []).append((w.index, _blank_row(q, page)))
        for (q, page), out in zip(engine_requests(w, self.queries), outs):
            m = out.metrics
            row = {"query": q.name, "query_type": q.type, "page": _page_number(page), "answer": out.outputs[0].text,
                   "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                   "generated_tokens": m.num_generated_tokens, "draft_proposed": m.draft_proposed,
                   "draft_accepted": m.draft_accepted, "draft_verifications": m.draft_verifications,
                   "latency_s": round(m.total_time, 4)}
            if out.error:
                row.update(value=None, status="error", error=out.error, error_kind="engine")
            else:
                row.update(answer_row(q, out.outputs[0].text, out.outputs[0].finish_reason == "length",
                                      self.constrain))
            rows.append((q, m, row))
        for q, m, row in rows:  # counted only once every row of the window is made
            self.totals.requests += 1
            self.totals.prompt_tokens += m.num_prompt_tokens
            self.totals.cached_tokens += m.num_cached_tokens
            self.totals.generated_tokens += m.num_generated_tokens
            self.totals.draft_proposed += m.draft_proposed
            self.totals.draft_accepted += m.draft_accepted
            self.totals.draft_verifications += m.draft_verifications
            w.doc.answers.setdefault(q.name, []).append((w.index, row))

    def _blank_answers(self, w: _Window) -> None:
        """A window whose pages are all blank: each query's row is empty, with no engine work."""
        self.totals.blank_pages += len(w.pages)
        for q, page in window_requests(w, self.queries):
            w.doc.answers.setdefault(q.name, []).append((w.index, _blank_row(q, page)))

    def _finish_document(self, state: _DocState) -> None:
        doc = state.doc
        if state.failure is not None:
            doc.close()
            kind, message = state.failure
            self._file_row(doc.candidate, doc.sha256, "error", message, kind)
            return
        rows = []
        for q in self.queries.queries:
            if q.per_page:  # a row per page, each page asked alone
                rows.extend(sorted((r for _, r in state.answers.get(q.name, [])), key=lambda r: r["page"]))
                continue
            candidates = sorted(state.answers.get(q.name, []), key=lambda x: x[0])
            chosen = next((r for _, r in candidates if r["status"] == "ok"), None) or \
                next((r for _, r in candidates if r["status"] == "empty"), None) or candidates[0][1]
            merged = dict(chosen)
            for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "draft_proposed", "draft_accepted",
                      "draft_verifications"):
                merged[k] = sum(r[k] for _, r in candidates)
            merged["latency_s"] = round(sum(r["latency_s"] for _, r in candidates), 4)
            rows.append(merged)
        bad = sum(is_bad(r) for r in rows)  # (a JSON or string answer closed at max_tokens keeps its value: not bad)
        status = "ok" if bad == 0 else ("error" if bad == len(rows) else "partial")
        self.totals.documents += 1
        if status == "error":
            self.totals.errors += 1
            reason = next(row_problem(r) for r in rows if r["error"])
            self.failures.append({"path": doc.candidate.rel, "kind": rows[0].get("error_kind") or "answers",
                                  "error": reason})
        else:
            setattr(self.totals, status, getattr(self.totals, status) + 1)
        base = {"run_id": self.run_id, "path": doc.candidate.rel, "root": doc.candidate.root,
                "doc_sha256": doc.sha256, "doc_status": status, "pages": doc.num_pages,
                "config_fingerprint": self.cfg}
        full = [{**base, **r} for r in rows]
        if doc.truncated:
            for r in full:
                r["error"] = (r["error"] + "; " if r["error"] else "") + \
                    f"only the first {doc.num_pages} of {doc.num_pages_total} pages were read (--max-pages)"
        doc.close()
        self._pending.append((doc.candidate.rel, full, True))
        self.report("document", {"path": doc.candidate.rel, "status": status, "pages": doc.num_pages})

    def _file_row(self, cand: Candidate, sha: str | None, status: str, error: str, kind: str | None) -> None:
        if status == "error":
            self.totals.errors += 1
            self.failures.append({"path": cand.rel, "kind": kind, "error": error})
        row = {"run_id": self.run_id, "path": cand.rel, "root": cand.root, "doc_sha256": sha, "doc_status": status,
               "pages": None, "query": None, "status": status, "error": error, "error_kind": kind,
               "config_fingerprint": self.cfg}
        self._pending.append((cand.rel, [row], True))
        self.report("document", {"path": cand.rel, "status": status, "error": error, "error_kind": kind})

    def _move(self, cand: Candidate, old_rows: list[dict]) -> None:
        """A renamed file: the removed document's rows under the new key, the model not run, and
        the old key's removal in the same part (a run stopped after that part holds the document
        once, under its new key); the old key's JSON file goes first, at the flush."""
        old = old_rows[0]["path"]
        rows = [{**r, "path": cand.rel, "root": cand.root} for r in old_rows]
        self.totals.moved += 1
        self._pending.append((cand.rel, rows, True))
        if old in self._plan.removed:  # (several files with its bytes: the first move takes it)
            self._json_gone.append(old)
            self._pending.append(("", [self._tombstone(old, self._plan.removed.pop(old))], False))
        self.report("document", {"path": cand.rel, "status": "moved", "from": old})

    def _tombstone(self, key: str, root: str | None) -> dict:
        """The row that removes a document from OUT's current rows."""
        return {"run_id": self.run_id, "path": key, "root": root, "doc_status": REMOVED, "status": REMOVED,
                "config_fingerprint": self.cfg or ""}

    def _remove_json_gone(self) -> None:
        """The JSON files of documents removed by this flush (moved away), before their tombstones
        are written; one that is also a live document's file stays."""
        gone, self._json_gone = self._json_gone, []
        for key in gone:
            if self.store.json_path(key) not in self._live_json():
                self.store.remove_document_json(key)

    def _live_json(self) -> set:
        """The JSON files of the documents this run found (made once a run: every flush with a
        move asks)."""
        if getattr(self, "_live_json_for", None) is not self._roots:
            self._live_json_paths = {self.store.json_path(k) for k in self._roots}
            self._live_json_for = self._roots
        return self._live_json_paths

    def _flush(self) -> None:
        """Write the finished documents: their JSON files first, then one part with all their rows
        (a document is "done" only once its part exists). A document whose rows or JSON cannot be
        made is written as one error row instead (the write stage's per-document boundary)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        self._remove_json_gone()
        cfg = self.fingerprint_now()
        for _, rows, _ in self._pending:  # (rows made before the fingerprint was known)
            for r in rows:
                if r.get("config_fingerprint") is None:
                    r["config_fingerprint"] = cfg
        rows_out, created = [], []
        try:
            for rel, rows, write_json in self._pending:
                try:
                    to_table(rows)  # cheap, and it is what the part will take
                    doc = document_json(rows) if write_json and "json" in self.s.formats else None
                except Exception as e:  # noqa: BLE001
                    rows = [self._unwritable(rel, rows, e)]
                    try:
                        doc = document_json(rows) if write_json and "json" in self.s.formats else None
                    except Exception:  # noqa: BLE001 -- the table row stands on its own
                        doc = None
                if doc is not None:
                    new = not self.store.json_path(rel).exists()
                    self.store.write_document_json(rel, doc)
                    if new:
                        created.append(rel)
                elif write_json:  # --format without json: an earlier run's file would now be stale
                    self.store.remove_document_json(rel)
                rows_out.extend(rows)
            self.store.write_part(self._part, rows_out)
        except Exception:
            # (a full disk): the JSON files this flush made for documents without rows go again, so
            # that none stays without its rows; the next run redoes them. A file that was there
            # (a document redone) keeps the newer answers beside its older rows until then.
            for rel in created:
                self.store.remove_document_json(rel)  # (never raises OSError)
            raise
        self.documents_written += sum(1 for rel, _, _ in self._pending if rel)  # (not the removals' tombstones)
        self._part += 1
        self._pending = []
        self.stage_seconds["write"] += time.perf_counter() - t0

    def _unwritable(self, rel: str, rows: list[dict], e: Exception) -> dict:
        """The error row that replaces a document's rows when they cannot be written."""
        first = rows[0]
        was = first.get("doc_status")
        if was in ("ok", "partial"):
            setattr(self.totals, was, getattr(self.totals, was) - 1)
        if was != "error":
            self.totals.errors += 1
        message = f"{type(e).__name__}: {e}"
        self.failures.append({"path": rel, "kind": "internal", "error": message})
        if self.s.debug:
            traceback.print_exception(e)
        return {"run_id": self.run_id, "path": rel, "root": first.get("root"), "doc_sha256": first.get("doc_sha256"),
                "doc_status": "error", "pages": None, "query": None, "status": "error", "error": message,
                "error_kind": "internal", "config_fingerprint": self.cfg}
