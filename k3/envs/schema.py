"""Tool schemas: OpenAI-style function declarations and a JSON-Schema subset validator.

Worlds declare tools as `ToolSpec`s; `validate(value, schema)` checks a model's arguments against
the schema (the subset tool declarations use: type, properties, required, additionalProperties,
enum, items, minItems/maxItems, minimum/maximum, minLength/maxLength, anyOf/oneOf). It returns a list of readable
error strings (empty = valid) instead of raising, because a model's bad call becomes an error
observation, never an exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class ToolSpec:
    """One callable tool: name, description and the JSON schema of its arguments object."""

    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        """The OpenAI `tools` entry: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def tool_names(tools: list[dict]) -> list[str]:
    """Names of OpenAI-style tool declarations (entries without a function name are ignored)."""
    return [t.get("function", t).get("name") for t in tools if isinstance(t, dict) and t.get("function", t).get("name")]


def find_tool(tools: list[dict], name: str) -> dict | None:
    """The declaration's `function` object called `name`, or None."""
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            return fn
    return None


def validate(value: Any, schema: dict, path: str = "arguments") -> list[str]:
    """Errors of `value` against `schema` (a JSON-Schema subset); [] when it conforms."""
    if not isinstance(schema, dict) or not schema:
        return []
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branches = [validate(value, s, path) for s in schema[key]]
            ok = sum(not b for b in branches)
            if ok == 0 or (key == "oneOf" and ok > 1):
                return [f"{path}: matches {ok} of the {key} alternatives"]
    errors: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_TYPES.get(k, lambda v: True)(value) for k in kinds):
            return [f"{path}: expected {' or '.join(kinds)}, got {_type_name(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if isinstance(value, dict):
        errors += _validate_object(value, schema, path)
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        elif isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
    elif _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    return errors


def _validate_object(value: dict, schema: dict, path: str) -> list[str]:
    props = schema.get("properties", {})
    errors = [f"{path}: missing required field {k!r}" for k in schema.get("required", []) if k not in value]
    for k, v in value.items():
        if k in props:
            errors += validate(v, props[k], f"{path}.{k}")
        elif schema.get("additionalProperties") is False:
            errors.append(f"{path}: unexpected field {k!r}")
        elif isinstance(schema.get("additionalProperties"), dict):
            errors += validate(v, schema["additionalProperties"], f"{path}.{k}")
    return errors


def _type_name(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPES[name](value):
            return name
    return type(value).__name__


def parse_call(call: Any, tools: list[dict]) -> tuple[str, dict, list[str]]:
    """Check one OpenAI-style tool call against the declared tools.

    Returns (name, arguments, errors): errors is empty when the call names a declared tool and its
    arguments are a JSON object valid against that tool's schema. Never raises.
    """
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return "", {}, ["tool call has no function name"]
    name, raw = fn["name"], fn.get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            return name, {}, [f"arguments are not valid JSON ({e.msg} at position {e.pos})"]
    if not isinstance(raw, dict):
        return name, {}, [f"arguments must be a JSON object, got {_type_name(raw)}"]
    decl = find_tool(tools, name)
    if decl is None:
        return name, raw, [f"unknown tool {name!r}; available: {', '.join(tool_names(tools)) or 'none'}"]
    return name, raw, validate(raw, decl.get("parameters") or {})
