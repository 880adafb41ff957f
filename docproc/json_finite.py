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
    $ref cycle through required properties or non-empty arrays), or None when there is none (or
    root is not a schema object). A least fixed point: every such subschema starts as admitting
    no finite value, and one that admits a scalar, an empty array, an object whose required
    properties admit finite values, a const, an enum, or a finite branch of its anyOf, is marked
    finite, until nothing changes. $refs that do not resolve are left to the other checks."""
    if not isinstance(root, dict):
        return None
    nodes: dict[int, tuple[dict, str]] = {}
    stack: list[tuple[object, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        nodes[id(node)] = (node, "/" + "/".join(map(str, path)) if path else "the root")
        for key, child in _reached(node):
            stack.append((child, path + key))
        target = _target(root, node)
        if target is not None:
            stack.append((target, tuple(p for p in node["$ref"][2:].split("/") if p)))
    finite: set[int] = set()

    def ok(child) -> bool:
        return not isinstance(child, dict) or id(child) in finite

    def admits(node: dict) -> bool:
        if not ok(_target(root, node)):
            return False
        if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
                return False
        if "const" in node or isinstance(node.get("enum"), list):
            return True
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if any(t in _SCALARS for t in types) or None in types and "properties" not in node and "items" not in node:
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
            if all(ok(props.get(k, True)) for k in required if isinstance(k, str)):
                return True
        return False

    changed = True
    while changed:
        changed = False
        for key, (node, _) in nodes.items():
            if key not in finite and admits(node):
                finite.add(key)
                changed = True
    where = next((where for key, (_, where) in nodes.items() if key not in finite), None)
    if where is None:
        return None
    return (f"no finite JSON value matches the subschema at {where}: what it requires ($ref, required "
            f"properties, minItems) refers back to it without end; make the recursion optional")


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
    target = root
    for part in (p for p in ref[2:].split("/") if p):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target if isinstance(target, dict) else None
