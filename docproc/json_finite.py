"""Whether every part of a JSON Schema that decoding can enter admits a finite value.

A schema can refer to itself ($ref) through what it requires: `{"properties": {"n": {"$ref":
"#"}}, "required": ["n"]}` is valid JSON Schema, but no finite JSON value matches it. Decoding under
it never ends: the grammar forces `{"n": {"n": ...` with no place to stop, and the search for the
text it forces grows without bound (xgrammar's `find_jump_forward_string` took gigabytes in
seconds). The same holds for an optional part (an anyOf branch, an optional property, an array's
items) that the answer may enter. So such schemas are refused where a constraint is made
(StructuredOutputsParams) and where a query file is checked. Torch-free; no imports.
"""
from __future__ import annotations

# keywords through which decoding can enter a subschema
_REACHED = ("properties", "patternProperties", "additionalProperties", "items", "prefixItems", "anyOf", "oneOf",
            "allOf")
_SCALARS = ("null", "boolean", "number", "integer", "string")


def endless(root) -> str | None:
    """A message naming the first subschema decoding can enter that no finite value matches (a
    $ref cycle through required properties, minProperties or non-empty arrays), or None when there
    is none (or root is not a schema object). A least fixed point over a worklist: every such
    subschema starts as admitting no finite value and is marked finite once it admits a scalar,
    an empty array, an object whose required properties admit finite values, a const, an enum, or
    a finite branch of its anyOf; a subschema is looked at again only when one it depends on was
    marked (linear in the schema). xgrammar decodes an anyOf, oneOf or allOf alone, ignoring the
    keywords beside it, and so is this. A type it does not know, and $refs that do not resolve,
    are left to the other checks."""
    if not isinstance(root, dict):
        return None
    nodes: dict[int, tuple[dict, str]] = {}
    parents: dict[int, list[int]] = {}  # id of a subschema -> ids of those whose answer depends on it
    stack: list[tuple[object, tuple, int | None]] = [(root, (), None)]
    while stack:
        node, path, parent = stack.pop()
        if not isinstance(node, dict):
            continue
        if parent is not None:
            parents.setdefault(id(node), []).append(parent)
        if id(node) in nodes:
            continue
        nodes[id(node)] = (node, "/" + "/".join(map(str, path)) if path else "the root")
        for key, child in _reached(node):
            stack.append((child, path + key, id(node)))
        target = _target(root, node)
        if target is not None:
            stack.append((target, tuple(p for p in node["$ref"][2:].split("/") if p), id(node)))
    finite: set[int] = set()

    def ok(child) -> bool:
        return not isinstance(child, dict) or id(child) in finite

    def admits(node: dict) -> bool:
        if not ok(_target(root, node)):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                return any(ok(s) for s in node[key])
        if isinstance(node.get("allOf"), list) and node["allOf"]:
            return all(ok(s) for s in node["allOf"])
        if "const" in node or isinstance(node.get("enum"), list):
            return True
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if any(t in _SCALARS for t in types) or not any(t in ("array", "object", None) for t in types):
            return True  # (an unknown type: the meta-schema check or xgrammar names it)
        if None in types and "properties" not in node and "items" not in node:
            return True
        if "array" in types or None in types and "items" in node:
            n = node.get("minItems", 0)
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if not isinstance(n, int) or n <= 0 or (all(ok(s) for s in prefix[:n])
                                                     and (n <= len(prefix) or ok(node.get("items", True)))):
                return True
        if "object" in types or None in types and "properties" in node:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            if not all(ok(props.get(k, True)) for k in required if isinstance(k, str)):
                return False
            least = node.get("minProperties", 0)
            if not isinstance(least, int) or least <= 0:
                return True
            extra = [node.get("additionalProperties"), *(node.get("patternProperties") or {}).values()]
            if any(isinstance(x, dict) and ok(x) or x is True for x in extra):
                return True  # as many more properties as it takes
            return sum(ok(s) for s in props.values()) >= least
        return False

    todo = list(nodes)
    while todo:
        key = todo.pop()
        if key in finite or not admits(nodes[key][0]):
            continue
        finite.add(key)
        todo.extend(parent for parent in parents.get(key, ()) if parent not in finite)
    where = next((where for key, (_, where) in nodes.items() if key not in finite), None)
    if where is None:
        return None
    short = next((w for key, (node, w) in nodes.items() if key not in finite and _too_few(node)), None)
    if short is not None:  # (nothing refers back: the subschema itself can hold too few properties)
        return (f"no JSON value matches the subschema at {short}: its minProperties asks for more properties "
                f"than its properties allow, and decoding writes no others (its additionalProperties is not true or a "
                f"schema)")
    return (f"no finite JSON value matches the subschema at {where}: what it requires ($ref, required "
            f"properties, minProperties, minItems) refers back to it without end; make the recursion optional")


def _too_few(node: dict) -> bool:
    """Whether an object subschema's minProperties asks for more properties than it may hold
    whatever they are: more than its properties, with no additionalProperties or
    patternProperties to take others."""
    least = node.get("minProperties")
    if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
        return False
    extra = [node.get("additionalProperties", False), *(node.get("patternProperties") or {}).values()]
    if any(x is True or isinstance(x, dict) for x in extra):
        return False
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    return len(props) < least


def _reached(node: dict):
    """(path suffix, subschema) for each subschema decoding can enter from node."""
    for key in _REACHED:
        value = node.get(key)
        if isinstance(value, dict) and key in ("properties", "patternProperties"):
            yield from (((key, name), s) for name, s in value.items())
        elif isinstance(value, dict):
            yield (key,), value
        elif isinstance(value, list) and key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            yield from (((key, i), s) for i, s in enumerate(value))


def _target(root, node: dict):
    """The subschema node's local $ref ("#", "#/a/b") names, or None (no $ref, or one that does
    not resolve to a schema object)."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = resolve(root, ref)
    return target if isinstance(target, dict) else None


MISSING = object()  # what resolve() gives for a pointer to nothing


def resolve(root, ref: str):
    """What a local JSON pointer ("#", "#/a/b", with ~0 and ~1 escapes) names in root, whatever
    its type, or MISSING."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and len(part) < 10 and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node
