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
