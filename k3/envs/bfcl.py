"""BFCL (Berkeley Function-Calling Leaderboard) as an outside test of renderer, parser and tool loop.

Data and the stateful mock APIs come from the `bfcl-eval` package (`pip install --no-deps
bfcl-eval`; its data files and `func_source_code/*.py` need only the standard library); the
checkers are k3's own, written after BFCL's rules:

* `simple` (BFCL_v4_simple_python): one question, one declared function; the model's single call
  is matched argument by argument against the possible answers (`k3.envs.bfcl_ast`).
* `multi_turn_base`: several user turns against stateful APIs (file system, messaging, trading,
  travel, ...) built from the entry's `initial_config`. Within a turn the model may call tools for
  up to 20 steps; the turn ends with a reply without calls. Checking re-executes the model's
  decoded calls on fresh API instances and the ground-truth calls on others, and after every turn
  with ground truth requires (a) equal public instance state and (b) every ground-truth execution
  result among the model's results so far (as a multiset), as BFCL does.

Function declarations are converted to OpenAI tools (BFCL types: dict -> object, float -> number
with a note, tuple -> array, any -> string; '.' in names -> '_', mapped back when decoding).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3.envs.bfcl_ast import check_simple, replay_arguments

CATEGORIES = {"simple": "BFCL_v4_simple_python.json", "multi_turn_base": "BFCL_v4_multi_turn_base.json"}
TYPE_MAP = {"integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
            "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object",
            "tuple": "array", "any": "string"}
CLASS_FILES = {"GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
               "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
               "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control"}
STATELESS = ("MathAPI",)
MAX_STEPS = 20          # model queries per turn before the entry is failed (BFCL's limit)
PYTHON_NOTE = " Note that the provided function is in Python 3 syntax."
BLOCKED = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")


class BFCLError(RuntimeError):
    """bfcl-eval is missing or its data is not where expected."""


def data_dir() -> Path:
    try:
        import bfcl_eval
    except ImportError:
        raise BFCLError("the bfcl-eval package is not installed: pip install --no-deps bfcl-eval") from None
    return Path(bfcl_eval.__file__).parent / "data"


def _jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_category(category: str, limit: int | None = None) -> list[dict]:
    """Entries of a category with their ground truth (`answer`) and declared functions (`function`)."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; available: {', '.join(CATEGORIES)}")
    root = data_dir()
    entries = _jsonl(root / CATEGORIES[category])
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(root / "possible_answer" / CATEGORIES[category])}
    out = []
    for e in entries[:limit] if limit else entries:
        e = dict(e, answer=answers[e["id"]])
        if category == "multi_turn_base":
            e["function"] = [fn for c in e["involved_classes"] for fn in _class_doc(root, c)]
        else:
            e["function"] = [dict(fn, description=fn.get("description", "") + PYTHON_NOTE) for fn in e["function"]]
        out.append(e)
    return out


def _class_doc(root: Path, cls: str) -> list[dict]:
    return _jsonl(root / "multi_turn_func_doc" / f"{CLASS_FILES[cls]}.json")


# ------------------------------------------------------------------------------------------- tools


def _schema(s: Any) -> Any:
    if not isinstance(s, dict):
        return s
    out = {k: v for k, v in s.items() if k not in ("properties", "items", "type")}
    kind = s.get("type", "string")
    out["type"] = TYPE_MAP.get(kind, "string")
    if kind == "float":
        out["description"] = out.get("description", "") + " This is a float type value."
    if isinstance(s.get("properties"), dict):
        out["properties"] = {k: _schema(v) for k, v in s["properties"].items()}
    if isinstance(s.get("items"), dict):
        out["items"] = _schema(s["items"])
    return out


def openai_name(name: str) -> str:
    return name.replace(".", "_")


def to_tools(functions: list[dict]) -> list[dict]:
    """BFCL function declarations -> OpenAI `tools` (the `response` field is dropped)."""
    tools = []
    for fn in functions:
        params = _schema(fn.get("parameters") or {"type": "dict", "properties": {}})
        params["type"] = "object"
        tools.append({"type": "function", "function": {"name": openai_name(fn["name"]),
                                                       "description": fn.get("description", ""),
                                                       "parameters": params}})
    return tools


def decode_calls(message: dict, functions: list[dict]) -> tuple[list[tuple[str, Any]], str | None]:
    """The assistant message's calls as [(BFCL name, arguments dict)], or ([], reason) when a call
    cannot be decoded (no name, arguments that are not a JSON object)."""
    back = {openai_name(fn["name"]): fn["name"] for fn in functions}
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return [], "tool call without a function name"
        args = fn.get("arguments")
        if args is None:
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return [], f"arguments of {fn['name']!r} are not valid JSON"
        if not isinstance(args, dict):
            return [], f"arguments of {fn['name']!r} are not a JSON object"
        out.append((back.get(fn["name"], fn["name"]), args))
    return out, None


# ------------------------------------------------------------------------------------------- state


class APIs:
    """Fresh instances of an entry's stateful API classes, loaded from its initial_config."""

    def __init__(self, entry: dict) -> None:
        pkg = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for cls_name in entry["involved_classes"]:
            cls = getattr(importlib.import_module(f"{pkg}.{CLASS_FILES[cls_name]}"), cls_name)
            inst = cls()
            if cls_name not in STATELESS:
                # _load_scenario is how bfcl-eval's own runner loads a scenario into its API classes
                inst._load_scenario(copy.deepcopy(entry["initial_config"].get(cls_name, {})), long_context=False)
            self.instances[cls_name] = inst
            for name, method in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method  # a later class wins a shared name, as in BFCL

    def execute(self, name: str, args: list, kwargs: dict) -> str:
        """Run one call -> its result as text (errors as text, never raised). The arguments are
        copied: APIs keep argument lists in their state, and the same call is run again by the checker."""
        args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
        try:
            if name in BLOCKED:
                raise ValueError(f"Function call {name} is not allowed.")
            if name not in self.methods:
                raise NameError(f"name '{name}' is not defined")
            result = self.methods[name](*args, **kwargs)
        except Exception as e:  # the model's call failing is an observation, as in BFCL
            return f"Error during execution: {e}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except (TypeError, ValueError):
                return str(result)
        return str(result)

    def state(self) -> dict[str, dict]:
        return {c: {k: v for k, v in vars(i).items() if not k.startswith("_")} for c, i in self.instances.items()}


def parse_call_string(text: str) -> tuple[str, list, dict]:
    """A ground-truth call like "cd(folder='document')" -> (name, positional args, keyword args)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    return node.func.id, args, {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def check_multi_turn(entry: dict, model_turns: list[list[list[tuple[str, dict]]]]) -> str | None:
    """None when the model's decoded calls (per turn, per step) reach the ground truth's state and
    results after every turn, else the first mismatch."""
    model, truth = APIs(entry), APIs(entry)
    model_results: list[str] = []
    for t, gt_calls in enumerate(entry["answer"]):
        steps = model_turns[t] if t < len(model_turns) else []
        for step in steps:
            model_results += [model.execute(name, [], args) for name, args in step]
        gt_results = [truth.execute(*parse_call_string(c)) for c in gt_calls]
        if not gt_calls:
            continue
        if not any(steps):
            return f"turn {t}: empty model response"
        ms, gs = model.state(), truth.state()
        for cls in gs:
            diff = sorted(k for k in gs[cls] if ms[cls].get(k) != gs[cls][k])
            if diff:
                return f"turn {t}: state of {cls} differs in {diff}"
        pool = list(model_results)
        for r in gt_results:
            if r not in pool:
                return f"turn {t}: ground-truth result missing from the model's results: {r[:200]!r}"
            pool.remove(r)
    return None


# ------------------------------------------------------------------------------------------- running


@dataclass
class EntryResult:
    id: str
    valid: bool
    error: str | None = None
    calls: list = field(default_factory=list)    # decoded calls: simple [(name, args)], multi-turn per turn/step
    steps: int = 0


def run_simple(entry: dict, agent: Any) -> EntryResult:
    messages = [dict(m) for m in entry["question"][0]]
    try:
        reply = agent.act(messages, to_tools(entry["function"]))
    except Exception as e:  # a dead endpoint fails the entry, not the run
        return EntryResult(entry["id"], False, f"agent_error: {type(e).__name__}: {e}")
    calls, why = decode_calls(reply, entry["function"])
    if why:
        return EntryResult(entry["id"], False, f"decode_error: {why}")
    err = check_simple(entry["function"][0], calls, entry["answer"][0])
    return EntryResult(entry["id"], err is None, err, calls, 1)


def run_multi_turn(entry: dict, agent: Any) -> EntryResult:
    tools, live = to_tools(entry["function"]), APIs(entry)
    messages: list[dict] = []
    turns: list[list[list[tuple[str, dict]]]] = []
    steps = 0
    for turn_messages in entry["question"]:
        messages += [dict(m) for m in turn_messages]
        turn: list[list[tuple[str, dict]]] = []
        for step in range(MAX_STEPS + 1):
            if step == MAX_STEPS:
                return EntryResult(entry["id"], False, f"force_quit: more than {MAX_STEPS} steps in a turn", turns, steps)
            try:
                reply = agent.act(list(messages), tools)
            except Exception as e:
                return EntryResult(entry["id"], False, f"agent_error: {type(e).__name__}: {e}", turns, steps)
            steps += 1
            reply = {"role": "assistant", **{k: v for k, v in dict(reply).items() if k != "role"}}
            messages.append(reply)
            calls, why = decode_calls(reply, entry["function"])
            if why or not calls:
                break
            turn.append(calls)
            for c, (name, args) in zip(reply["tool_calls"], calls):
                messages.append({"role": "tool", "tool_call_id": c.get("id") or f"call_{len(messages)}",
                                 "name": c["function"]["name"], "content": live.execute(name, [], args)})
        turns.append(turn)
    err = check_multi_turn(entry, turns)
    return EntryResult(entry["id"], err is None, err, turns, steps)


RUNNERS = {"simple": run_simple, "multi_turn_base": run_multi_turn}


class ReplayAgent:
    """Plays an entry's ground truth: for `simple` the first accepted value of every parameter;
    for multi-turn each turn's ground-truth calls in one message, then a short answer."""

    def __init__(self, entry: dict) -> None:
        self.entry, self.turn = entry, 0
        self.simple = "involved_classes" not in entry

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if self.simple:
            fn = self.entry["function"][0]
            return _message([(fn["name"], replay_arguments(fn, self.entry["answer"][0]))])
        if messages[-1].get("role") != "user":
            return {"role": "assistant", "content": "Done."}
        gt = self.entry["answer"][self.turn]
        self.turn += 1
        calls = []
        for text in gt:
            name, args, kwargs = parse_call_string(text)
            calls.append((name, {**_positional(self.entry, name, args), **kwargs}))
        return _message(calls) if calls else {"role": "assistant", "content": "I cannot do that with these tools."}


def _positional(entry: dict, name: str, args: list) -> dict:
    """Positional ground-truth arguments named by the API method's signature."""
    if not args:
        return {}
    return dict(inspect.signature(APIs(entry).methods[name]).bind_partial(*args).arguments)


def _message(calls: list[tuple[str, dict]]) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": openai_name(n), "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}


def summarize(category: str, results: list[EntryResult]) -> dict:
    """Accuracy and error classes of a run."""
    kinds: dict[str, int] = {}
    for r in results:
        if not r.valid:
            key = re.split(r"[: ]", r.error or "unknown", maxsplit=1)[0]
            kinds[key] = kinds.get(key, 0) + 1
    n = len(results)
    return {"category": category, "entries": n, "correct": sum(r.valid for r in results),
            "accuracy": sum(r.valid for r in results) / n if n else 0.0, "errors": kinds}
