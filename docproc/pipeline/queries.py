"""Query sets (TOML), the prompt each query is asked with, and answer parsing per query type."""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
import tomllib
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from docproc.multimodal import IMAGE_PLACEHOLDER
from docproc.pipeline.constraints import ANY_OBJECT, PATTERNS, RULE_FINGERPRINTS, answer_allowed
from docproc.pipeline.json_schema import MAX_DEPTH, AnswerJSONError, SchemaProblem, check_schema, unenforced
from docproc.pipeline.json_schema import loads as answer_json
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
    schema: str | None = None  # a json query's JSON Schema (canonical JSON text): its answer is constrained to it
    choices: tuple[str, ...] | None = None  # a string query's allowed answers: its answer is one of them
    constrained: bool = True  # false: decoded as free text (the query file's `constrained = false`)
    per_page: bool = False  # asked of each page alone, a row per page (the query file's `per_page = true`)

    @functools.cached_property
    def _structured_outputs(self):
        from docproc.sampling_params import StructuredOutputsParams

        if self.schema is not None:
            return StructuredOutputsParams(json=self.schema)
        if self.choices is not None:
            return StructuredOutputsParams(choice=list(self.choices))
        if not self.constrained:
            return None
        if self.type == "json":
            return StructuredOutputsParams(json=ANY_OBJECT)
        return StructuredOutputsParams(regex=PATTERNS[self.type])

    def structured_outputs(self):
        """The constraint the engine decodes this query's answer under (None: free text): its
        schema or choices, else its type's rule (pipeline/constraints.py). Made once per query:
        every request of the query shares it."""
        return self._structured_outputs

    def check(self, text: str) -> str | None:
        """Why an answer decoded without its constraint breaks it, or None."""
        return answer_allowed(self.type, text, self.schema, self.choices, self.constrained)

    @property
    def fingerprint_fields(self) -> list:
        so = self.structured_outputs()
        key = so.key() if so is not None else None
        if so is not None and so.kind == "regex" and so.regex == PATTERNS.get(self.type):
            key = f"regex:{RULE_FINGERPRINTS[self.type]}"  # a type's rule (constraints.RULE_FINGERPRINTS)
        # (per_page only when on: the fingerprints of sets without it stay as they were)
        return [self.name, self.question, self.type, self.max_tokens, key] + (["per_page"] if self.per_page else [])


@dataclass(frozen=True)
class QuerySet:
    name: str
    queries: tuple[Query, ...]
    source: str

    @property
    def warnings(self) -> list[str]:
        """What the query set asks that decoding cannot guarantee, one line per query: schema
        keywords the grammar does not enforce (answers are validated against them after)."""
        out = []
        for q in self.queries:
            keys = unenforced(json.loads(q.schema)) if q.schema is not None else []
            if keys:
                out.append(f"query {q.name!r}: the schema keyword(s) {', '.join(keys)} are not enforced while "
                           f"decoding; each answer is validated against them after (status schema_violation "
                           f"where one fails)")
        return out

    @property
    def constrained(self) -> list[str]:
        """Names of the queries whose answers are decoded under a constraint."""
        return [q.name for q in self.queries if q.structured_outputs() is not None]

    @property
    def fingerprint(self) -> str:
        payload = json.dumps([q.fingerprint_fields for q in self.queries])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_query_file() -> Path:
    return Path(str(resources.files("docproc") / "assets" / "queries" / "default.toml"))


QUERY_KEYS = ("name", "question", "type", "max_tokens", "schema", "schema_file", "choices", "constrained", "per_page")
FILE_KEYS = ("name", "query")
MAX_TOKENS_LIMIT = 32768
SCHEMA_FILE_LIMIT = 1 << 20  # bytes: a JSON Schema is small; anything bigger is the wrong file
QUERY_FILE_LIMIT = 16 << 20  # bytes: a query file, its schemas inline, likewise


def load_queries(path: str | Path | None = None) -> QuerySet:
    """A query set from TOML, checked whole before any model loads: QueryFileError names the
    query and the key at fault and says what is expected."""
    path = Path(path) if path else default_query_file()
    if path.is_dir():
        raise QueryFileError(f"query file {path} is a folder: pass a .toml file of [[query]] tables")
    try:
        with path.open("rb") as f:  # at most the limit (a pipe, `<(cmd)`, is fine; /dev/zero never ends)
            raw = f.read(QUERY_FILE_LIMIT + 1)
        if len(raw) > QUERY_FILE_LIMIT:
            raise QueryFileError(f"query file {path} is over {QUERY_FILE_LIMIT >> 20} MiB: not a query file")
        data = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise QueryFileError(f"query file {path} does not exist") from None
    except OSError as e:
        raise QueryFileError(f"cannot read query file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise QueryFileError(f"query file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise QueryFileError(f"query file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise QueryFileError(f"query file {path} nests tables more than {MAX_DEPTH} levels deep: flatten its "
                             f"schemas") from None
    except ValueError as e:  # (tomllib reads a whole number of thousands of digits with int())
        raise QueryFileError(f"query file {path} is not valid TOML: {json_value_problem(e)}") from None
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
        if any(unicodedata.category(c) in ("Cc", "Cs") or c in "\u2028\u2029" for c in name):
            raise QueryFileError(f"{where}: a query's name is one line of printable text (it names a column, a CSV "
                                 f"header and a JSON key); this one holds a control character")
        if name in seen:
            raise QueryFileError(f"{path}: query name {name!r} appears twice")
        folded = unicodedata.normalize("NFC", name).casefold()
        alike = next((n for n in seen if unicodedata.normalize("NFC", n).casefold() == folded), None)
        if alike is not None:
            raise QueryFileError(f"{path}: query names {alike!r} and {name!r} differ only in case or Unicode "
                                 f"composition: their columns would clash where names ignore case (SQL, DuckDB) "
                                 f"and look the same elsewhere; rename one")
        seen.add(name)
        max_tokens = q.get("max_tokens", 128 if qtype == "json" else 48)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise QueryFileError(f"{where}: max_tokens must be a whole number, got {max_tokens!r}")
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise QueryFileError(f"{where}: max_tokens must be from 1 to {MAX_TOKENS_LIMIT}, got {max_tokens}")
        schema, choices = _constraint(q, qtype, where, path)
        constrained = q.get("constrained", True)
        if not isinstance(constrained, bool):
            raise QueryFileError(f"{where}: constrained must be true or false, got {constrained!r}")
        if not constrained and (schema is not None or choices is not None):
            raise QueryFileError(f"{where}: constrained = false and a schema or choices contradict each other")
        per_page = q.get("per_page", False)
        if not isinstance(per_page, bool):
            raise QueryFileError(f"{where}: per_page must be true or false, got {per_page!r}")
        # the question as the prompt takes it: without the blank lines and spaces around it (a TOML
        # multi-line string ends in a newline), which would change its fingerprint and redo every
        # document for an edit the model should not see
        queries.append(Query(name, q["question"].strip(), qtype, max_tokens, schema, choices, constrained, per_page))
    return QuerySet(data.get("name", path.stem), tuple(queries), str(path))


def _toml_time(value):
    """The first TOML date, time or date-time in an inline schema (tomllib reads them as datetime
    objects, which JSON has no form for), or None; without recursion (a schema may nest deep)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (datetime.date, datetime.time)):
            return v.isoformat()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def not_json(constant: str):
    """json.loads' parse_constant: NaN, Infinity and -Infinity are not JSON (Python reads them)."""
    raise ValueError(f"{constant} is not a JSON number")


def json_value_problem(e: ValueError) -> str:
    """What a json.loads ValueError that is not a syntax error says, for a user: not_json's, or
    Python's limit on the digits of a whole number (whose own text suggests a Python call)."""
    return "a whole number of more than 4,300 digits" if "integer string conversion" in str(e) else str(e)


def _constraint(q: dict, qtype: str, where: str, path: Path) -> tuple[str | None, tuple[str, ...] | None]:
    """A query's schema (inline `schema` table or `schema_file`, relative to the query file) or its
    `choices`, checked."""
    if "schema" in q and "schema_file" in q:
        raise QueryFileError(f"{where}: give schema or schema_file, not both")
    schema = None
    if "schema" in q or "schema_file" in q:
        if qtype != "json":
            raise QueryFileError(f"{where}: a schema needs type = \"json\" (got type {qtype!r})")
        if "schema" in q:
            schema = q["schema"]
            if not isinstance(schema, dict):
                raise QueryFileError(f"{where}: schema must be a table (a JSON Schema), got {type(schema).__name__}")
        else:
            if not isinstance(q["schema_file"], str) or not q["schema_file"]:
                raise QueryFileError(f"{where}: schema_file must be a path, got {q['schema_file']!r}")
            try:
                file = (path.parent / q["schema_file"]).resolve()
            except (OSError, RuntimeError) as e:  # (a symbolic link loop: RuntimeError before Python 3.13)
                raise QueryFileError(f"{where}: schema_file {q['schema_file']} cannot be followed: {e}") from None
            if file.exists() and not file.is_file():  # a folder, a FIFO or a device would block or never end
                raise QueryFileError(f"{where}: schema_file {file} is not a regular file")
            if file.is_file() and file.stat().st_size > SCHEMA_FILE_LIMIT:
                raise QueryFileError(f"{where}: schema_file {file} is over {SCHEMA_FILE_LIMIT >> 20} MiB: "
                                     f"not a schema")
            try:
                schema = json.loads(file.read_text(encoding="utf-8"), parse_constant=not_json)
            except FileNotFoundError:
                raise QueryFileError(f"{where}: schema_file {file} does not exist") from None
            except (OSError, UnicodeDecodeError) as e:
                raise QueryFileError(f"{where}: cannot read schema_file {file}: {e}") from None
            except json.JSONDecodeError as e:
                raise QueryFileError(f"{where}: schema_file {file} is not valid JSON: {e}") from None
            except ValueError as e:  # (NaN or Infinity, or a whole number of thousands of digits)
                raise QueryFileError(f"{where}: schema_file {file} is not valid JSON: {json_value_problem(e)}") from None
            except RecursionError:
                raise QueryFileError(f"{where}: its schema cannot be used: the schema is nested more than "
                                     f"{MAX_DEPTH} levels deep: flatten it") from None
            if not isinstance(schema, dict):
                raise QueryFileError(f"{where}: schema_file {file} must hold a JSON object (a JSON Schema)")
        toml_time = _toml_time(schema)
        if toml_time is not None:
            raise QueryFileError(f"{where}: its schema cannot be used: {toml_time} is a TOML date or time, not a JSON "
                                 f"value: quote it (\"{toml_time}\")")
        try:
            check_schema(schema)
            # as written: the order of an object's properties is the order the answer gives them in
            # (sorting them would have the model write its values under the wrong keys)
            schema = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except SchemaProblem as e:
            raise QueryFileError(f"{where}: its schema cannot be used: {e}") from None
        except ValueError as e:  # (TOML's nan and inf, a whole number of thousands of digits)
            problem = "nan or inf is not a JSON number" if "Out of range float" in str(e) else json_value_problem(e)
            raise QueryFileError(f"{where}: its schema cannot be used: {problem}") from None
    choices = None
    if "choices" in q:
        if qtype != "string":
            raise QueryFileError(f"{where}: choices need type = \"string\" (got type {qtype!r})")
        c = q["choices"]
        if not isinstance(c, list) or not c or not all(isinstance(x, str) and x for x in c) or len(set(c)) < len(c):
            raise QueryFileError(f"{where}: choices must be a list of distinct non-empty strings, got {c!r}")
        choices = tuple(c)
    return schema, choices


def build_prompt(num_pages: int, question: str, anchor_text: str | None = None) -> str:
    """The chat prompt for one query over a document's pages (Qwen2-VL chat format)."""
    anchor = f"Document text:\n{anchor_text}\n" if anchor_text else ""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"{IMAGE_PLACEHOLDER * num_pages}{anchor}{question}<|im_end|>\n<|im_start|>assistant\n")


def parse_answer(qtype: str, text: str, schema: bool = False) -> tuple[str | None, str | None]:
    """(parsed value as a string, error). None value with no error means the answer was 'none'.
    Never raises: an answer that breaks a parser (JSON nested past the recursion limit, say) is a
    parse error of that answer. schema: the answer was decoded under a JSON Schema, so it is one
    JSON value as a whole (an object, or whatever the schema's root is; null is no answer)."""
    try:
        if schema:
            value = answer_json(text)
            return (None if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)), None
        return _parse(qtype, text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg}"
    except AnswerJSONError as e:
        return None, f"invalid JSON: {e}"
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
        obj = answer_json(m.group(0))
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg}"
    if not isinstance(obj, dict):
        return None, "JSON answer is not an object"
    return json.dumps(obj, sort_keys=True, ensure_ascii=False), None
