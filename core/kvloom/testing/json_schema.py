"""Check a JSON value against a JSON schema, for tests and benchmarks of structured outputs.

``schema_errors(value, schema)`` lists where ``value`` breaks ``schema`` (empty: it
validates). It covers the keywords the structured-output acceptance schemas use: ``type``
(object, array, string, integer, boolean), ``enum``, ``required``,
``additionalProperties: false``, ``properties``, ``items``, ``maxLength``, ``pattern``,
``minimum``/``maximum`` and ``minItems``/``maxItems``; a schema with any other keyword is refused, so
that a check never passes by ignoring what it was asked to check. (``jsonschema`` is not a
kvloom dependency.)
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SUPPORTED_KEYWORDS", "schema_errors"]

#: The schema keywords ``schema_errors`` checks.
SUPPORTED_KEYWORDS = frozenset({"type", "enum", "required", "additionalProperties", "properties", "items",
                                "maxLength", "pattern", "minimum", "maximum", "minItems", "maxItems"})  # fmt: skip


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (``path`` names the place, ``$`` the root); raises
    ``ValueError`` for a schema keyword outside ``SUPPORTED_KEYWORDS``."""
    unknown = set(schema) - SUPPORTED_KEYWORDS
    if unknown:
        raise ValueError(f"schema at {path}: unsupported keywords {sorted(unknown)} "
                         f"(supported: {', '.join(sorted(SUPPORTED_KEYWORDS))})")  # fmt: skip
    errors: list[str] = []
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: not an integer"]
        if not schema.get("minimum", value) <= value <= schema.get("maximum", value):
            errors.append(f"{path}: {value} out of range")
    elif kind in checks and not isinstance(value, checks[kind]):
        return [f"{path}: not a {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in enum")
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if kind == "string" and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{path}: unexpected {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{path}.{k}")
    return errors
