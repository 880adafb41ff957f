"""Query sets (TOML), the prompt each query is asked with, and answer parsing per query type."""
from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from docproc.multimodal import IMAGE_PLACEHOLDER
from docproc.pipeline.normalize import normalize_amount, normalize_date

QUERY_TYPES = ("string", "number", "date", "json")
NONE_ANSWERS = {"", "none", "null", "n/a", "na", "-"}
SYSTEM_PROMPT = "You read business documents and answer questions about them exactly as printed."


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


QUERY_KEYS = ("name", "question", "type", "max_tokens")
FILE_KEYS = ("name", "query")
MAX_TOKENS_LIMIT = 32768


def load_queries(path: str | Path | None = None) -> QuerySet:
    """A query set from TOML, checked whole before any model loads: QueryFileError names the
    query and the key at fault and says what is expected."""
    path = Path(path) if path else default_query_file()
    if path.is_dir():
        raise QueryFileError(f"query file {path} is a folder: pass a .toml file of [[query]] tables")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise QueryFileError(f"query file {path} does not exist") from None
    except OSError as e:
        raise QueryFileError(f"cannot read query file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise QueryFileError(f"query file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise QueryFileError(f"query file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise QueryFileError(f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                             f"a query file has {' and '.join(FILE_KEYS)} ([[query]] tables)")
    if "name" in data and not isinstance(data["name"], str):
        raise QueryFileError(f"{path}: name must be a string, got {type(data['name']).__name__}")
    raw = data.get("query")
    if not isinstance(raw, list) or not raw:
        raise QueryFileError(f"query file {path} has no [[query]] tables: add at least one, with a name and "
                             f"a question")
    queries, seen = [], set()
    for i, q in enumerate(raw):
        where = f"{path}: query {i + 1}"
        if not isinstance(q, dict):
            raise QueryFileError(f"{where} is not a table: write each query as a [[query]] table")
        unknown = sorted(set(q) - set(QUERY_KEYS))
        if unknown:
            raise QueryFileError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                                 f"a query has {', '.join(QUERY_KEYS)}")
        for key in ("name", "question"):
            if key not in q:
                raise QueryFileError(f"{where} needs a {key}")
            if not isinstance(q[key], str) or not q[key].strip():
                got = type(q[key]).__name__ if not isinstance(q[key], str) else "an empty string"
                raise QueryFileError(f"{where}: {key} must be a non-empty string, got {got}")
        name = q["name"]
        where = f"{path}: query {name!r}"
        qtype = q.get("type", "string")
        if qtype not in QUERY_TYPES:
            raise QueryFileError(f"{where} has type {qtype!r}; use one of {', '.join(QUERY_TYPES)}")
        if name in seen:
            raise QueryFileError(f"{path}: query name {name!r} appears twice")
        seen.add(name)
        max_tokens = q.get("max_tokens", 128 if qtype == "json" else 48)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise QueryFileError(f"{where}: max_tokens must be a whole number, got {max_tokens!r}")
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise QueryFileError(f"{where}: max_tokens must be from 1 to {MAX_TOKENS_LIMIT}, got {max_tokens}")
        queries.append(Query(name, q["question"], qtype, max_tokens))
    return QuerySet(data.get("name", path.stem), tuple(queries), str(path))


def build_prompt(num_pages: int, question: str, anchor_text: str | None = None) -> str:
    """The chat prompt for one query over a document's pages (Qwen2-VL chat format)."""
    anchor = f"Document text:\n{anchor_text}\n" if anchor_text else ""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"{IMAGE_PLACEHOLDER * num_pages}{anchor}{question}<|im_end|>\n<|im_start|>assistant\n")


def parse_answer(qtype: str, text: str) -> tuple[str | None, str | None]:
    """(parsed value as a string, error). None value with no error means the answer was 'none'.
    Never raises: an answer that breaks a parser (JSON nested past the recursion limit, say) is a
    parse error of that answer."""
    try:
        return _parse(qtype, text)
    except (ValueError, ArithmeticError, RecursionError, TypeError) as e:
        return None, f"unparseable answer ({type(e).__name__})"


def _parse(qtype: str, text: str) -> tuple[str | None, str | None]:
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
