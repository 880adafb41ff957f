"""Walking a JSON Schema by its keywords: which values are schemas (and so hold constraints) and
which are data or names. A walk over every dict of a schema mistakes data for schemas (a `const`
object that looks like `{"type": "string", "maxLength": 3}`) and names for keywords (a property
called `enum`, `pattern` or `minLength`). Torch-free.
"""
from __future__ import annotations

from docproc.json_finite import MISSING, resolve

# keywords whose value is one schema (items: a list of schemas too, as older drafts write tuples)
SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems", "additionalItems")
# keywords whose value is a list of schemas
SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
# keywords whose value maps names to schemas
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# the string formats the grammar backend (xgrammar 0.2.9) decodes; it decodes a string of another
# format as any string, and a string of one of these without its length bounds
GRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                             "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
RANGE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# a plain string's length bounds are decoded up to this many characters (as a pattern over JSON
# string characters: xgrammar takes 0.3 s to build it at 512, 8 s at 2,000); longer bounds are
# left to the validation after decoding
STRICT_LENGTH_LIMIT = 512
# the largest count a pattern's {m,n} may name: xgrammar's time to build a pattern grows with the
# square of it (0.2 s at 1,000, 61 s at 20,000), before any request can be answered
MAX_PATTERN_REPEAT = 1000
MAX_SCHEMA_REPEAT = 8000  # the counts of all of a schema's patterns together (about 2 s to build at 8,000)


def rebuild(schema, fn):
    """A copy of the schema in which every subschema (the root included) is replaced by fn of it,
    its own subschemas rebuilt first; values of other keywords are kept as they are. Not a dict
    (true, false, or not a schema): as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = rebuild(value, fn)
        elif isinstance(value, list) and key == "items":
            out[key] = [rebuild(s, fn) for s in value]
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [rebuild(s, fn) for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rebuild(s, fn) for name, s in out[key].items()}
    return fn(out)


def subschemas(schema):
    """Every subschema of the schema (dicts only), the root first."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key in SUBSCHEMA:
            value = node.get(key)
            stack.extend(value if isinstance(value, list) and key == "items" else [value])
        for key in SUBSCHEMAS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())


def stray_ref(schema) -> str | None:
    """The first local `$ref` ("#/...") whose pointer does not end on a subschema reached through
    schema keywords (it goes through another key, as `#/components/s` does, or ends on a map or a
    list of them, as `#/$defs` does), or None. What it points at is not walked as a schema
    (number bounds, strict strings, pattern checks), though the grammar would decode it: such a
    schema is refused, its target to be moved under $defs."""
    for node in subschemas(schema):
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/") or resolve(schema, ref) is MISSING:
            continue  # (a pointer to nothing is named by the checks and the compile as dangling)
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
        at, i = schema, 0
        while i < len(parts) and isinstance(at, dict):
            key, value = parts[i], at.get(parts[i])
            if key in SUBSCHEMA and not (key == "items" and isinstance(value, list)):
                at, i = value, i + 1
            elif key in SUBSCHEMAS or key in SCHEMA_MAPS or key == "items":
                if i + 1 >= len(parts):
                    return ref  # (a list or a map of subschemas, not one)
                at, i = resolve(value, "#/" + parts[i + 1].replace("~", "~0").replace("/", "~1")), i + 2
            else:
                return ref
        if i < len(parts) or not isinstance(at, (dict, bool)):
            return ref
    return None


MAX_GRAMMAR_MULTIPLE = 1024  # the largest multipleOf xgrammar 0.2.9 decodes (an integer's, without a range)


def grammar_multiple_of(node: dict) -> bool:
    """Whether the grammar enforces this subschema's multipleOf: an integer's (its type only
    "integer"), a whole number from 1 to MAX_GRAMMAR_MULTIPLE, with no range beside it. Elsewhere
    xgrammar ignores it (and logs so on stderr)."""
    m, types = node.get("multipleOf"), node.get("type")
    whole = (isinstance(m, int) and not isinstance(m, bool)) or (isinstance(m, float) and m.is_integer())
    return (types in ("integer", ["integer"]) and whole and 0 < m <= MAX_GRAMMAR_MULTIPLE
            and not any(k in node for k in RANGE_KEYWORDS))
