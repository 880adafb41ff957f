"""A query's JSON Schema: checked whole before any model loads, and every answer validated
against the whole schema after decoding. Torch-free.

Decoding under a schema (engine/structured.py) enforces the structure a grammar can express:
types, properties and their order, required, enum and const, anyOf, string lengths and patterns,
number ranges and multiples, array lengths, property counts and names. Some keywords are not
enforced that way (UNENFORCED; oneOf is decoded as anyOf, allOf not at all): an answer
is decoded without them and then validated against the whole schema with the `jsonschema`
package (Draft 2020-12); one that breaks it is stored with status `schema_violation`.
"""
from __future__ import annotations

import json

from docproc.json_finite import MISSING, endless, resolve
from docproc.schema_walk import (GRAMMAR_FORMATS, MAX_GRAMMAR_MULTIPLE, RANGE_KEYWORDS, STRICT_LENGTH_LIMIT,
                                 grammar_multiple_of, stray_ref)
from docproc.schema_walk import SCHEMA_MAPS as _SCHEMA_MAPS, SUBSCHEMA as _SUBSCHEMA, SUBSCHEMAS as _SUBSCHEMAS

MAX_DEPTH = 100  # nesting of objects and arrays in a query's schema (a property of a property: 2 levels)
# keywords the grammar does not enforce while decoding (validated after, named in a warning): what
# xgrammar's JSON Schema grammars leave out (tests/test_answers.py holds it to that)
UNENFORCED = ("not", "allOf", "oneOf", "uniqueItems", "contains", "minContains", "maxContains", "if", "then",
              "else", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"),
           ("minProperties", "maxProperties"), ("minContains", "maxContains"))


class SchemaProblem(ValueError):
    """A schema that cannot be used: the message names the keyword and where it is."""


def _where(path) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "the root"


def _depth_ok(schema) -> None:
    """Nesting within MAX_DEPTH, checked without recursion (a schema nested thousands of levels
    deep would otherwise end in a RecursionError anywhere it is walked)."""
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaProblem(f"the schema is nested more than {MAX_DEPTH} levels deep: flatten it")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _walk(schema, path=()):
    """Every subschema with its path (keywords that hold schemas only; not enum or const values)."""
    if not isinstance(schema, dict):
        return
    yield schema, path
    for key in _SUBSCHEMA:
        if key in schema:
            yield from _walk(schema[key], path + (key,))
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), list):
            for i, s in enumerate(schema[key]):
                yield from _walk(s, path + (key, i))
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, s in schema[key].items():
                yield from _walk(s, path + (key, name))


def _must(schema, path=()):
    """The subschemas every answer must pass, with their paths: the root, the properties it
    requires, the members of allOf and the items of an array that must hold one (not anyOf's
    alternatives, optional properties, $defs or a $ref's target: a part there that nothing can
    match leaves other answers)."""
    if not isinstance(schema, dict):
        return
    yield schema, path
    props, required = schema.get("properties"), schema.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        for name in required:
            if name in props:
                yield from _must(props[name], path + ("properties", name))
    if isinstance(schema.get("allOf"), list):
        for i, sub in enumerate(schema["allOf"]):
            yield from _must(sub, path + ("allOf", i))
    min_items = schema.get("minItems")
    if isinstance(min_items, int) and min_items > 0 and isinstance(schema.get("items"), dict):
        yield from _must(schema["items"], path + ("items",))


def _pointer(root, ref: str, where: str):
    """The subschema a local $ref names ("#" or "#/a/b"), or SchemaProblem."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise SchemaProblem(f"$ref {ref!r} at {where} is not a reference inside the schema (\"#/$defs/NAME\"): "
                            f"docproc reads no other documents")
    node = resolve(root, ref)
    if node is MISSING:
        raise SchemaProblem(f"$ref {ref!r} at {where} points to nothing in the schema: define it under $defs")
    if not isinstance(node, (dict, bool)):
        raise SchemaProblem(f"$ref {ref!r} at {where} points to a {type(node).__name__}, not a schema")
    return node


def check_schema(schema) -> None:
    """SchemaProblem naming the keyword and its place if schema is not a usable JSON Schema: its
    nesting, the Draft 2020-12 meta-schema (types, keyword value types, regex patterns), empty
    enums, lower bounds over upper bounds, and $refs that are dangling, not local, or circular
    without a value in between."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    if not isinstance(schema, dict):
        raise SchemaProblem(f"a schema must be a JSON object, got {type(schema).__name__}")
    _depth_ok(schema)
    stray = stray_ref(schema)
    if stray is not None:
        raise SchemaProblem(f"$ref {stray!r} points outside the schema's subschemas: move what it names under "
                            f"$defs (\"#/$defs/NAME\")")
    try:
        err = best_match(Draft202012Validator(Draft202012Validator.META_SCHEMA,
                                              format_checker=Draft202012Validator.FORMAT_CHECKER).iter_errors(schema))
    except RecursionError:  # (nesting within MAX_DEPTH that the meta-schema still walks too deep)
        raise SchemaProblem("the schema is nested too deeply to check: flatten it") from None
    if err is not None:
        path = list(err.absolute_path)
        keyword = next((p for p in reversed(path) if isinstance(p, str)), None)
        hint = ""
        if keyword == "type":
            hint = ": use string, number, integer, boolean, object, array or null"
        raise SchemaProblem(f"keyword {keyword or err.validator!r} at {_where(path)}: {err.message}{hint}")
    is_type = Draft202012Validator.TYPE_CHECKER.is_type
    for sub, path in _must(schema):  # (where every answer must pass it: nothing could match)
        types = sub.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None:  # a const or every enum member outside the declared type: nothing matches
            fits = lambda v: any(is_type(v, t) for t in types)  # noqa: E731
            if "const" in sub and not fits(sub["const"]):
                raise SchemaProblem(f"keyword 'const' at {_where(path + ('const',))} is {json.dumps(sub['const'], default=str)}, "
                                    f"not of type {' or '.join(types)}: no answer could match")
            if isinstance(sub.get("enum"), list) and sub["enum"] and not any(fits(v) for v in sub["enum"]):
                raise SchemaProblem(f"keyword 'enum' at {_where(path + ('enum',))} holds no value of type "
                                    f"{' or '.join(types)}: no answer could match")
        if sub.get("additionalProperties") is False and isinstance(sub.get("required"), list) \
                and not sub.get("patternProperties"):
            props = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
            absent = [n for n in sub["required"] if n not in props]
            if absent:
                raise SchemaProblem(f"required property {absent[0]!r} at {_where(path)} is not among its properties, "
                                    f"and additionalProperties is false: no answer could match")
    for sub, path in _walk(schema):
        if sub.get("enum") == []:
            raise SchemaProblem(f"keyword 'enum' at {_where(path + ('enum',))} is empty: no answer could match it")
        for lo, hi in _BOUNDS:
            if isinstance(sub.get(lo), (int, float)) and isinstance(sub.get(hi), (int, float)) and sub[lo] > sub[hi]:
                raise SchemaProblem(f"keywords {lo!r} {sub[lo]} and {hi!r} {sub[hi]} at {_where(path)} "
                                    f"contradict each other: no answer could match")
        if "$ref" in sub:
            seen = {id(sub)}
            node, where = sub, _where(path)
            while isinstance(node, dict) and "$ref" in node:
                node = _pointer(schema, node["$ref"], where)
                if id(node) in seen:
                    raise SchemaProblem(f"$ref {sub['$ref']!r} at {where} is circular: it refers back to "
                                        f"itself without a value in between")
                seen.add(id(node))
    problem = endless(schema)
    if problem is not None:
        raise SchemaProblem(problem)


def unenforced(schema) -> list[str]:
    """The keywords of schema that decoding does not enforce (each answer is validated against
    them after): UNENFORCED's; a string's length bounds beside its pattern or a format xgrammar
    knows (it decodes the pattern or format alone), or over STRICT_LENGTH_LIMIT, and a format it
    does not know; multipleOf of a number, or of an integer with a range."""
    keys = set()
    for sub, _ in _walk(schema):
        keys.update(k for k in sub if k in UNENFORCED)
        if isinstance(sub.get("pattern"), str):
            keys.update(f"{k} (beside pattern)" for k in ("minLength", "maxLength") if k in sub)
        elif isinstance(sub.get("format"), str) and sub["format"] in GRAMMAR_FORMATS:
            keys.update(f"{k} (beside format)" for k in ("minLength", "maxLength") if k in sub)
        elif (sub.get("type") == "string" or isinstance(sub.get("type"), list) and "string" in sub["type"]) and any(
                isinstance(sub.get(k), (int, float)) and sub[k] > STRICT_LENGTH_LIMIT for k in ("minLength", "maxLength")):
            keys.update(f"{k} (over {STRICT_LENGTH_LIMIT})" for k in ("minLength", "maxLength") if k in sub)
        if isinstance(sub.get("format"), str) and sub["format"] not in GRAMMAR_FORMATS:
            keys.add(f"format {sub['format']!r}")
        if "multipleOf" in sub and not grammar_multiple_of(sub):
            types = sub.get("type") if isinstance(sub.get("type"), list) else [sub.get("type")]
            m = sub["multipleOf"]
            if types != ["integer"]:
                keys.add("multipleOf (of a type other than integer alone)")
            elif any(k in sub for k in RANGE_KEYWORDS):
                keys.add("multipleOf (beside a range)")
            else:
                keys.add(f"multipleOf {m} (not a whole number from 1 to {MAX_GRAMMAR_MULTIPLE:,})")
    return sorted(keys)


def violation(value, schema) -> str | None:
    """Where value breaks schema, or None (the whole of Draft 2020-12; a number outside float's
    range, NaN or an infinity is not a JSON number)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    bad = _not_finite(value)
    if bad is not None:
        return f"{bad} is not a finite number"
    try:
        err = best_match(Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
                         .iter_errors(value))
    except RecursionError:
        return "the answer is nested too deeply to validate"
    if err is None:
        return None
    return f"{'$' + ''.join(f'[{p}]' if isinstance(p, int) else f'.{p}' for p in err.absolute_path)}: {err.message}"


def _not_finite(value, where: str = "$") -> str | None:
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return w
        if isinstance(v, dict):
            stack.extend((x, f"{w}.{k}") for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in enumerate(v))
    return None


class AnswerJSONError(ValueError):
    """JSON text that Python's json module reads but a strict reader does not: NaN or Infinity, a
    number too large for a double, or a key twice in one object."""


def _constant(name: str):
    raise AnswerJSONError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise AnswerJSONError(f"the number {text[:40]} is too large for a double")
    return value


def _unique(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise AnswerJSONError(f"the key {key[:40]!r} appears twice in one object (which value is meant?)")
    return obj


def loads(text: str):
    """One JSON value as a strict reader takes it: ValueError for text that is not JSON, and
    AnswerJSONError for what Python's json.loads takes but other readers refuse or read otherwise
    (NaN and Infinity; a number past a double's range, which Python makes infinite and writes back
    as Infinity; a key twice in one object, where Python keeps the last value and others the
    first or an error)."""
    return json.loads(text, parse_constant=_constant, parse_float=_finite, object_pairs_hook=_unique)

