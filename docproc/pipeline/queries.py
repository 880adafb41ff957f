"""Query sets (TOML), the prompt each query is asked with, and answer parsing per query type."""
from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from docproc.pipeline.normalize import normalize_amount, normalize_date

QUERY_TYPES = ("string", "number", "date", "json")
NONE_ANSWERS = {"", "none", "null", "n/a", "na", "-"}
SYSTEM_PROMPT = "You read business documents and answer questions about them exactly as printed."
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class QueryFileError(ValueError):
    pass


@dataclass(frozen=True)
class Query:
    name: str
    question: str
    type: str = "string"
    max_tokens: int = 48


@dataclass(frozen=True)
class QuerySet:
    name: str
    queries: tuple[Query, ...]
    source: str

    @property
    def fingerprint(self) -> str:
        payload = json.dumps([[q.name, q.question, q.type, q.max_tokens] for q in self.queries])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_query_file() -> Path:
    return Path(str(resources.files("docproc") / "assets" / "queries" / "default.toml"))


def load_queries(path: str | Path | None = None) -> QuerySet:
    path = Path(path) if path else default_query_file()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise QueryFileError(f"query file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise QueryFileError(f"query file {path} is not valid TOML: {e}") from None
    raw = data.get("query")
    if not isinstance(raw, list) or not raw:
        raise QueryFileError(f"query file {path} has no [[query]] tables")
    queries, seen = [], set()
    for i, q in enumerate(raw):
        if not isinstance(q, dict) or not q.get("name") or not q.get("question"):
            raise QueryFileError(f"{path}: query {i + 1} needs a name and a question")
        qtype = q.get("type", "string")
        if qtype not in QUERY_TYPES:
            raise QueryFileError(f"{path}: query {q['name']!r} has type {qtype!r}; use one of {', '.join(QUERY_TYPES)}")
        if q["name"] in seen:
            raise QueryFileError(f"{path}: query name {q['name']!r} appears twice")
        seen.add(q["name"])
        max_tokens = int(q.get("max_tokens", 128 if qtype == "json" else 48))
        if max_tokens < 1:
            raise QueryFileError(f"{path}: query {q['name']!r} max_tokens must be >= 1")
        queries.append(Query(str(q["name"]), str(q["question"]), qtype, max_tokens))
    return QuerySet(str(data.get("name", path.stem)), tuple(queries), str(path))


def build_prompt(num_pages: int, question: str, anchor_text: str | None = None) -> str:
    """The chat prompt for one query over a document's pages (Qwen2-VL chat format)."""
    anchor = f"Document text:\n{anchor_text}\n" if anchor_text else ""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"{IMAGE_PLACEHOLDER * num_pages}{anchor}{question}<|im_end|>\n<|im_start|>assistant\n")


def parse_answer(qtype: str, text: str) -> tuple[str | None, str | None]:
    """(parsed value as a string, error). None value with no error means the answer was 'none'."""
    t = text.strip()
    if qtype != "json" and t.lower().rstrip(".") in NONE_ANSWERS:
        return None, None
    if qtype == "string":
        return t, None
    if qtype == "number":
        v = normalize_amount(t)
        return (v, None) if v is not None else (None, f"not a number: {t[:40]!r}")
    if qtype == "date":
        v = normalize_date(t)
        return (v, None) if v is not None else (None, f"not a date: {t[:40]!r}")
    m = re.search(r"\{.*\}", t, re.S)
    if not m:
        return None, "no JSON object in the answer"
    try:
        obj = json.loads(m.group(0))
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg}"
    if not isinstance(obj, dict):
        return None, "JSON answer is not an object"
    return json.dumps(obj, sort_keys=True, ensure_ascii=False), None
