"""Walking a JSON Schema by its keywords: which values are schemas (and so hold constraints) and
which are data or names. A walk over every dict of a schema mistakes data for schemas (a `const`
object that looks like `{"type": "string", "maxLength": 3}`) and names for keywords (a property
called `enum`, `pattern` or `minLength`). Torch-free; no imports.
"""
from __future__ import annotations

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
