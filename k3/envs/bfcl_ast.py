"""BFCL's argument matching for single-call categories (`simple`), written after BFCL's rules.

A model's answer to a `simple` entry is one call {name: arguments}. BFCL's possible answers give,
per parameter, the accepted values (`""` among them = the parameter may be omitted). The rules
followed here (bfcl_eval's `ast_checker.simple_function_checker`):

* exactly one call, to the declared function; every required parameter present; no parameter that
  is neither declared nor in the possible answer; every possible-answer parameter without `""`
  present;
* types as declared (string, integer, float, boolean, array/tuple, dict, any = string); an integer
  is accepted for a float; a value of the possible answers' own type is accepted when that differs
  from the declared type (BFCL's "variable" case); arrays check their items one level deep;
* strings compare after standardisation (lower case; spaces and `,./-_*^` removed; `'` -> `"`),
  also inside lists and dicts; dicts match one of the accepted dicts key by key; lists of dicts
  match element-wise; everything else must be one of the accepted values.
"""

from __future__ import annotations

import re
from typing import Any

TYPES: dict[str, type] = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                          "tuple": list, "dict": dict, "any": str}
NESTED = ("array", "tuple")


def standardize(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _answer_type(options: list) -> type | None:
    for v in options:
        if v != "":
            return type(v)
    return None


def _type_ok(value: Any, options: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(type acceptable, value is a "variable" of the possible answers' type)."""
    ans_type = _answer_type(options)
    variable = ans_type is not None and ans_type is not expected
    if type(value) is expected:
        if nested is None:
            return True, variable
        for opt in options:
            if not isinstance(opt, list) or all(_type_ok(v, opt, nested, None)[0] for v in value):
                return True, variable
        return False, variable
    if ans_type is not None and type(value) is ans_type:
        return True, True
    return False, variable


def _std_list(values: list) -> list:
    return [standardize(v) if isinstance(v, str) else v for v in values]


def _dict_ok(value: dict, options: list) -> bool:
    for opt in options:
        if opt == "" or not isinstance(opt, dict):
            continue
        keys_ok = all(k in opt and (standardize(v) if isinstance(v, str) else v) in _std_list(opt[k])
                      for k, v in value.items())
        missing = any(k not in value and "" not in v for k, v in opt.items())
        if keys_ok and not missing:
            return True
    return False


def _list_dict_ok(value: list, options: list) -> bool:
    for opt in options:
        if isinstance(opt, list) and len(opt) == len(value) and all(
                isinstance(v, dict) and _dict_ok(v, [o]) for v, o in zip(value, opt)):
            return True
    return False


def check_param(name: str, value: Any, options: list, decl: dict) -> str | None:
    """None when `value` is acceptable for parameter `name`, else the reason."""
    kind = decl.get("type", "string")
    expected = TYPES.get(kind, str)
    nested = TYPES.get((decl.get("items") or {}).get("type", "string"), str) if kind in NESTED else None
    if kind == "tuple" and isinstance(value, tuple):
        value = list(value)
    if kind == "float" and type(value) is int:
        value = float(value)
    ok, variable = _type_ok(value, options, expected, nested)
    if not ok:
        return f"type_error: {name!r} expected {kind}, got {type(value).__name__} ({value!r})"
    if not variable:
        if expected is dict:
            return None if _dict_ok(value, options) else f"value_error:dict {name!r}: {value!r}"
        if expected is list and nested is dict:
            return None if _list_dict_ok(value, options) else f"value_error:list_dict {name!r}: {value!r}"
        if expected is str:
            std = [standardize(o) for o in options if isinstance(o, str)]
            return None if standardize(value) in std else f"value_error:string {name!r}: {value!r} not in {options!r}"
        if expected is list:
            std = [_std_list(o) for o in options if isinstance(o, list)]
            return None if _std_list(value) in std else f"value_error:list {name!r}: {value!r} not in {options!r}"
    return None if value in options else f"value_error {name!r}: {value!r} not in {options!r}"


def check_simple(function: dict, calls: list[tuple[str, Any]], answer: dict) -> str | None:
    """None when `calls` (decoded [(bfcl function name, arguments)]) answers the entry, else why not.
    function: the BFCL declaration; answer: the possible answer {function name: {param: [options]}}."""
    if len(calls) != 1:
        return f"wrong_count: {len(calls)} calls, expected 1"
    name, args = calls[0]
    if name != function["name"]:
        return f"wrong_func_name: {name!r}, expected {function['name']!r}"
    if not isinstance(args, dict):
        return f"bad_arguments: {args!r}"
    params = function.get("parameters", {})
    props, possible = params.get("properties", {}), answer[function["name"]]
    for p in params.get("required", []):
        if p not in args:
            return f"missing_required: {p!r}"
    for p, v in args.items():
        if p not in props or p not in possible:
            return f"unexpected_param: {p!r}"
        why = check_param(p, v, possible[p], props[p])
        if why:
            return why
    for p, options in possible.items():
        if p not in args and "" not in options:
            return f"missing_optional: {p!r} not provided and not optional"
    return None


def replay_value(options: list, decl: dict) -> tuple[bool, Any]:
    """(include?, value): the first accepted value of a parameter (omitted when only `""` is)."""
    kind = decl.get("type", "string")
    for opt in options:
        if opt == "":
            continue
        if kind == "dict" and isinstance(opt, dict):
            return True, replay_dict(opt)
        if kind in NESTED and (decl.get("items") or {}).get("type") == "dict" and isinstance(opt, list):
            return True, [replay_dict(d) if isinstance(d, dict) else d for d in opt]
        return True, opt
    return False, None


def replay_dict(opt: dict) -> dict:
    """A dict built from accepted per-key options (keys that may be omitted are omitted)."""
    out = {}
    for k, vals in opt.items():
        vals = vals if isinstance(vals, list) else [vals]
        firsts = [v for v in vals if v != ""]
        if firsts and "" not in vals:
            out[k] = firsts[0]
    return out


def replay_arguments(function: dict, answer: dict) -> dict:
    """The ground-truth call's arguments (first accepted value of every parameter)."""
    props = function.get("parameters", {}).get("properties", {})
    out = {}
    for p, options in answer[function["name"]].items():
        include, value = replay_value(options, props.get(p, {}))
        if include:
            out[p] = value
    return out
