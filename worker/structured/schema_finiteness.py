"""Whether a JSON schema admits any finite value.

A recursive schema whose recursion is required at every level (``{"properties": {"child":
{"$ref": "#"}}, "required": ["child"]}``) has no finite instance. A grammar built from it
accepts nothing, so constrained decoding could only stop at once: a 200 with empty content.
Such a schema is refused with a 400 instead. Recursion with a way out (an optional property, an
``anyOf`` with ``null``, an array that may be empty) is fine: the grammar engine enforces it.

The check is a least fixpoint over the schema's ``$ref`` targets, like finding the productive
nonterminals of a context-free grammar: a reference is finite once its target is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_COMBINATORS_ANY = ("anyOf", "oneOf")


def admits_finite_value(schema: Mapping[str, Any]) -> bool:
    finite_refs: set[str] = set()
    refs = _local_refs(schema)
    changed = True
    while changed:
        changed = False
        for ref in refs - finite_refs:
            target = _resolve(schema, ref)
            # A reference that names nothing is left to the grammar engine to report.
            if target is None or _is_finite(target, schema, finite_refs):
                finite_refs.add(ref)
                changed = True
    return _is_finite(schema, schema, finite_refs)


def _is_finite(node: object, root: Mapping[str, Any], finite_refs: set[str]) -> bool:
    """With the references in ``finite_refs`` known finite (others not yet)."""
    if isinstance(node, bool):
        return node  # `false` admits nothing
    if not isinstance(node, Mapping):
        return True  # not a schema we understand: let the grammar engine judge it
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite_refs:
        return False
    if "const" in node or "enum" in node:
        return True
    for keyword in _COMBINATORS_ANY:
        options = node.get(keyword)
        if isinstance(options, list) and options and not any(_is_finite(o, root, finite_refs) for o in options):
            return False
    parts = node.get("allOf")
    if isinstance(parts, list) and not all(_is_finite(p, root, finite_refs) for p in parts):
        return False
    types = node.get("type")
    type_list = types if isinstance(types, list) else [types] if isinstance(types, str) else []
    if type_list and not any(_type_is_finite(t, node, root, finite_refs) for t in type_list):
        return False
    # Untyped: finite unless it has required properties that are not.
    return bool(type_list) or _type_is_finite("object", node, root, finite_refs)


def _type_is_finite(kind: str, node: Mapping[str, Any], root: Mapping[str, Any], finite_refs: set[str]) -> bool:
    if kind == "object":
        properties = node.get("properties")
        required = node.get("required")
        if not isinstance(properties, Mapping) or not isinstance(required, list):
            return True
        return all(_is_finite(properties[name], root, finite_refs) for name in required if name in properties)
    if kind == "array":
        min_items = node.get("minItems", 0)
        prefix = node.get("prefixItems")
        if isinstance(prefix, list) and not all(_is_finite(p, root, finite_refs) for p in prefix):
            return False
        items = node.get("items")
        return not (isinstance(min_items, int) and min_items > 0 and not _is_finite(items, root, finite_refs))
    return True


def _local_refs(node: object) -> set[str]:
    found: set[str] = set()
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            found.add(ref)
        for value in node.values():
            found |= _local_refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _local_refs(value)
    return found


def _resolve(root: Mapping[str, Any], ref: str) -> object | None:
    """The node a local JSON pointer (``#``, ``#/$defs/x``) names, or None."""
    node: object = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
