"""`docproc serve`: the engine behind OpenAI's HTTP API (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`), with `/health` and Prometheus `/metrics`.

One thread owns the engine (EngineLoop): requests join its RequestStream between steps and leave
as they finish, so concurrent clients share the engine's continuous batching, its prefix cache and
its vision cache. The HTTP side (Starlette on uvicorn, in the main thread) reads and checks a body
(protocol.parse, in a worker thread: images are read and PDFs rendered there), decodes its images
and checks its length there too, and compiles its constraint in threads of its own), hands the request
to the loop and waits for its events: the tokens so far after each step (streamed as server-sent
events) and the finished output. A client that goes away cancels its request. Bad input is a 4xx
with OpenAI's error body; SIGTERM or Ctrl-C stops taking connections, lets the requests in flight
finish, and exits.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import os
import queue
import re
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from docproc.openai_compat.protocol import CHAT, COMPLETIONS, Limits, Parsed, RequestError, parse, response_body

IN_FLIGHT = 256  # requests in the engine at once; more wait in the loop's queue
PIXELS_IN_FLIGHT = 400_000_000  # and their images' pixels
MAX_QUEUED = 1024  # requests waiting for the engine before new ones get 429
MAX_QUEUED_BYTES = 2 << 30  # and their bodies' bytes
MAX_QUEUED_PIXELS = 1_000_000_000  # and their decoded images' pixels (3 GB of RGB)
PREPARING = min(8, os.cpu_count() or 1)  # bodies parsed and their images decoded at once
TEXT_PREPARING = 2  # bodies without image or file parts, parsed beside those
GRAMMAR_THREADS = 2  # constraints compiled at once (a slow one holds up constrained requests only)
BODY_IDLE_SECONDS = 30  # a body that sends nothing for this long is cut off (408)
BODY_SECONDS = 300  # and one that takes longer in all
MAX_HELD_BYTES = 1 << 30  # bodies being read or parsed, in all (429 past it)
MAX_JSON_CONTAINERS = 100_000  # objects and arrays in a body (parsed, each costs ~100x its bytes)
JSON_STRING = re.compile(rb'"[^"]*"')  # (escapes taken out first: no backtracking, linear in the body)


def carries_images(raw: bytes) -> bool:
    """Whether a body may hold image or file parts (their type names, anywhere in it: a text
    body that only mentions them goes with the image bodies, which costs it a wait, never a
    wrong answer)."""
    return b"image_url" in raw or b'"file"' in raw


def containers(raw: bytes) -> int:
    """The objects and arrays JSON text holds: its brackets outside strings (escaped backslashes
    and quotes taken out first, so that every string is a quote, non-quotes, a quote)."""
    bare = JSON_STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b""))
    return bare.count(b"{") + bare.count(b"[")
MAX_LANE_WAITING = 256  # calls waiting for a worker thread (429 past it)
PDF_WORKERS, PDF_SECONDS = 2, 60  # worker processes rendering PDF parts, and the most a PDF may take
DRAIN_SECONDS = 300  # after SIGTERM, the most the requests in flight get to finish
MAX_CONNECTIONS = 4096  # past it, new connections get 503
HEADER_SECONDS = 30.0  # a request's line and headers must come within this of the connection or the last response
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class ClientGone(Exception):
    """The client closed its connection before its request was read."""


class Lane:
    """Worker threads that run blocking calls for the event loop. Daemon threads: a server that
    stops does not wait for a call in progress (a grammar that takes a minute to compile), as it
    would for a ThreadPoolExecutor's. 429 past MAX_LANE_WAITING calls waiting."""

    def __init__(self, threads: int, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting = 0  # (the event loop's thread only)
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    async def run(self, fn, *args):
        if self.waiting >= MAX_LANE_WAITING:
            raise HTTPError(429, f"{self.waiting} requests are waiting to be read: retry later", "rate_limit_error")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiting += 1
        try:
            self._calls.put((fn, args, loop, fut))
            return await fut
        finally:
            self.waiting -= 1

    def _work(self) -> None:
        while True:
            fn, args, loop, fut = self._calls.get()
            if fut.cancelled():  # its client went away while it waited
                continue
            try:
                result, error = fn(*args), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the event loop has closed
                return


def _ignore_sigint() -> None:
    """A PDF worker's start: Ctrl-C at the terminal (its process group) is the server's to
    handle; a drain still needs the renders in progress."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _settle(fut: asyncio.Future, result, error) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class PdfRenderer:
    """PDF parts rendered in worker processes: MuPDF holds the GIL while it renders, so in a
    thread one page of 20,000 paths stopped the engine and every other request for 21 s. A PDF
    that takes longer than PDF_SECONDS (waiting for a worker included) is refused (400) and the
    workers are replaced; the renders that were on them get 503 (retry) at once."""

    def __init__(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def __call__(self, data: bytes, limits, where: str) -> list:
        import dataclasses
        import multiprocessing

        from docproc.openai_compat.protocol import pdf_pages

        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(PDF_WORKERS, initializer=_ignore_sigint)
            pool = self._pool
            pending = pool.apply_async(pdf_pages, (data, dataclasses.replace(limits, render_pdf=None), where))
        deadline = time.monotonic() + PDF_SECONDS
        while True:
            try:
                return pending.get(0.25)
            except multiprocessing.TimeoutError:
                pass
            if self._pool is not pool:  # another render's timeout replaced the workers under this one
                raise HTTPError(503, "the PDF renderer restarted: retry", "server_error")
            if time.monotonic() >= deadline:
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                pool.terminate()
                raise RequestError(f"{where}: the PDF takes more than {PDF_SECONDS} s to render")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()


@dataclass(eq=False)  # a job is itself: compared by identity (a deque's remove, `in`)
class Job:
    """One HTTP request inside the engine loop. Events reach the handler through `events`:
    ("tokens", None) after a step that grew it (streaming requests only; the token ids per
    choice, None for a finished one, are in `latest`: one value however many steps the handler
    is behind), ("done", RequestOutput), or ("error", HTTPError)."""

    parsed: Parsed
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    nbytes: int = 0
    handle: Any = None  # RequestStream's, once it is in the engine
    sent: list = field(default_factory=list)  # token counts last posted, per choice
    arrival: float = field(default_factory=time.perf_counter)
    posted: float = 0.0  # when its tokens were last posted (streams: at most one post per interval)
    latest: Any = None  # the newest ("tokens") value not yet taken: one held, however slow the reader

    def post(self, event: tuple) -> None:
        post([(self, event)])


def post(events: list[tuple[Job, tuple]]) -> None:
    """Hand events to their jobs' event loops: one wake-up per loop, whatever their number."""
    by_loop: dict = {}
    for job, event in events:
        by_loop.setdefault(job.loop, []).append((job, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop has closed (the server is gone)
            pass


def _deliver(items: list) -> None:
    for job, event in items:
        if event[0] == "tokens":  # a stream's tokens so far: the newest replaces one not yet taken
            if job.latest is None:
                job.events.put_nowait(("tokens", None))
            job.latest = event[1]
        else:
            job.events.put_nowait(event)


class Histogram:
    def __init__(self, buckets: tuple) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [f"# TYPE {name} histogram"], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        acc += self.counts[-1]
        out += [f'{name}_bucket{{le="+Inf"}} {acc}', f"{name}_sum {self.sum:.6f}", f"{name}_count {acc}"]
        return out


class EngineLoop:
    """The thread that runs the engine: takes submitted jobs in between steps (at most IN_FLIGHT
    and PIXELS_IN_FLIGHT in the engine; the rest wait here, first come first served), runs a step
    whenever anything is in the engine, and posts each job's events. A stream's tokens are posted
    when its first ones come, then at most once every `stream_interval` seconds (0: after every
    step that grew it); its last ones come with its output."""

    def __init__(self, llm, stream_interval: float = 0.0) -> None:
        self.llm = llm
        self.stream_interval = stream_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit", job), ("cancel", job), ("stop", None)
        self._thread = threading.Thread(target=self._run, name="docproc-engine", daemon=True)
        self.failure: str | None = None  # the device failed: the loop stopped
        self.draining = False  # the server is stopping: bodies still arriving are refused
        self.on_failure = None  # called (from the loop's thread) when it stops for a failure
        self.queued = 0  # jobs submitted and not yet in the engine
        self.queued_bytes = 0
        self.queued_pixels = 0
        self.running = 0  # jobs in the engine
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish_reason -> requests
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop once the requests in flight are done (after abort: at once)."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def abort(self) -> None:
        """Fail every request in flight or waiting (503) and stop, without waiting for it."""
        self._inbox.put(("abort", None))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def admit(self, nbytes: int, pixels: int) -> None:
        """Count a request as waiting (its body's bytes, its decoded pixels), from when it is
        parsed: 429 past the bounds. Then submit() it, or withdraw() it."""
        if not self.alive:
            raise HTTPError(503, self.failure or "the engine is not running", "server_error")
        with self._lock:
            if self.queued and (self.queued >= MAX_QUEUED or self.queued_bytes + nbytes > MAX_QUEUED_BYTES
                                or self.queued_pixels + pixels > MAX_QUEUED_PIXELS):
                raise HTTPError(429, f"{self.queued} requests are waiting for the engine: retry later",
                                "rate_limit_error")
            self.queued += 1
            self.queued_bytes += nbytes
            self.queued_pixels += pixels

    def withdraw(self, nbytes: int, pixels: int) -> None:
        with self._lock:
            self.queued -= 1
            self.queued_bytes -= nbytes
            self.queued_pixels -= pixels

    def submit(self, job: Job) -> None:
        """Hand an admitted job to the engine's thread."""
        if not self.alive:
            self.withdraw(job.nbytes, job.parsed.pixels)
            raise HTTPError(503, self.failure or "the engine is not running", "server_error")
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        from docproc.engine.stream import RequestStream
        from docproc.errors import DeviceUnavailable

        stream = RequestStream(self.llm)
        waiting: deque[Job] = deque()
        live: dict[int, Job] = {}  # id(job) -> job, in the engine
        pixels = 0
        stopping = False
        while True:
            items = []
            if not live and not waiting and not stream.unfinished:
                if stopping:
                    return
                items.append(self._inbox.get())  # nothing to do: wait for a request
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, job in items:
                if kind == "abort":  # the server stops now (a second signal)
                    while True:  # (submitted after it, too)
                        try:
                            items.append(self._inbox.get_nowait())
                        except queue.Empty:
                            break
                    submitted = [one for k, one in items if k == "submit" and one not in waiting]
                    for one in [*live.values(), *waiting, *submitted]:
                        one.post(("error", HTTPError(503, "the server is stopping", "server_error")))
                    stream.abort()
                    self.running = 0
                    return
                if kind == "stop":
                    stopping = True
                elif kind == "submit":
                    waiting.append(job)
                elif kind == "cancel":
                    if job.handle is not None and id(job) in live:
                        stream.cancel(job.handle)
                    elif job in waiting:  # (its client left before it entered the engine)
                        waiting.remove(job)
                        self._dequeued(job)
                        self.finished["abort"] = self.finished.get("abort", 0) + job.parsed.params.n
            # into the engine while there is room
            while waiting and (not live or (len(live) < IN_FLIGHT
                                            and pixels + waiting[0].parsed.pixels <= PIXELS_IN_FLIGHT)):
                job = waiting.popleft()
                self._dequeued(job)
                try:
                    job.handle = stream.add([job.parsed.prompt], [job.parsed.params], [id(job)])[0]
                except Exception as e:  # noqa: BLE001 - a request the engine cannot take: its own 400
                    job.post(("error", HTTPError(400, f"{type(e).__name__}: {e}")))
                    continue
                job.sent = [0] * job.parsed.params.n
                live[id(job)] = job
                pixels += job.parsed.pixels
                self.running = len(live)
            if not stream.unfinished:
                continue
            try:
                done = stream.step()
            except DeviceUnavailable as e:
                self.failure = str(e)
                for job in [*live.values(), *waiting]:
                    job.post(("error", HTTPError(503, self.failure, "server_error")))
                live.clear()
                waiting.clear()
                self.running = 0
                if self.on_failure is not None:
                    self.on_failure(self.failure)
                return
            except Exception as e:  # noqa: BLE001 - a bug: these requests fail (500), the server goes on
                traceback.print_exc(file=sys.stderr)
                for job in live.values():
                    job.post(("error", HTTPError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
                live.clear()
                pixels = 0
                self.running = 0
                continue
            now = time.perf_counter()
            events = []
            for tag, out in done:
                job = live.pop(tag, None)
                if job is None:
                    continue
                pixels -= job.parsed.pixels
                self._account(job, out, now)
                events.append((job, ("done", out)))
            self.running = len(live)
            due = now - self.stream_interval
            streaming = [job for job in live.values()
                         if job.parsed.stream and job.handle is not None and (job.posted <= due or not any(job.sent))]
            for job, ids in zip(streaming, stream.progress([job.handle for job in streaming])):
                if len(ids) < job.parsed.params.n:  # greedy: one sequence, its output every choice's
                    ids = ids * job.parsed.params.n
                counts = [-1 if x is None else len(x) for x in ids]
                if counts != job.sent:
                    job.sent, job.posted = counts, now
                    events.append((job, ("tokens", [None if x is None else list(x) for x in ids])))
            post(events)

    def _dequeued(self, job: Job) -> None:
        self.withdraw(job.nbytes, job.parsed.pixels)

    def _account(self, job: Job, out, now: float) -> None:
        if out.error is not None:
            self.finished["error"] = self.finished.get("error", 0) + 1
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        # the tokens the engine generated: a greedy request's n choices are one run repeated
        self.generation_tokens += out.metrics.num_generated_tokens if out.metrics is not None else \
            sum(len(c.token_ids) for c in out.outputs)
        for c in out.outputs:
            self.finished[c.finish_reason or "stop"] = self.finished.get(c.finish_reason or "stop", 0) + 1
        ttft = out.metrics.time_to_first_token if out.metrics is not None else None
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(now - job.arrival)


class TextDelta:
    """A choice's text as its tokens arrive: each update returns the new text, decoded over a
    window of the last tokens (a token that ends inside a UTF-8 character waits for the next),
    and holds back the last `hold` characters, where a stop string may be starting."""

    def __init__(self, tokenizer, hold: int) -> None:
        self.tok = tokenizer
        self.hold = hold
        self.prefix = 0  # token offsets of the decoding window
        self.read = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of text already sent

    def update(self, ids: list[int]) -> str:
        if len(ids) > self.read:
            head = self.tok.decode(ids[self.prefix:self.read], skip_special_tokens=True)
            full = self.tok.decode(ids[self.prefix:], skip_special_tokens=True)
            if len(full) > len(head) and not full.endswith("\ufffd"):
                self.text += full[len(head):]
                self.prefix, self.read = self.read, len(ids)
        end = max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def finish(self, final: str) -> str:
        """The rest of the final text (the engine's, stop strings cut off), after what was sent."""
        return final[self.sent:]


@dataclass
class ServerConfig:
    model_name: str
    limits: Limits
    api_key: str | None = None
    max_request_bytes: int = 32 << 20
    max_model_len: int = 0
    stream_interval: float = 0.0  # seconds between a stream's chunks (at most one per interval)


def error_body(e: HTTPError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def build_app(engine: EngineLoop, cfg: ServerConfig, render_pdf=None):
    """The Starlette application (routes, error bodies, key check, metrics). render_pdf: how PDF
    parts are rendered (a PdfRenderer; None: in the worker thread)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    from docproc.engine.requests import preload
    from docproc.models.processor import PromptError

    llm = engine.llm
    tokenizer = copy.deepcopy(llm.tokenizer)  # the handlers' own: the engine's is in use in its thread
    limits = dataclasses.replace(cfg.limits, render_pdf=render_pdf)
    # bodies parsed and their images decoded by PREPARING threads (which bounds the pixels being
    # decoded), each with a processor of its own (a tokenizer is not shared between threads)
    preparing = Lane(PREPARING, "docproc-prepare")
    # bodies without images or files in two threads of their own: a text request (or a malformed
    # one, answered 400) does not wait behind pages being decoded
    preparing_text = Lane(TEXT_PREPARING, "docproc-prepare-text")
    own = threading.local()
    grammar_lane = Lane(GRAMMAR_THREADS, "docproc-grammar")
    held = {"bytes": 0}  # bodies being read or parsed
    counts: dict[tuple[str, int], int] = {}
    served = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}

    def count(path: str, status: int) -> None:
        key = (path if path in served else "other", status)
        counts[key] = counts.get(key, 0) + 1

    def answer_error(e: HTTPError, path: str) -> JSONResponse:
        count(path, e.status)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(error_body(e), status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:] if got[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
            raise HTTPError(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error")

    async def read_body(request: Request, hold: list) -> bytes:
        """The body, read as it arrives, its bytes counted in `held` (and in hold[0], for the
        caller to give back): 413 past the size limit, 429 past MAX_HELD_BYTES of bodies in all,
        408 after BODY_IDLE_SECONDS without a byte or BODY_SECONDS in all, 503 when the server
        starts stopping; ClientGone when the client leaves."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_request_bytes:
            raise HTTPError(413, f"the request is larger than {cfg.max_request_bytes} bytes")
        chunks, n = [], 0
        start = time.monotonic()
        while True:
            got = asyncio.ensure_future(request.receive())
            idle = 0.0
            while not got.done():
                await asyncio.wait({got}, timeout=0.25)
                idle += 0.25
                late = idle >= BODY_IDLE_SECONDS or time.monotonic() - start >= BODY_SECONDS
                if not got.done() and (engine.draining or late):
                    got.cancel()
                    if engine.draining:
                        raise HTTPError(503, "the server is stopping", "server_error")
                    raise HTTPError(408, f"the body did not come in time (nothing for {BODY_IDLE_SECONDS} s, or "
                                         f"more than {BODY_SECONDS} s in all)")
            message = got.result()
            if message["type"] == "http.disconnect":
                raise ClientGone
            part = message.get("body", b"")
            n += len(part)
            if n > cfg.max_request_bytes:
                raise HTTPError(413, f"the request is larger than {cfg.max_request_bytes} bytes")
            if held["bytes"] + len(part) > MAX_HELD_BYTES:
                raise HTTPError(429, "too many request bodies are being read: retry later", "rate_limit_error")
            held["bytes"] += len(part)
            hold[0] += len(part)
            chunks.append(part)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def completions(request: Request) -> Response:
        path = request.url.path
        kind = CHAT if path.endswith("/chat/completions") else COMPLETIONS
        try:
            check_key(request)
            if engine.draining:
                raise HTTPError(503, "the server is stopping", "server_error")
            hold = [0]
            try:
                raw = await read_body(request, hold)
                parsed = await (preparing if carries_images(raw) else preparing_text).run(prepare, kind, raw)
            finally:
                held["bytes"] -= hold[0]
            nbytes = len(raw)
            del raw
            engine.admit(nbytes, parsed.pixels)  # (its images held from here on are counted)
            try:
                constraint = parsed.params.structured_outputs
                if constraint is not None:  # compiled here: it goes with the request to the engine's thread
                    try:
                        await grammar_lane.run(llm.compile_constraint, constraint)
                    except ValueError as e:
                        raise HTTPError(400, str(e)) from None
            except BaseException:
                engine.withdraw(nbytes, parsed.pixels)
                raise
            job = Job(parsed, asyncio.get_running_loop(), asyncio.Queue(), nbytes)
            engine.submit(job)
        except HTTPError as e:
            return answer_error(e, path)
        except ClientGone:
            count(path, 499)
            return Response(status_code=499)  # nobody reads it
        rid = uuid.uuid4().hex[:24]
        if parsed.stream:
            count(path, 200)
            return StreamingResponse(stream_events(job, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole_answer(request, job, rid)

    def prepare(kind: str, raw: bytes) -> Parsed:
        """The body as JSON, parsed (protocol.parse), then its images decoded and its length
        checked (preload), in a worker thread: the engine's thread only tokenizes it. 400 for
        anything the engine would refuse."""
        try:  # (JSON between systems is UTF-8, RFC 8259; in UTF-16 a quote byte can sit inside a character)
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HTTPError(400, "the body is not UTF-8 text (JSON is sent as UTF-8)") from None
        if raw.count(b"{") + raw.count(b"[") > MAX_JSON_CONTAINERS and \
                containers(raw) > MAX_JSON_CONTAINERS:  # (the brackets inside strings are text)
            raise HTTPError(400, f"the body holds more than {MAX_JSON_CONTAINERS} JSON objects and arrays")
        try:
            body = json.loads(text)
            json.dumps(body, ensure_ascii=False).encode()  # lone surrogates (\ud800) are not text
        except RecursionError:
            raise HTTPError(400, "the body nests JSON deeper than it can be read (about 1,000 levels)") from None
        except (ValueError, UnicodeError) as e:
            raise HTTPError(400, f"the body is not JSON text ({type(e).__name__})") from None
        del raw, text
        proc = getattr(own, "processor", None)
        if proc is None:
            proc = own.processor = copy.copy(llm.processor)
            proc.tokenizer = copy.deepcopy(tokenizer)
        try:
            parsed = parse(kind, body, limits, llm.chat_prompt, True)
            parsed.prompt, pixels = preload(proc, parsed.prompt, llm.max_model_len)
        except (RequestError, PromptError) as e:
            raise HTTPError(400, str(e)) from None
        parsed.pixels = max(parsed.pixels, pixels)
        return parsed

    async def whole_answer(request: Request, job: Job, rid: str) -> Response:
        gone = asyncio.ensure_future(wait_disconnect(request))
        answered = False
        try:
            while True:
                got = asyncio.ensure_future(job.events.get())
                try:
                    await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not got.done():
                        got.cancel()
                if not got.done() or got.cancelled():
                    count(request.url.path, 499)
                    return Response(status_code=499)  # nobody reads it
                kind, value = got.result()
                answered = kind in ("error", "done")
                if kind == "error":
                    return answer_error(value, request.url.path)
                if kind == "done":
                    if value.error is not None:
                        return answer_error(HTTPError(400, value.error), request.url.path)
                    count(request.url.path, 200)
                    return JSONResponse(response_body(job.parsed, value, cfg.model_name, rid))
        finally:
            gone.cancel()
            if not answered:  # the client went away, or the server stops at once
                engine.cancel(job)

    async def wait_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                return

    def chunk(job: Job, rid: str, created: int, choices: list, usage: dict | None = None) -> str:
        if job.parsed.kind == CHAT:
            body = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                    "model": cfg.model_name, "choices": choices}
        else:
            body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(job: Job, index: int, text: str, finish: str | None, first: bool = False) -> dict:
        if job.parsed.kind == CHAT:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

    async def stream_events(job: Job, rid: str):
        created = int(time.time())
        params = job.parsed.params
        hold = max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0
        deltas = [TextDelta(tokenizer, hold) for _ in range(params.n)]
        done = started = False
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "tokens":  # the newest tokens (_deliver keeps one)
                    value, job.latest = job.latest, None
                if not started and kind != "error" and job.parsed.kind == CHAT:
                    # the role chunk comes with the first token, as the peers' servers send it: a
                    # client's time to this chunk is its time to first token
                    started = True
                    yield chunk(job, rid, created, [choice(job, j, "", None, first=True) for j in range(params.n)])
                if kind == "tokens":  # (a finished choice's text comes with the output: None here)
                    parts = [choice(job, j, t, None) for j, ids in enumerate(value)
                             if ids is not None and (t := deltas[j].update(ids))]
                    if parts:
                        yield chunk(job, rid, created, parts)
                    continue
                done = True
                if kind == "error":
                    yield f"data: {json.dumps(error_body(value))}\n\n"
                    break
                if value.error is not None:
                    yield f"data: {json.dumps(error_body(HTTPError(400, value.error)))}\n\n"
                    break
                parts = [choice(job, c.index, deltas[c.index].finish(c.text), c.finish_reason) for c in value.outputs]
                yield chunk(job, rid, created, parts)
                if job.parsed.include_usage:
                    usage = response_body(job.parsed, value, cfg.model_name, rid)["usage"]
                    yield chunk(job, rid, created, [], usage)
                break
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                engine.cancel(job)  # the client went away

    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except HTTPError as e:
            return answer_error(e, request.url.path)
        count(request.url.path, 200)
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_name, "object": "model", "created": int(START), "owned_by": "docproc",
             "max_model_len": cfg.max_model_len}]})

    async def health(request: Request) -> Response:
        if engine.alive:
            return PlainTextResponse("ok\n")
        return PlainTextResponse(f"unavailable: {engine.failure or 'the engine stopped'}\n", status_code=503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(engine, counts), media_type="text/plain; version=0.0.4")

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = {404: f"{request.url.path} is not served", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(status, getattr(exc, "detail", "bad request"))
        return answer_error(HTTPError(status, message), request.url.path)

    async def internal(request: Request, exc: Exception) -> Response:
        traceback.print_exception(exc, file=sys.stderr)
        return answer_error(HTTPError(500, f"internal error: {type(exc).__name__}", "server_error"),
                            request.url.path)

    routes = [Route("/v1/chat/completions", completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={StarletteHTTPException: not_found, Exception: internal})
    app.router.redirect_slashes = False  # /v1/models/ is not served (a redirect would lose a POST's body)
    return app


START = time.time()


def metrics_text(engine: EngineLoop, counts: dict) -> str:
    """Prometheus' text format: requests by endpoint and status, tokens, finish reasons, latency
    histograms, speculation, KV cache use, prefix and vision cache hits."""
    llm = engine.llm
    lines = ["# TYPE docproc_http_requests_total counter"]
    for (path, status), n in sorted(counts.items()):
        lines.append(f'docproc_http_requests_total{{path="{path}",status="{status}"}} {n}')
    lines += ["# TYPE docproc_requests_running gauge", f"docproc_requests_running {engine.running}",
              "# TYPE docproc_requests_waiting gauge", f"docproc_requests_waiting {engine.queued}",
              "# TYPE docproc_prompt_tokens_total counter", f"docproc_prompt_tokens_total {engine.prompt_tokens}",
              "# TYPE docproc_generation_tokens_total counter",
              f"docproc_generation_tokens_total {engine.generation_tokens}",
              "# TYPE docproc_request_finished_total counter"]
    for reason, n in sorted(dict(engine.finished).items()):
        lines.append(f'docproc_request_finished_total{{finish_reason="{reason}"}} {n}')
    lines += engine.ttft.lines("docproc_time_to_first_token_seconds")
    lines += engine.latency.lines("docproc_request_latency_seconds")
    bm = llm.block_manager
    usable = max(1, bm.num_blocks)
    lines += ["# TYPE docproc_kv_cache_usage gauge",
              f"docproc_kv_cache_usage {max(0.0, 1 - bm.num_free_blocks / usable):.6f}",
              "# TYPE docproc_prefix_cache_query_tokens_total counter",
              f"docproc_prefix_cache_query_tokens_total {bm.stats.num_query_tokens}",
              "# TYPE docproc_prefix_cache_hit_tokens_total counter",
              f"docproc_prefix_cache_hit_tokens_total {bm.stats.num_hit_tokens}",
              "# TYPE docproc_prefix_cache_hit_rate gauge",
              f"docproc_prefix_cache_hit_rate {_rate(bm.stats.num_hit_tokens, bm.stats.num_query_tokens)}"]
    enc = llm.runner.encoder_cache.stats
    lines += ["# TYPE docproc_vision_cache_lookups_total counter",
              f"docproc_vision_cache_lookups_total {enc.num_lookups}",
              "# TYPE docproc_vision_cache_hits_total counter", f"docproc_vision_cache_hits_total {enc.num_hits}"]
    if llm.speculator is not None:
        st = llm.speculator.stats
        lines += ["# TYPE docproc_spec_draft_tokens_total counter", f"docproc_spec_draft_tokens_total {st.proposed}",
                  "# TYPE docproc_spec_accepted_tokens_total counter",
                  f"docproc_spec_accepted_tokens_total {st.accepted}",
                  "# TYPE docproc_spec_acceptance_rate gauge",
                  f"docproc_spec_acceptance_rate {_rate(st.accepted, st.proposed)}"]
    lines.append("# TYPE docproc_engine_up gauge")
    lines.append(f"docproc_engine_up {int(engine.alive)}")
    return "\n".join(lines) + "\n"


def _rate(num: int, den: int) -> str:
    return f"{num / den:.6f}" if den else "NaN"


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a limit on the time a client takes to send a request's line and
    headers, from its connection or the last response on it: past it the connection is closed.
    uvicorn has none (its keep-alive timer starts after a response and stops at the next byte),
    so a client that opened connections and sent their headers a byte at a time held them all, up
    to MAX_CONNECTIONS, and every other client's request got 503. (The body has its own limits:
    read_body.) h11 always, also where httptools is installed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.conn.their_state is not h11.IDLE:  # (a request began)
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._await_headers()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def serve(llm, cfg: ServerConfig, sock, log_level: str = "warning") -> int:
    """Run the server on a bound socket until SIGINT/SIGTERM (the requests in flight finish first;
    a second signal stops at once) or a device failure. Returns the exit code: 0 when stopped by
    a signal, 4 when the device failed."""
    import signal

    import uvicorn

    engine = EngineLoop(llm, cfg.stream_interval)
    renderer = PdfRenderer()
    app = build_app(engine, cfg, renderer)

    class _Server(uvicorn.Server):
        def capture_signals(self):  # ours below: drain on the first signal, no re-raise after
            import contextlib

            return contextlib.nullcontext()

    server = _Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                    http=header_timeout_protocol(HEADER_SECONDS),
                                    timeout_keep_alive=5, limit_concurrency=MAX_CONNECTIONS,
                                    timeout_graceful_shutdown=DRAIN_SECONDS))
    failed: list[str] = []

    def on_failure(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    aborted = threading.Event()

    def force_soon() -> None:  # the failed requests' answers go out, then the server stops
        engine.join(10)
        time.sleep(0.5)
        server.force_exit = True

    def on_signal(signum, frame) -> None:
        engine.draining = True
        if aborted.is_set():  # a third: now
            server.force_exit = True
        elif server.should_exit:  # a second signal: what is in flight is dropped
            aborted.set()
            engine.abort()
            threading.Thread(target=force_soon, daemon=True).start()
        server.should_exit = True

    engine.on_failure = on_failure
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    engine.start()
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        renderer.close()
        # drained, the engine has nothing left; after a second signal or a failure it has stopped
        engine.stop(timeout=None if not (failed or aborted.is_set()) else 10)
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        return 4
    return 0

