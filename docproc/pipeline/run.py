"""`docproc run`: documents in, extractions out, in bounded batches.

Flow per batch: open documents lazily, render their pages window by window, build one request per
(query, window) -- every query of a document shares the document's page prefix, and a batch keeps
a document's requests together so the prefix is computed once -- run the engine, parse answers,
and flush the finished documents' rows atomically. A document whose pages exceed the prompt's
image-token budget is split into consecutive windows of pages; each query is asked of every
window and the first window (in page order) with a non-empty parsed answer wins. With
--anchor-text, each born-digital PDF page's text layer (with coordinates) follows the images in
the prompt, inside the shared prefix.
"""
from __future__ import annotations

import hashlib
import json
import resource
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from docproc.pipeline.ingest import Candidate, Document, DocumentError, discover, open_document
from docproc.pipeline.queries import Query, QuerySet, build_prompt, load_queries, parse_answer
from docproc.pipeline.runstore import RunStore
from docproc.pipeline.schema import document_json

PROMPT_VERSION = "v1"
# runs/<this>: configuration fingerprints of earlier runs, keyed by what they were computed from
# (Pipeline.config_key), so that a run with nothing new to do need not load the model
CONFIG_CACHE = "config_cache.json"
CONFIG_CACHE_ENTRIES = 16


# Bumped when what config_fingerprint computes changes without a setting changing, so that cached
# entries (runs/config_cache.json) made under the old rules are not reused: 2 = the FP4 value slot
# default went from 2 to 0 (twentieth session).
FINGERPRINT_RULES = 2


@dataclass
class RunSettings:
    inputs: list[str]
    out: str
    model: str
    queries: str | None = None
    device: str = "auto"
    kv_cache: str = "auto"
    dpi: int = 120
    max_pages: int | None = None
    formats: tuple[str, ...] = ("json", "parquet")
    force: bool = False
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    batch_pages: int = 32  # pages per engine batch: bounds memory
    max_image_tokens: int = 16384  # per prompt; more pages are split into windows
    seed: int = 0
    draft: str | None = None  # speculative decoding: the draft model folder
    spec_k: str = "auto"  # a number or "auto"
    draft_vision: str = "auto"
    anchor_text: bool = False  # put each PDF page's text layer (with coordinates) in the prompt
    enforce_eager: bool = False  # no CUDA graphs (debugging, profiling)
    fp4_value_slots: int | None = None  # FP4 KV: outlier slots per value vector (0, the default, or 2 as the keys)

    def __post_init__(self) -> None:
        bad = set(self.formats) - {"json", "parquet"}
        if bad or not self.formats:
            raise ValueError(f"--format takes json and/or parquet, got {','.join(self.formats)}")
        if self.dpi < 10 or self.dpi > 1200:
            raise ValueError(f"--dpi must be between 10 and 1200, got {self.dpi}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"--max-pages must be >= 1, got {self.max_pages}")
        if self.draft_vision not in ("auto", "own", "none"):
            raise ValueError(f"--draft-vision must be auto, own or none, got {self.draft_vision}")
        if self.spec_k != "auto" and not (self.spec_k.isdigit() and 1 <= int(self.spec_k) <= 15):
            raise ValueError(f"--spec-k must be a number from 1 to 15 or auto, got {self.spec_k}")
        if self.kv_cache not in ("auto", "bf16", "fp16", "fp32", "fp4"):
            raise ValueError(f"--kv-cache must be auto, bf16, fp16, fp32 or fp4, got {self.kv_cache}")
        if self.fp4_value_slots not in (None, 0, 2):
            raise ValueError(f"--fp4-value-slots must be 0 or 2, got {self.fp4_value_slots}")


@dataclass
class RunTotals:
    files: int = 0
    documents: int = 0  # documents processed this run
    ok: int = 0
    partial: int = 0
    errors: int = 0
    skipped: int = 0  # unsupported files, symlinks out of the root
    already_done: int = 0  # same path, hash and configuration as an earlier run
    pages: int = 0
    unique_pages: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_verifications: int = 0


@dataclass
class _Window:
    doc: "_DocState"
    index: int
    pages: list  # ingest.Page


@dataclass
class _DocState:
    doc: Document
    windows_total: int = 0
    windows_done: int = 0
    answers: dict = field(default_factory=dict)  # query name -> list of (window, row)
    finished_adding: bool = False


def window_anchor(pages) -> str | None:
    """The anchor text of a window: each page's text layer under its page number; None when no
    page has one (scans), so their prompts stay exactly the plain ones."""
    parts = [f"Page {p.index + 1}:\n{p.text}" for p in pages if p.text]
    return "\n".join(parts) if parts else None


Reporter = Callable[[str, dict], None]  # (event, data): "start", "document", "batch", "end"


def _now() -> str:
    # microseconds: runs that start within one second (cron, tests) must still order
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


class Pipeline:
    def __init__(self, settings: RunSettings, llm=None, reporter: Reporter | None = None) -> None:
        self.s = settings
        self.store = RunStore(settings.out)
        self.queries: QuerySet = load_queries(settings.queries)
        self.llm = llm
        self.report = reporter or (lambda event, data: None)
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ") + "-" + uuid.uuid4().hex[:6]
        self.totals = RunTotals()
        self.stage_seconds = {"discover": 0.0, "open_render_hash": 0.0, "engine": 0.0, "write": 0.0,
                              "load_model": 0.0}
        self.page_hashes: set[str] = set()
        self._cached_model: dict | None = None  # the model's fingerprints from the config cache
        self._cached_cfg: str | None = None  # the fingerprint taken from the cache, until checked
        self._key: str | None = None  # config_key() of this run
        self.cfg: str | None = None  # the run's configuration fingerprint

    # ---- configuration ---------------------------------------------------------------------
    def config_key(self) -> str | None:
        """What a run's configuration fingerprint is computed from, short of loading the model: the
        model and draft folders' files (name, size, modification time), every setting but the
        inputs and outputs, the query set, the prompt version, docproc's version and whether CUDA
        is there (`auto` choices depend on it). None when a folder is missing (loading it will say
        why)."""
        import torch

        from docproc import __version__

        stamps = {}
        for name, folder in (("model", self.s.model), ("draft", self.s.draft)):
            if folder is None:
                continue
            root = Path(folder)
            if not root.is_dir():
                return None
            stamps[name] = sorted((str(f.relative_to(root)), st.st_size, st.st_mtime_ns)
                                  for f in root.rglob("*") if f.is_file() for st in [f.stat()])
        settings = {k: v for k, v in asdict(self.s).items() if k not in ("inputs", "out", "force", "formats")}
        payload = {"files": stamps, "settings": settings, "queries": self.queries.fingerprint,
                   "prompt": PROMPT_VERSION, "docproc": __version__, "cuda": torch.cuda.is_available(),
                   "rules": FINGERPRINT_RULES}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    def _config_cache_path(self) -> Path:
        return self.store.runs_dir / CONFIG_CACHE

    def _read_config_cache(self) -> dict:
        try:
            data = json.loads(self._config_cache_path().read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):  # none yet, or unreadable: it is only a cache
            return {}

    def _write_config_cache(self, key: str, cfg: str) -> None:
        from docproc.pipeline.runstore import atomic_write_bytes

        cache = self._read_config_cache()
        cache.pop(key, None)
        cache[key] = {"config_fingerprint": cfg, "model": self.model_fingerprint()}
        keep = dict(list(cache.items())[-CONFIG_CACHE_ENTRIES:])  # the most recent last
        self.store.runs_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self._config_cache_path(), json.dumps(keep, indent=1).encode())

    def _config(self) -> str:
        """The configuration fingerprint: from the config cache when an earlier run computed it from
        the same files and settings (the model is then loaded only if a document needs work), else
        from the loaded engine (and cached)."""
        key = self._key = self.config_key()
        if key is not None and self.llm is None:
            hit = self._read_config_cache().get(key)
            if isinstance(hit, dict) and isinstance(hit.get("config_fingerprint"), str):
                self._cached_model = hit.get("model")
                self._cached_cfg = hit["config_fingerprint"]
                return self._cached_cfg
        cfg = self.config_fingerprint()
        if key is not None:
            self._write_config_cache(key, cfg)
        return cfg

    def _engine(self):
        if self.llm is None:
            from docproc import LLM

            t0 = time.perf_counter()
            self.llm = LLM(self.s.model, device=self.s.device, kv_cache_dtype=self.s.kv_cache,
                           max_num_batched_tokens=self.s.max_num_batched_tokens,
                           gpu_memory_utilization=self.s.gpu_memory_utilization, seed=self.s.seed,
                           speculative_model=self.s.draft, num_speculative_tokens=self.s.spec_k,
                           draft_vision=self.s.draft_vision, enforce_eager=self.s.enforce_eager,
                           fp4_value_slots=self.s.fp4_value_slots)
            self.stage_seconds["load_model"] += time.perf_counter() - t0
            cached = self._cached_cfg
            if cached is not None:
                real = self.config_fingerprint()
                if real != cached:
                    # the cache missed a change its key does not see: the rest of the run uses the
                    # real fingerprint, and the cache is corrected (documents this run skipped as
                    # done under the stale one are checked again by the next run)
                    self.cfg, self._cached_cfg = real, None
                    self._write_config_cache(self._key, real)
                    self.report("warning", {"message": "the cached configuration fingerprint was stale; "
                                                       "documents skipped as done are rechecked by the next run"})
        return self.llm

    def model_fingerprint(self) -> dict:
        if self.llm is None and self._cached_model:
            return dict(self._cached_model)
        m = self._engine().runner.model
        return {"text": m.text_fingerprint, "vision": m.vision_fingerprint}

    def config_fingerprint(self) -> str:
        info = self._engine().cache_info()
        spec = self._engine().spec_info()
        # greedy speculation is lossless, but sampled output depends on the draft: fingerprint it
        draft = spec["draft_fingerprint"] if spec else None
        payload = {"queries": self.queries.fingerprint, "model": self.model_fingerprint(), "draft": draft,
                   "dpi": self.s.dpi, "max_pages": self.s.max_pages, "kv_cache": info["kv_cache_dtype"],
                   "dtype": info["dtype"], "max_image_tokens": self.s.max_image_tokens, "prompt": PROMPT_VERSION}
        if self.s.anchor_text:  # only when on: runs without it keep their fingerprints
            payload["anchor_text"] = True
        if info["kv_cache_dtype"] == "fp4":
            # always: the default changed from 2 to 0 (twentieth session), and a run made with 2 by
            # default carried no entry, so an entry-less fingerprint must not match either
            payload["fp4_value_slots"] = info["fp4_value_slots"]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    # ---- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        started = _now()
        t_start = time.perf_counter()
        self.store.lock()
        try:
            self.cfg = self._config()  # read at each use below: loading the engine may correct it
            done = set() if self.s.force else self.store.done_keys()
            t0 = time.perf_counter()
            candidates = list(discover(self.s.inputs))
            self.stage_seconds["discover"] += time.perf_counter() - t0
            self.totals.files = len(candidates)
            self.report("start", {"run_id": self.run_id, "files": len(candidates)})
            self._part = self.store.next_part()
            self._rows_pending: list[dict] = []
            self._docs_pending: list[tuple[str, list[dict]]] = []
            batch: list[_Window] = []
            batch_pages = 0
            for cand in candidates:
                if cand.skip_reason:
                    self.totals.skipped += 1
                    self._finish_file(cand, None, "skipped", self.cfg, error=cand.skip_reason)
                    continue
                t0 = time.perf_counter()
                try:
                    doc = open_document(cand, dpi=self.s.dpi, max_pages=self.s.max_pages,
                                        with_text=self.s.anchor_text)
                except DocumentError as e:
                    self.stage_seconds["open_render_hash"] += time.perf_counter() - t0
                    self.totals.errors += 1
                    self._finish_file(cand, None, "error", self.cfg, error=str(e))
                    continue
                self.stage_seconds["open_render_hash"] += time.perf_counter() - t0
                if (cand.rel, doc.sha256, self.cfg) in done:
                    doc.close()
                    self.totals.already_done += 1
                    self.report("document", {"path": cand.rel, "status": "already done"})
                    continue
                state = _DocState(doc)
                try:
                    for window in self._windows(state):
                        batch.append(window)
                        batch_pages += len(window.pages)
                        if batch_pages >= self.s.batch_pages:
                            self._run_batch(batch, self.cfg)
                            batch, batch_pages = [], 0
                except DocumentError as e:  # a page failed to render part-way
                    batch = [w for w in batch if w.doc is not state]
                    batch_pages = sum(len(w.pages) for w in batch)
                    doc.close()
                    self.totals.errors += 1
                    self._finish_file(cand, doc.sha256, "error", self.cfg, error=str(e))
                    continue
                state.finished_adding = True
                if state.windows_done == state.windows_total:  # all its windows already ran
                    self._finish_document(state, self.cfg)
            if batch:
                self._run_batch(batch, self.cfg)
            self._flush()
            t0 = time.perf_counter()
            if "parquet" in self.s.formats:
                self.store.consolidate()
            self.stage_seconds["write"] += time.perf_counter() - t0
            manifest = self._manifest(started, time.perf_counter() - t_start, self.cfg)
            self.store.write_manifest(self.run_id, manifest)
            self.report("end", manifest)
            return manifest
        finally:
            self.store.unlock()

    def _windows(self, state: _DocState):
        """Consecutive windows of a document's pages within the image-token budget, rendered
        lazily (a window's pages are the only ones in memory for this document)."""
        llm = self._engine()
        budget = min(self.s.max_image_tokens, llm.max_model_len - 1024)
        doc = state.doc
        pages, tokens = [], 0
        t0 = time.perf_counter()
        for i in range(doc.num_pages):
            page = doc.page(i)
            self.totals.pages += 1
            self.page_hashes.add(page.sha256)
            grid = llm.processor.grid_thw(page.image)
            n = grid[0] * grid[1] * grid[2] // llm.processor.merge_size ** 2
            if page.text:  # the anchor text shares the window's budget with the images
                n += len(llm.tokenizer.encode(page.text, add_special_tokens=False)) + 8
            if pages and tokens + n > budget:
                self.stage_seconds["open_render_hash"] += time.perf_counter() - t0
                state.windows_total += 1
                yield _Window(state, state.windows_total - 1, pages)
                t0 = time.perf_counter()
                pages, tokens = [], 0
            pages.append(page)
            tokens += n
        self.stage_seconds["open_render_hash"] += time.perf_counter() - t0
        state.windows_total += 1
        yield _Window(state, state.windows_total - 1, pages)

    def _run_batch(self, batch: list[_Window], cfg: str) -> None:
        from docproc import SamplingParams

        llm = self._engine()
        prompts, params, meta = [], [], []
        for w in batch:  # a document's queries stay together: its prefix is computed once
            images = [p.image for p in w.pages]
            uuids = [p.sha256 for p in w.pages]
            anchor = window_anchor(w.pages) if self.s.anchor_text else None
            for q in self.queries.queries:
                prompts.append({"prompt": build_prompt(len(images), q.question, anchor),
                                "multi_modal_data": {"image": images}, "multi_modal_uuids": {"image": uuids}})
                params.append(SamplingParams(temperature=0.0, max_tokens=q.max_tokens))
                meta.append((w, q))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        self.stage_seconds["engine"] += time.perf_counter() - t0
        for (w, q), out in zip(meta, outs):
            m = out.metrics
            row = {"query": q.name, "query_type": q.type, "answer": out.outputs[0].text,
                   "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                   "generated_tokens": m.num_generated_tokens, "draft_proposed": m.draft_proposed,
                   "draft_accepted": m.draft_accepted, "draft_verifications": m.draft_verifications,
                   "latency_s": round(m.total_time, 4)}
            self.totals.requests += 1
            self.totals.prompt_tokens += m.num_prompt_tokens
            self.totals.cached_tokens += m.num_cached_tokens
            self.totals.generated_tokens += m.num_generated_tokens
            self.totals.draft_proposed += m.draft_proposed
            self.totals.draft_accepted += m.draft_accepted
            self.totals.draft_verifications += m.draft_verifications
            if out.error:
                row.update(value=None, status="error", error=out.error)
            else:
                value, err = parse_answer(q.type, out.outputs[0].text)
                row.update(value=value, status="parse_error" if err else ("ok" if value is not None else "empty"),
                           error=err)
            w.doc.answers.setdefault(q.name, []).append((w.index, row))
        for w in batch:
            w.doc.windows_done += 1
        for state in {id(w.doc): w.doc for w in batch}.values():
            if state.finished_adding and state.windows_done == state.windows_total:
                self._finish_document(state, cfg)
        self.report("batch", {"totals": asdict(self.totals), "unique_pages": len(self.page_hashes),
                              "engine_seconds": self.stage_seconds["engine"]})
        self._flush()

    def _finish_document(self, state: _DocState, cfg: str) -> None:
        doc = state.doc
        rows = []
        for q in self.queries.queries:
            candidates = sorted(state.answers.get(q.name, []), key=lambda x: x[0])
            chosen = next((r for _, r in candidates if r["status"] == "ok"), None) or \
                next((r for _, r in candidates if r["status"] == "empty"), None) or candidates[0][1]
            merged = dict(chosen)
            for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "draft_proposed", "draft_accepted",
                      "draft_verifications"):
                merged[k] = sum(r[k] for _, r in candidates)
            merged["latency_s"] = round(sum(r["latency_s"] for _, r in candidates), 4)
            rows.append(merged)
        bad = sum(r["status"] in ("error", "parse_error") for r in rows)
        status = "ok" if bad == 0 else ("error" if bad == len(rows) else "partial")
        self.totals.documents += 1
        setattr(self.totals, {"ok": "ok", "partial": "partial", "error": "errors"}[status],
                getattr(self.totals, {"ok": "ok", "partial": "partial", "error": "errors"}[status]) + 1)
        base = {"run_id": self.run_id, "path": doc.candidate.rel, "doc_sha256": doc.sha256, "doc_status": status,
                "pages": doc.num_pages, "config_fingerprint": cfg}
        full = [{**base, **r} for r in rows]
        if doc.truncated:
            for r in full:
                r["error"] = (r["error"] + "; " if r["error"] else "") + \
                    f"only the first {doc.num_pages} of {doc.num_pages_total} pages were read (--max-pages)"
        doc.close()
        self._docs_pending.append((doc.candidate.rel, full))
        self._rows_pending.extend(full)
        self.report("document", {"path": doc.candidate.rel, "status": status, "pages": doc.num_pages})

    def _finish_file(self, cand: Candidate, sha: str | None, status: str, cfg: str, error: str) -> None:
        row = {"run_id": self.run_id, "path": cand.rel, "doc_sha256": sha, "doc_status": status, "pages": None,
               "query": None, "status": status, "error": error, "config_fingerprint": cfg}
        self._docs_pending.append((cand.rel, [row]))
        self._rows_pending.append(row)
        self.report("document", {"path": cand.rel, "status": status, "error": error})

    def _flush(self) -> None:
        if not self._rows_pending:
            return
        t0 = time.perf_counter()
        # JSON first, the part last: a document is "done" only once its part exists
        if "json" in self.s.formats:
            for rel, rows in self._docs_pending:
                self.store.write_document_json(rel, document_json(rows))
        self.store.write_part(self._part, self._rows_pending)
        self._part += 1
        self._rows_pending, self._docs_pending = [], []
        self.stage_seconds["write"] += time.perf_counter() - t0

    def _manifest(self, started: str, seconds: float, cfg: str) -> dict:
        import torch

        self.totals.unique_pages = len(self.page_hashes)
        t = self.totals
        info = self.llm.cache_info() if self.llm is not None else {}
        peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        return {
            "run_id": self.run_id, "started_at": started, "finished_at": _now(), "seconds": round(seconds, 3),
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.s).items()},
            "query_set": {"name": self.queries.name, "fingerprint": self.queries.fingerprint,
                          "queries": [q.name for q in self.queries.queries], "source": self.queries.source},
            "model": {"path": self.s.model, **self.model_fingerprint()},
            "draft": self.llm.spec_info() if self.llm is not None else None,
            "config_fingerprint": cfg,
            "totals": asdict(t),
            "tokens_per_second": round(t.generated_tokens / self.stage_seconds["engine"], 2)
            if self.stage_seconds["engine"] > 0 else None,
            "acceptance_rate": (t.draft_accepted / t.draft_proposed) if t.draft_proposed else None,
            "prefix_cache_hit_rate": round(t.cached_tokens / t.prompt_tokens, 4) if t.prompt_tokens else None,
            "dedup": {"pages": t.pages, "unique_pages": t.unique_pages,
                      "vision_encodes": info.get("num_encoded_images")},
            "engine": info,
            "engine_loaded": self.llm is not None,  # false: nothing to do, the fingerprint came from the cache
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "peak_memory": {"host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "gpu_max_allocated_bytes": peak_gpu},
            # failures: files that could not be read and documents with no usable answer at all;
            # a partial document (some fields unparseable or failed) is reported, not failed
            "exit_code": 1 if t.errors else 0,
        }
