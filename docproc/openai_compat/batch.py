"""`docproc run-batch`: an OpenAI batch file (JSONL of `{custom_id, method, url, body}`) through
the engine, one output line per input line (`{id, custom_id, response: {status_code,
request_id, body}, error}`), written as each request finishes.

Crash-safe and resumable: every output line is whole or cut off at the end of the file; a rerun
truncates a cut-off last line, answers only the custom_ids the file does not hold yet and
appends, so after any number of kills and reruns every custom_id is in the file exactly once. A
line that cannot be answered (unparsable, an unknown url, a bad body, an image that does not
decode) is an error line and the batch goes on: one without a custom_id is keyed by its line
number (`error.line`). One run per output file (a lock beside it, `RESULTS.jsonl.lock`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import re
import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from docproc.openai_compat.protocol import Limits, Parsed, RequestError, parse, response_body
from docproc.pipeline.runstore import output_fault, take_lock

IN_FLIGHT = 256  # requests queued in the engine at once
PIXELS_IN_FLIGHT = 400_000_000  # and their images' pixels (decoded as they are queued: ~1.2 GB RGB)
SYNC_SECONDS = 2.0  # finished lines reach the disk (fsync) at least this often


@dataclass
class BatchSummary:
    lines: int = 0
    answered: int = 0  # status 200
    errors: int = 0  # error lines written by this run
    already_done: int = 0  # custom_ids the output file held before this run
    duplicates: int = 0  # lines repeating a custom_id (skipped)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    other_models: list[str] = field(default_factory=list)  # body.model values other than the loaded one

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _line_id(custom_id: str | None, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{custom_id}|{line}".encode()).hexdigest()[:24]


class NotResults(ValueError):
    """The output file holds lines that are not run-batch results."""


class OutputFile:
    """The output JSONL: locked, its whole lines read back (a cut-off last line dropped), lines
    appended and synced."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[tuple] = set()  # ("id", custom_id), and ("line", N) for error lines without one
        self._lock_fd: int | None = None
        self._f = None
        self._synced = time.monotonic()
        self._created = False  # this run made the output file (it did not exist)

    def open(self) -> None:
        # beside the file a link names (two runs writing one file through a link and its target
        # would each have taken a lock of their own)
        self._lock_fd = take_lock(Path(os.path.realpath(self.path) + ".lock"), self.path, "docproc run-batch",
                                  "--output")
        try:
            self._read_back()
            real = os.path.realpath(self.path)  # (a link's target is the file made)
            self._created = not os.path.lexists(real)
            self._f = open(real, "ab")
        except OSError as e:
            self.close()
            raise output_fault(e, self.path, "--output") from None

    def _read_back(self) -> None:
        """The keys of the output's whole lines. A last line without its newline (a kill during
        its write) is cut off, to be answered again; any other line that is not a result (a
        file that is not run-batch's output) stops the run before anything is changed."""
        if not self.path.exists():
            return
        good = 0
        with open(self.path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # the cut-off last line
                good += len(raw)
                if not raw.strip():
                    continue
                try:
                    key = self.key_of(json.loads(raw))
                except (ValueError, RecursionError):
                    key = None
                if key is None:
                    self.close()
                    raise NotResults(f"{self.path} line {n} is not a run-batch result: give an output file of its "
                                     f"own (a new one, or one an earlier run-batch of this input wrote)")
                self.done.add(key)
        if good < self.path.stat().st_size:
            os.truncate(self.path, good)

    @staticmethod
    def key_of(rec: object) -> tuple | None:
        if not isinstance(rec, dict) or "response" not in rec:
            return None
        if isinstance(rec.get("custom_id"), str):
            return ("id", rec["custom_id"])
        err = rec.get("error")
        if isinstance(err, dict) and isinstance(err.get("line"), int):
            return ("line", err["line"])
        return None

    def write(self, rec: dict) -> None:
        try:
            self._f.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
            self._f.flush()
            if time.monotonic() - self._synced > SYNC_SECONDS:
                os.fsync(self._f.fileno())
                self._synced = time.monotonic()
        except OSError as e:
            raise output_fault(e, self.path, "--output") from None
        key = self.key_of(rec)
        if key is not None:
            self.done.add(key)

    def abandon(self) -> None:
        """Close before anything was answered (the model or the device failed to load, a signal
        came while it loaded): an output file this run made, still empty, is removed (it would
        look like a batch that answered nothing), while the lock is held and only if the file at
        its name is still the one this run opened (a link given as --output stays)."""
        if self._created and self._f is not None:
            try:
                mine = os.fstat(self._f.fileno())
                real = os.path.realpath(self.path)
                there = os.lstat(real)
                if mine.st_size == 0 and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(real)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                pass
            try:
                f.close()
            except OSError:  # (a full disk: the error was reported where the write failed)
                pass
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


def error_line(custom_id: str | None, line: int, message: str, status: int = 400) -> dict:
    """A line the batch could not answer. With a custom_id it carries OpenAI's error response
    (status_code 400 and an error body); without one, `error` keys it by its line number."""
    if custom_id is None:
        return {"id": _line_id(None, line), "custom_id": None, "response": None,
                "error": {"code": "invalid_request", "message": message, "line": line}}
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return {"id": _line_id(custom_id, line), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": _line_id(custom_id, line), "body": body}, "error": None}


MAX_LINE_BYTES = 32 << 20  # a request line, as serve's body (ServerConfig.max_request_bytes)
# --input names read from the process's standard input itself (a socket there has no name to open)
STDIN_NAMES = ("-", "/dev/stdin", "/proc/self/fd/0", "/dev/fd/0")


def _open_input(path: Path):
    """The input for reading bytes: path, or standard input for "-" (its descriptor, or the
    stream itself where it has none)."""
    if str(path) not in STDIN_NAMES:
        return open(path, "rb")
    try:
        return os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    except (AttributeError, OSError, io.UnsupportedOperation):
        return contextlib.nullcontext(sys.stdin.buffer)


HEAD_BYTES = 64 << 10
_LEADING_ID = re.compile(rb'(?:\xef\xbb\xbf)?[ \t\r\n]*\{[ \t\r\n]*"custom_id"[ \t\r\n]*:[ \t\r\n]*'
                         rb'("(?:[^"\\\x00-\x1f]|\\.)*")')


def _leading_custom_id(head: bytes) -> str | None:
    """The custom_id of a line too long to read whole, where it is the line's first key (as batch
    files write it); else None."""
    m = _LEADING_ID.match(head)
    if m is None:
        return None
    try:
        cid = json.loads(m.group(1))
        cid.encode()  # (a lone surrogate is not text)
    except (ValueError, UnicodeError):
        return None
    return cid or None


def read_lines(path: Path):
    """(line number, custom_id or None, url, body, problem or None) for each non-blank line of
    path ("-": standard input), read once in order; a line over MAX_LINE_BYTES is an error line,
    read past in pieces, never held whole."""
    with _open_input(path) as f:
        n = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                cid = _leading_custom_id(raw[:HEAD_BYTES])  # (its error line is keyed by it where it comes first)
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                yield n, cid, None, None, f"line {n} is over {MAX_LINE_BYTES >> 20} MiB"
                continue
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                json.dumps(rec, ensure_ascii=False).encode()  # lone surrogates (\ud800) are not text
            except RecursionError:
                yield n, None, None, None, f"line {n} nests JSON deeper than it can be read (about 1,000 levels)"
                continue
            except (ValueError, UnicodeError) as e:
                yield n, None, None, None, f"line {n} is not JSON text ({type(e).__name__})"
                continue
            if not isinstance(rec, dict):
                yield n, None, None, None, f"line {n} is not a JSON object"
                continue
            cid = rec.get("custom_id")
            if not isinstance(cid, str) or not cid:
                yield n, None, None, None, f"line {n}: custom_id must be a non-empty string"
                continue
            if rec.get("method", "POST") != "POST":
                yield n, cid, None, None, f"method {rec.get('method')!r} is not served: POST"
                continue
            yield n, cid, rec.get("url"), rec.get("body"), None


def run_batch(input_path: Path, out: OutputFile, llm, model_name: str, limits: Limits,
              on_progress=None) -> BatchSummary:
    """Answer every line of input_path that the (opened) output does not hold yet (see the module)."""
    from docproc.engine.stream import RequestStream

    summary = BatchSummary()
    t0 = time.perf_counter()
    stream = RequestStream(llm)
    seen: set[str] = set()
    others: set[str] = set()
    pending: dict[int, tuple[int, str, Parsed]] = {}  # tag -> (line, custom_id, parsed)
    pixels = [0]  # of the requests in flight

    def drain(until: int, pixel_room: int = 0) -> None:
        while stream.unfinished > until or (stream.unfinished and pixels[0] + pixel_room > PIXELS_IN_FLIGHT):
            for tag, result in stream.step():
                line, cid, parsed = pending.pop(tag)
                pixels[0] -= parsed.pixels
                if result.error is not None:
                    out.write(error_line(cid, line, result.error))
                    summary.errors += 1
                else:
                    rid = _line_id(cid, line)
                    body = response_body(parsed, result, model_name, rid)
                    out.write({"id": rid, "custom_id": cid,
                               "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None})
                    summary.answered += 1
                    summary.prompt_tokens += body["usage"]["prompt_tokens"]
                    summary.completion_tokens += body["usage"]["completion_tokens"]
                if on_progress is not None:
                    on_progress(summary)

    try:
        for n, cid, url, body, problem in read_lines(input_path):
            summary.lines += 1
            key = ("id", cid) if cid is not None else ("line", n)
            if cid is not None and cid in seen:  # (a repeat on a rerun too: not done again, and not counted done)
                summary.duplicates += 1
                continue
            if cid is not None:
                seen.add(cid)
            if key in out.done:
                summary.already_done += 1
                continue
            if problem is None:
                try:
                    parsed = parse(url, body, limits, llm.chat_prompt)
                except RequestError as e:
                    problem = str(e)
                except Exception as e:  # noqa: BLE001 -- a line that breaks the parser fails alone
                    problem = f"the request could not be read ({type(e).__name__}: {str(e)[:200]})"
            if problem is not None:
                out.write(error_line(cid, n, problem))
                summary.errors += 1
                continue
            if parsed.model and parsed.model != model_name and parsed.model not in others:
                others.add(parsed.model)
            drain(IN_FLIGHT - 1, parsed.pixels)  # room for it first
            tag = n
            pending[tag] = (n, cid, parsed)
            pixels[0] += parsed.pixels
            stream.add([parsed.prompt], [parsed.params], [tag])
        drain(0)
    except BaseException:
        stream.abort()
        raise
    finally:
        summary.seconds = time.perf_counter() - t0
        summary.other_models = sorted(others)
    return summary
