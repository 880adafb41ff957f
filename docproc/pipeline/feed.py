"""Documents made ready ahead of the engine: hashed and triaged on a thread, opened, rendered,
hashed per page and cut into windows by a pool of render processes, while the engine runs (and
while the model loads).

- The triage thread walks the candidates in order: a file's SHA-256 decides whether it is done
  already or a rename of a stored document (pipeline/run.py `verdict`); a document that needs the
  engine becomes a render job. It runs at most JOBS_AHEAD jobs ahead of the documents the
  engine has taken.
- Render workers are processes (MuPDF holds the GIL while it renders: a thread would stall the
  engine's step loop). Each opens a document, renders its pages in order, counts each page's
  image tokens as the engine will (the checkpoint's image processor, torch-free) and sends the
  document's windows as they close. Before a page is rendered a worker takes a credit from a
  shared pool of `pages_in_flight`; the run gives a window's credits back when the engine has
  answered it. A window already begun may overdraw the pool (its pages cannot be answered
  before it closes), so pages held are at most the bound plus one window per worker.
- A worker that dies (a crash in the PDF library, the out-of-memory killer) fails the document
  it was on, and a new one takes its place. Workers ignore SIGINT (the run stops them) and die
  with the run's process.

The run reads everything from `events`, in one thread: ("settled", candidate, sha, verdict) from
the triage, ("opened" | "window" | "failed", key, ...) from the workers (a window: its pages, the
credits they hold, whether it is the document's last, the seconds its pages took to render and
when, on the wall clock, the first of them began), ("end",) once the triage has walked every
candidate.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from docproc.pipeline.ingest import Candidate, DocumentError, open_document

JOBS_AHEAD = 16  # render jobs handed out and not yet taken by the engine
POLL_SECONDS = 0.5  # how often a wait looks at the workers' health


def default_workers() -> int:
    """Render processes: a quarter of the cores, 1 to 4 (one on a small machine: the engine's own
    CPU work needs the rest)."""
    return max(1, min(4, (os.cpu_count() or 2) // 4))


@dataclass
class WindowRules:
    """How a worker cuts a document into windows: what the engine counts a page as."""
    model: str  # the checkpoint folder (preprocessor_config.json, tokenizer.json)
    budget: int  # image tokens per prompt (anchor text included)
    merge_size: int  # patches merged per side into one token
    dpi: int
    max_pages: int | None
    anchor_text: bool


@dataclass
class RenderedDocument:
    """What the run keeps of a document the workers opened (rows.py's `_DocState.doc`)."""
    candidate: Candidate
    sha256: str
    num_pages: int
    num_pages_total: int
    truncated: bool

    def close(self) -> None:
        pass  # (the worker closed the file)


class _Counter:
    """A page's prompt tokens, as docproc.models.processor.Processor counts them."""

    def __init__(self, rules: WindowRules) -> None:
        from docproc.models.image_processor import ImageProcessor

        self.rules = rules
        self.ip = ImageProcessor.from_folder(rules.model)
        self._tokenizer = None

    def image_tokens(self, image) -> int:
        from docproc.multimodal import PromptError, padded_size

        w, h = padded_size(*image.size)
        try:
            rh, rw = self.ip.resized_size(h, w)
        except ValueError as e:
            raise PromptError(f"image of {w}x{h} pixels: {e}") from None
        p = self.ip.patch_size
        return (rh // p) * (rw // p) // self.rules.merge_size ** 2

    def text_tokens(self, text: str) -> int:
        if self._tokenizer is None:
            path = Path(self.rules.model) / "tokenizer.json"
            if path.is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(path))
                self._tokenizer = lambda t: len(tok.encode(t, add_special_tokens=False).ids)
            else:  # a checkpoint with another tokenizer format: the engine's own loader
                from docproc.models.processor import load_tokenizer

                slow = load_tokenizer(self.rules.model)
                self._tokenizer = lambda t: len(slow.encode(t, add_special_tokens=False))
        return self._tokenizer(text)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the run's process dies (kill -9 included)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- elsewhere the orphan check below stops it
        pass


class _Stopped(Exception):
    """The feed closed while a render thread waited for a credit."""


def _take(credits, stop: threading.Event | None) -> None:
    """One credit; a thread (stop given) gives up when the feed closes, since the credits of the
    windows dropped with it never come back (a process is killed instead)."""
    if stop is None:
        credits.acquire()
        return
    while not credits.acquire(timeout=POLL_SECONDS):
        if stop.is_set():
            raise _Stopped


def _worker(index: int, rules: WindowRules, jobs, results, credits, parent: int | None,
            stop: threading.Event | None = None) -> None:
    """A render worker's loop; parent None: a thread of the run's own process, which ends when
    `stop` is set (a feed closed before its documents were all rendered: a Ray actor's batch that
    failed leaves no thread behind)."""
    if parent is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (blocked until here: see Feed._spawn)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        _die_with_parent()
    counter = _Counter(rules)
    while True:
        try:
            job = jobs.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if (parent is not None and os.getppid() != parent) or (stop is not None and stop.is_set()):
                return
            continue
        if job is None or (stop is not None and stop.is_set()):
            return
        key, cand, sha = job
        results.put(("start", key, index))
        try:
            _render(key, cand, sha, rules, counter, results, credits, stop)
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 -- the document's outcome, whatever it raised
            if isinstance(e, DocumentError):
                results.put(("failed", key, e.kind, str(e), None))
            else:
                results.put(("failed", key, None, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _render(key: int, cand: Candidate, sha: str, rules: WindowRules, counter: _Counter, results, credits,
            stop: threading.Event | None = None) -> None:
    """Open, render and window one document. Each window goes with the seconds spent rendering
    its pages (waits for credits left out)."""
    _take(credits, stop)  # the first page: rendered as the document opens
    held = 1
    t0 = time.perf_counter()
    try:
        doc = open_document(cand, dpi=rules.dpi, max_pages=rules.max_pages, with_text=rules.anchor_text,
                            digest=sha)
    except BaseException:
        credits.release()
        raise
    try:
        results.put(("opened", key, doc.num_pages, doc.num_pages_total, doc.truncated))
        pages, tokens, index = [], 0, 0
        busy = time.perf_counter() - t0  # (opening renders page 1)
        began = time.time() - busy  # the window's first page began (wall clock: the run's own marks it)
        for i in range(doc.num_pages):
            got = 1  # (page 0's credit was taken as it opened)
            if i > 0 and pages:
                got = int(credits.acquire(False))  # inside a window: overdraw rather than wait on itself
            elif i > 0:
                _take(credits, stop)
            held += got if i > 0 else 0
            t1 = time.perf_counter()
            page = doc.page(i)
            n = counter.image_tokens(page.image)
            if page.text:  # the anchor text shares the window's budget with the images
                n += counter.text_tokens(page.text) + 8
            page.blank  # (worked out here, off the engine's process)
            took = time.perf_counter() - t1
            if pages and tokens + n > rules.budget:
                results.put(("window", key, index, pages, held - got, False, busy, began))
                index, held, pages, tokens, busy, began = index + 1, got, [], 0, 0.0, time.time() - took
                if not got:  # this page begins the next window: it waits for room like any window's first
                    _take(credits, stop)
                    held = 1
            pages.append(page)
            tokens += n
            busy += took
        results.put(("window", key, index, pages, held, True, busy, began))
        held = 0
    finally:
        doc.close()
        for _ in range(held):  # a document that failed part-way: the pages it held are given back
            credits.release()


class Feed:
    """Triage and rendering ahead of the engine. `start_rendering(rules)` starts the workers
    (the run calls it once the first document needs the engine, having read the checkpoint's
    window rules); `close()` stops everything."""

    def __init__(self, candidates: list[Candidate], verdict, pages_in_flight: int,
                 workers: int | None = None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.jobs: dict[int, tuple[Candidate, str]] = {}  # key -> (candidate, file hash), until it ends
        self._candidates = candidates
        self._verdict = verdict  # candidate -> ("render", sha) or ("settled", sha, outcome)
        self._ahead = threading.Semaphore(JOBS_AHEAD)
        self._stop = threading.Event()
        self.pages_in_flight = max(1, pages_in_flight)
        self.num_workers = default_workers() if workers is None else workers
        if self.num_workers:
            self._ctx = mp.get_context("spawn")
            self._job_queue, self._results = self._ctx.Queue(), self._ctx.Queue()
            self._credits = self._ctx.Semaphore(self.pages_in_flight)
        else:  # 0: one render thread in this process (debugging; MuPDF then shares the GIL with the engine)
            self._job_queue, self._results = queue.Queue(), queue.Queue()
            self._credits = threading.Semaphore(self.pages_in_flight)
        self._procs: dict[int, object] = {}  # worker index -> its process
        self._thread: threading.Thread | None = None  # the render thread, with workers=0
        self._on: dict[int, int] = {}  # worker index -> the key of the document it is rendering
        self._rules: WindowRules | None = None
        self._triage = threading.Thread(target=self._walk, name="docproc-triage", daemon=True)
        self._relay = threading.Thread(target=self._forward, name="docproc-relay", daemon=True)
        self._triage.start()

    # ---- the triage thread ----------------------------------------------------------------
    def _walk(self) -> None:
        try:
            for key, cand in enumerate(self._candidates):
                if self._stop.is_set():
                    return
                outcome = self._verdict(cand)
                if outcome[0] == "render":
                    while not self._ahead.acquire(timeout=POLL_SECONDS):
                        if self._stop.is_set():
                            return
                    self.jobs[key] = (cand, outcome[1])
                    self.events.put(("job", key))
                    self._job_queue.put((key, cand, outcome[1]))
                else:
                    self.events.put(("settled", cand) + tuple(outcome[1:]))
            self.events.put(("end",))
        except BaseException as e:  # noqa: BLE001 -- a bug of the triage: the run reports it
            self.events.put(("bug", e))

    def _forward(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._results.get(timeout=POLL_SECONDS)
            except (queue.Empty, EOFError, OSError):
                continue
            if msg[0] == "start":
                self._on[msg[2]] = msg[1]
            self.events.put(msg)

    # ---- the run's side -------------------------------------------------------------------
    @property
    def rendering(self) -> bool:
        return self._rules is not None

    def start_rendering(self, rules: WindowRules) -> None:
        self._rules = rules
        if self.num_workers:
            for i in range(self.num_workers):
                self._spawn(i)
        else:
            self._thread = threading.Thread(target=_worker, name="docproc-render", daemon=True,
                                            args=(0, rules, self._job_queue, self._results, self._credits, None,
                                                  self._stop))
            self._thread.start()
        self._relay.start()

    def _spawn(self, index: int) -> None:
        """Start a worker with SIGINT and SIGTERM blocked in it (inherited) until its loop begins:
        a Ctrl-C to the terminal's process group cannot cut its start-up. The run's own handler
        holds a signal while the start-up data is written (pipeline/signals.py)."""
        p = self._ctx.Process(target=_worker, name=f"docproc-render-{index}", daemon=True,
                              args=(index, self._rules, self._job_queue, self._results, self._credits, os.getpid()))
        was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            p.start()
            self._procs[index] = p
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, was)

    def next_event(self, block: bool):
        """The next event, or None when none is waiting (block: wait for one, looking at the
        workers' health meanwhile: a worker that died comes back as ("failed", key, "crashed",
        message, None) for the document it was on)."""
        while True:
            try:
                return self.events.get(block=block, timeout=POLL_SECONDS if block else None)
            except queue.Empty:
                dead = self._reap()
                if dead is not None:
                    return dead
                if not block:
                    return None

    def _reap(self):
        for index, p in list(self._procs.items()):
            if p.exitcode is not None and not self._stop.is_set():
                key = self._on.pop(index, None)
                self._spawn(index)
                if key is not None and key in self.jobs:
                    how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                    return ("failed", key, "crashed", f"the render process died on this document ({how}): a crash "
                                                      f"in the PDF or image library, or out of memory", None)
        return None

    def taken(self, key: int) -> None:
        """The document of a job has all its windows with the run (or failed): one more may be queued."""
        if self.jobs.pop(key, None) is not None:
            self._ahead.release()

    def give_back(self, credits: int) -> None:
        """Pages the engine has answered: their credits go back to the workers."""
        for _ in range(credits):
            self._credits.release()

    def close(self) -> None:
        self._stop.set()
        for p in self._procs.values():
            if p.is_alive():
                p.kill()
        for p in self._procs.values():
            p.join(timeout=5)
        if self.num_workers:
            for q in (self._job_queue, self._results):
                q.cancel_join_thread()
                q.close()
        else:
            self._job_queue.put(None)
            if self._thread is not None:  # (it sees the stop within POLL_SECONDS, or at its next page)
                self._thread.join(timeout=5)
