"""OpenAI's request and response shapes, for `docproc run-batch` and `docproc serve`: a
`/v1/chat/completions` or `/v1/completions` body becomes one engine request (a prompt made by the model's chat template,
with its images, and its SamplingParams); an engine output becomes a `chat.completion` or `text_completion` body.

Images come as `image_url` parts: `data:` URLs, or local files (`file://` URLs or paths) under the
root the user names; nothing is fetched over the network. A PDF comes as OpenAI's `file` part
(`{"type": "file", "file": {"file_data": "data:application/pdf;base64,..."}}`, or a local file's
URL or path in `file_data`, under the root): its pages become images, in order. Every problem
with a body is a RequestError naming the field (the batch writes it as that line's error and goes
on; the server answers 400).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, unquote_to_bytes, urlparse

from docproc.outputs import RequestOutput
from docproc.sampling_params import SamplingParams, StructuredOutputsParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
DEFAULT_MAX_TOKENS = 512
# parameters docproc cannot honour, refused when set to anything but their neutral value
UNSUPPORTED = {"tools": None, "tool_choice": "none", "functions": None, "function_call": "none", "logprobs": False,
               "top_logprobs": 0, "stream": False, "frequency_penalty": 0, "presence_penalty": 0,
               "logit_bias": None, "audio": None, "modalities": None, "prediction": None, "suffix": None,
               "echo": False, "best_of": 1}
MAX_N = 128  # choices a request (OpenAI's bound)
MAX_STOP, MAX_STOP_CHARS = 16, 512  # stop strings a request, and characters each (OpenAI takes 4)


class RequestError(ValueError):
    """A request body docproc cannot answer: the message names the field."""


@dataclass
class Limits:
    image_root: Path | None = None  # local images and PDFs only from under this folder
    max_images: int = 64  # per request, a PDF's pages included
    max_bytes: int = 64 << 20  # per data URL or local file
    pdf_dpi: int = 120  # a PDF page's resolution, lowered for a page that would pass max_pixels
    max_pixels: int = 40_000_000  # per image (from its header, before it is decoded) and per rendered page
    max_request_pixels: int = 160_000_000  # all of a request's images
    # renders a PDF part (data, limits, where) -> pages, in place of pdf_pages in this thread
    # (the server's: in worker processes, MuPDF holding the GIL while it renders)
    render_pdf: Callable | None = None


@dataclass
class Parsed:
    kind: str  # CHAT or COMPLETIONS
    prompt: str | dict
    params: SamplingParams
    model: str | None
    pixels: int = 0  # the request's images, decoded (what it holds in memory while queued)
    stream: bool = False  # answer in chunks (server-sent events)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def parse(url: object, body: object, limits: Limits, render, streaming: bool = False) -> Parsed:
    """render: the engine's chat prompt (LLM.chat_prompt: the model's chat template); streaming:
    whether `stream: true` can be answered (the server: yes; a batch file: no)."""
    if url not in (CHAT, COMPLETIONS):
        raise RequestError(f"url {url!r} is not served: {CHAT} or {COMPLETIONS}")
    if not isinstance(body, dict):
        raise RequestError(f"body must be an object, got {type(body).__name__}")
    for key, neutral in UNSUPPORTED.items():
        value = body.get(key)
        if streaming and key == "stream":
            if value is not None and not isinstance(value, bool):
                raise RequestError("stream must be true or false")
            continue
        if not _neutral(value, neutral):
            raise RequestError(f"{key} is not supported by docproc" + ("" if streaming else " run-batch"))
    stream = bool(body.get("stream")) if streaming else False
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None and streaming:  # (a batch line's are ignored: it never streams)
        if not stream:
            raise RequestError("stream_options is only for stream: true")
        if not isinstance(opts, dict):
            raise RequestError("stream_options must be an object")
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise RequestError("stream_options.include_usage must be true or false")
        include_usage = bool(usage)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string")
    params = sampling(body)
    pixels = 0
    if url == CHAT:
        messages, pixels = chat_messages(body.get("messages"), limits)
        try:
            prompt: str | dict = render(messages)
        except ValueError as e:
            raise RequestError(str(e)) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string (or a list of one: one prompt a request)")
    return Parsed(url, prompt, params, model, pixels, stream, include_usage)


def _neutral(value: object, neutral: object) -> bool:
    """Whether a field of an unsupported feature asks for nothing: absent, or its neutral value
    of the neutral's own kind (the completions API's `logprobs: 0` asks for the chosen tokens'
    logprobs, where the chat API's `false` asks for none; a penalty of 0 or 0.0 is none)."""
    if value is None or value == [] or value == {}:
        return True
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return value == neutral


# vLLM's fields for constrained decoding, beside OpenAI's response_format: guided_* (older) and
# structured_outputs {json, regex, choice, grammar}; each becomes the same constraint
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options for its backends, taken and left aside: docproc's answers never hold whitespace
# between JSON tokens, never fall back to another backend, and take a schema's additionalProperties
BACKEND_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _guided(body: dict) -> StructuredOutputsParams | None:
    given = {(key, kind): body[key] for key, kind in GUIDED.items() if body.get(key) is not None}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("structured_outputs must be an object: {json | regex | choice | grammar: ...}")
        for key in BACKEND_OPTIONS:  # (how vLLM picks and runs a backend: docproc's one decodes without them)
            if so.get(key) is not None and not isinstance(so[key], bool):
                raise RequestError(f"structured_outputs.{key} must be true or false")
        other = sorted(k for k, v in so.items() if k not in STRUCTURED_KEYS + BACKEND_OPTIONS and v is not None)
        if other:
            raise RequestError(f"structured_outputs.{other[0]} is not supported by docproc (it takes "
                               f"{', '.join(STRUCTURED_KEYS)})")
        given.update({(f"structured_outputs.{k}", k): v for k, v in so.items() if v is not None and k in STRUCTURED_KEYS})
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give one constraint, not {', '.join(sorted(field for field, _ in given))}")
    (field, kind), value = next(iter(given.items()))
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{field} must be true")
        return StructuredOutputsParams(json={"type": "object"})
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise RequestError(f"{field} nests JSON deeper than it can be read (about 1,000 levels)") from None
            except ValueError:
                raise RequestError(f"{field} must be a JSON Schema (an object, or its text)") from None
        try:
            return response_format({"type": "json_schema", "json_schema": {"schema": value}})
        except RequestError as e:
            raise RequestError(str(e).replace("response_format.json_schema.schema", field, 1)) from None
    try:
        return StructuredOutputsParams(**{kind: value})
    except ValueError as e:
        raise RequestError(f"{field}: {str(e).removeprefix(kind + ' ')}") from None


def sampling(body: dict) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {body['n']}")
    kw: dict = {"max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
                "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
                "seed": body.get("seed"), "n": 1 if body.get("n") is None else body["n"]}
    stop = body.get("stop")
    if stop is not None:
        many = [stop] if isinstance(stop, str) else stop
        if isinstance(many, list) and (len(many) > MAX_STOP or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS
                                                                   for s in many)):
            raise RequestError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
        kw["stop"] = stop
    if body.get("top_k") is not None:  # vLLM's extension (0 or -1: off)
        kw["top_k"] = -1 if body["top_k"] == 0 else body["top_k"]
    if body.get("ignore_eos") is not None:  # vLLM's extension: generate max_tokens whatever comes
        if not isinstance(body["ignore_eos"], bool):
            raise RequestError("ignore_eos must be true or false")
        kw["ignore_eos"] = body["ignore_eos"]
    rf = body.get("response_format")
    if rf is not None:
        kw["structured_outputs"] = response_format(rf)
    guided = _guided(body)
    if guided is not None:
        if kw.get("structured_outputs") is not None:
            raise RequestError("response_format and a guided_* or structured_outputs constraint: give one")
        kw["structured_outputs"] = guided
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e).replace("SamplingParams.", "")) from None


def response_format(rf: object) -> StructuredOutputsParams | None:
    """`{"type": "text"}`: none; `json_object`: any JSON object; `json_schema`: its `schema`,
    checked as `docproc run` checks a query's (a schema no answer could match, a `$ref` outside
    it, a regex that is not one: 400). Decoding enforces the schema but for the keywords
    json_schema.unenforced names: with `"strict": true` such a schema is refused (400 naming
    them), as OpenAI refuses what strict mode cannot hold; without, it is decoded under the rest
    (OpenAI's non-strict mode: the answer follows the schema as far as decoding can make it)."""
    from docproc.pipeline.json_schema import SchemaProblem, check_schema, unenforced

    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"})
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON Schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError("response_format.json_schema.strict must be true or false")
        try:
            check_schema(schema)
        except SchemaProblem as e:
            raise RequestError(f"response_format.json_schema.schema: {e}") from None
        loose = unenforced(schema)
        if strict and loose:
            raise RequestError(f"response_format.json_schema.schema: decoding cannot enforce {', '.join(loose)}; "
                               f"remove them, or send \"strict\": false to have the answer decoded under the rest "
                               f"of the schema")
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise RequestError(f"response_format.json_schema.schema: {e}") from None
    raise RequestError("response_format.type must be text, json_object or json_schema")


def chat_messages(messages: object, limits: Limits) -> tuple[list[dict], int]:
    """The body's messages as LLM.chat_prompt takes them: every image part read here (a data: URL,
    or a local file under the image root) and every PDF part turned into its pages, so that
    the engine gets bytes and PIL pages only; `developer` messages as `system` ones. Also the
    images' pixels (each image's size read from its header, refused past limits.max_pixels)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out, count, pixels = [], 0, 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with a role of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    url = part.get("image_url")
                    raw = _read(url.get("url") if isinstance(url, dict) else url, limits, where)
                    pixels += _image_pixels(raw, limits, where)
                    parts.append({"type": "image", "image": raw})
                    count += 1
                elif kind == "file":
                    f = part.get("file")
                    file_data = f.get("file_data") if isinstance(f, dict) else None
                    data = _bare_pdf(file_data, limits, where)
                    if data is None:
                        data = _read(file_data, limits, where)
                    if b"%PDF-" not in data[:1024]:  # (MuPDF would open an image, SVG or HTML page as well)
                        raise RequestError(f"{where}: a file part holds a PDF, and this is not one (an image goes "
                                           f"in an image_url part)")
                    pages = (pdf_pages if limits.render_pdf is None else limits.render_pdf)(data, limits, where)
                    parts.extend({"type": "image", "image": page} for page in pages)
                    count += len(pages)
                    pixels += sum(p.width * p.height for p in pages)
                else:
                    raise RequestError(f"{where} must be a text, image_url or file part")
                if count > limits.max_images:
                    raise RequestError(f"more than {limits.max_images} images in one request")
                if pixels > limits.max_request_pixels:
                    raise RequestError(f"the request's images hold more than {limits.max_request_pixels} pixels")
            content = parts
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out, pixels


def _image_pixels(raw: bytes, limits: Limits, where: str) -> int:
    """An image's pixel count from its header (nothing decoded); RequestError past max_pixels or
    for bytes Pillow does not recognise."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as img:
                w, h = img.size
    except Image.DecompressionBombError as e:  # (its header is read: more pixels than Pillow opens)
        from docproc.pipeline.ingest import BOMB_PIXELS

        m = BOMB_PIXELS.search(str(e))
        size = f"{int(m.group(1))} pixels" if m else "more pixels than Pillow opens"
        raise RequestError(f"{where}: {size}, more than {min(limits.max_pixels, 2 * Image.MAX_IMAGE_PIXELS)}") from None
    except (Image.UnidentifiedImageError, OSError, ValueError, TypeError,
            SyntaxError, KeyError, IndexError, EOFError, struct.error):
        if raw[:5] == b"%PDF-":
            raise RequestError(f"{where}: a PDF, not an image: send it as a file part "
                               f"({{\"type\": \"file\", \"file\": {{\"file_data\": ...}}}})") from None
        raise RequestError(f"{where}: not an image Pillow recognises") from None
    if w * h > limits.max_pixels:
        raise RequestError(f"{where}: {w}x{h} pixels, more than {limits.max_pixels}")
    return w * h


DATA_URL = re.compile(r"data:([\w.+/-]*)(;[\w=.+-]+)*?(;base64)?,", re.I)
BARE_PDF = re.compile(r"JVBERi0[A-Za-z0-9+/]*={0,2}")  # base64 of "%PDF-..." (its first bytes fix "JVBERi0")


def _bare_pdf(value: object, limits: Limits, where: str) -> bytes | None:
    """A file part's PDF given as bare base64, without the data: URL around it (what some clients
    send); None for anything else (a data: URL, a path)."""
    if not isinstance(value, str) or not value.startswith("JVBERi0"):
        return None
    payload = "".join(value.split())  # (base64 wrapped in lines)
    if not BARE_PDF.fullmatch(payload):
        return None
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise RequestError(f"{where}: more than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the file's base64 is damaged") from None


def _read(url: object, limits: Limits, where: str) -> bytes:
    """A data: URL's bytes, or a local file's under the image root."""
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}: a data: URL or a local file is needed")
    m = DATA_URL.match(url)
    if m:
        payload = url[m.end():]
        if m.group(3) and re.search(r"\s", payload):
            payload = "".join(payload.split())  # base64 wrapped in lines (MIME's 76 columns), as decoders take it
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise RequestError(f"{where}: more than {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True) if m.group(3) else unquote_to_bytes(payload)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the data: URL's base64 is damaged") from None
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https", "ftp"):
        raise RequestError(f"{where}: docproc fetches nothing over the network: send the image as a data: URL")
    if parsed.scheme not in ("", "file"):
        raise RequestError(f"{where}: unsupported URL scheme {parsed.scheme!r}")
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise RequestError(f"{where}: a file:// URL names a file on this machine (file:///path), not on "
                           f"{parsed.netloc[:60]!r}")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url)
    root = limits.image_root
    if root is None:
        raise RequestError(f"{where}: local files are read only under --image-root, which is not set")
    if "\0" in str(path):
        raise RequestError(f"{where}: a file name may not hold a NUL character")
    # outside the root is refused before anything is said about whether the file exists
    try:
        full = (path if path.is_absolute() else root / path).resolve()
        inside = full.is_relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):
        inside = False
    if not inside:
        raise RequestError(f"{where}: {shown_path(path)} is outside --image-root")
    try:
        if not full.exists():
            raise RequestError(f"{where}: {shown_path(path)} does not exist")
        if not full.is_file():
            raise RequestError(f"{where}: {shown_path(path)} is not a regular file")
        if full.stat().st_size > limits.max_bytes:
            raise RequestError(f"{where}: {shown_path(path)} is larger than {limits.max_bytes} bytes")
        return full.read_bytes()
    except OSError as e:  # a name too long, a folder it may not read
        raise RequestError(f"{where}: cannot read {shown_path(path)}: {e.strerror}") from None


def shown_path(path: Path) -> str:
    """A path as an error message names it: at most 200 characters."""
    text = str(path)
    return text if len(text) <= 200 else text[:100] + "..." + text[-97:]


def pdf_pages(data: bytes, limits: Limits, where: str) -> list:
    """A PDF's pages as RGB images at limits.pdf_dpi (PyMuPDF), at most limits.max_images."""
    import pymupdf
    from PIL import Image

    from docproc.pipeline.ingest import page_zoom

    try:
        doc = pymupdf.open(stream=data, filetype="pdf")
    except Exception:  # noqa: BLE001 - MuPDF's errors vary: any is a damaged file
        raise RequestError(f"{where}: not a readable PDF") from None
    try:
        if doc.needs_pass:
            raise RequestError(f"{where}: the PDF is encrypted")
        if doc.page_count == 0:
            raise RequestError(f"{where}: the PDF has no pages")
        if doc.page_count > limits.max_images:
            raise RequestError(f"{where}: {doc.page_count} pages, more than {limits.max_images}")
        # each page at pdf_dpi, lowered to fit max_pixels (a poster-sized page); the whole PDF
        # within the request's pixels, checked before anything is rendered
        zooms = [page_zoom(page.rect.width, page.rect.height, limits.pdf_dpi, limits.max_pixels) for page in doc]
        pixels = sum(z * z * page.rect.width * page.rect.height for z, page in zip(zooms, doc))
        if pixels > limits.max_request_pixels:
            raise RequestError(f"{where}: its pages hold {int(pixels)} pixels, more than {limits.max_request_pixels}")
        pages = []
        for page, z in zip(doc, zooms):
            pix = page.get_pixmap(matrix=pymupdf.Matrix(z, z), alpha=False)
            pages.append(Image.frombytes("RGB", (pix.width, pix.height), pix.samples))
        return pages
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - a page MuPDF cannot render
        raise RequestError(f"{where}: a page of the PDF cannot be rendered ({type(e).__name__})") from None
    finally:
        doc.close()


def response_body(parsed: Parsed, out: RequestOutput, model: str, request_id: str) -> dict:
    """The `chat.completion` or `text_completion` body of a finished request."""
    created = int(time.time())
    completion = sum(len(c.token_ids) for c in out.outputs)
    usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
             "total_tokens": len(out.prompt_token_ids) + completion}
    if parsed.kind == CHAT:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None} for c in out.outputs]
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
               for c in out.outputs]
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}

