"""BFCL: tool conversion, the simple argument checker's rules, multi-turn state checking, ground-truth
replay = 100%, wrong agents < 100%."""

from __future__ import annotations

import copy
import json

import pytest

from k3.cli import main
from k3.envs.bfcl import (ReplayAgent, check_multi_turn, decode_calls, load_category, parse_call_string,
                          run_multi_turn, run_simple, to_tools)
from k3.envs.bfcl_ast import check_simple, replay_arguments, standardize
from k3.envs.evaluate import evaluate_bfcl


@pytest.fixture(scope="module")
def simple():
    return load_category("simple")[::10]  # 40 entries across the category


@pytest.fixture(scope="module")
def multi():
    return load_category("multi_turn_base")[::20]  # 10 entries across the category


def test_replay_scores_full(simple, multi):
    assert len(simple) == 40 and len(multi) == 10
    assert all(run_simple(e, ReplayAgent(e)).valid for e in simple)
    results = [run_multi_turn(e, ReplayAgent(e)) for e in multi]
    assert all(r.valid for r in results), [r.error for r in results if not r.valid]
    report = evaluate_bfcl("multi_turn_base", None, limit=3, replay=True, concurrency=2)
    assert report["summary"]["accuracy"] == 1.0 and report["summary"]["entries"] == 3


def test_tools_and_decoding():
    e = next(x for x in load_category("simple") if "." in x["function"][0]["name"])
    tool = to_tools(e["function"])[0]["function"]
    assert "." not in tool["name"] and tool["parameters"]["type"] == "object"
    assert tool["description"].endswith("Note that the provided function is in Python 3 syntax.")
    kinds = {json.dumps(t["function"]["parameters"]) for x in load_category("simple") for t in to_tools(x["function"])}
    assert not any(f'"type": "{k}"' in s for s in kinds for k in ("dict", "float", "tuple", "any"))
    calls, why = decode_calls({"tool_calls": [{"function": {"name": tool["name"], "arguments": '{"a": 1}'}}]},
                              e["function"])
    assert why is None and calls == [(e["function"][0]["name"], {"a": 1})]
    for bad in ('{"a":', "[1]", None):
        _, why = decode_calls({"tool_calls": [{"function": {"name": "f", "arguments": bad}}]}, e["function"])
        assert (why is None) == (bad is None)
    assert parse_call_string("sort('a.txt')") == ("sort", ["a.txt"], {})
    assert parse_call_string("f(x=[1, 2], y={'k': None})") == ("f", [], {"x": [1, 2], "y": {"k": None}})


def test_simple_checker_rules():
    fn = {"name": "area", "parameters": {"type": "dict", "properties": {
        "base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"},
        "dims": {"type": "array", "items": {"type": "integer"}}, "opts": {"type": "dict"}},
        "required": ["base"]}}
    answer = {"area": {"base": [10], "height": [5.0, ""], "unit": ["Square Meters", ""], "dims": [[1, 2], ""],
                       "opts": [{"mode": ["fast"], "n": [1, ""]}, ""]}}
    ok = lambda args: check_simple(fn, [("area", args)], answer)  # noqa: E731
    assert ok({"base": 10}) is None
    assert ok({"base": 10, "height": 5, "unit": "square_meters", "dims": [1, 2], "opts": {"mode": "FAST"}}) is None
    assert ok({"base": 10.0}).startswith("type_error") and ok({"base": True}).startswith("type_error")
    assert ok({"base": 11}).startswith("value_error") and ok({"height": 5.0}).startswith("missing_required")
    assert ok({"base": 10, "color": "red"}).startswith("unexpected_param")
    assert ok({"base": 10, "unit": "feet"}).startswith("value_error:string")
    assert ok({"base": 10, "dims": [2, 1]}).startswith("value_error:list")
    assert ok({"base": 10, "opts": {"mode": "fast", "extra": 1}}).startswith("value_error:dict")
    assert check_simple(fn, [], answer).startswith("wrong_count")
    assert check_simple(fn, [("area", {"base": 10})] * 2, answer).startswith("wrong_count")
    assert check_simple(fn, [("volume", {"base": 10})], answer).startswith("wrong_func_name")
    strict = {"area": {**answer["area"], "unit": ["m"]}}
    assert check_simple(fn, [("area", {"base": 10})], strict).startswith("missing_optional")
    assert standardize("April 1, 2024") == standardize("april 1,2024") == "april12024"
    assert replay_arguments(fn, answer) == {"base": 10, "height": 5.0, "unit": "Square Meters", "dims": [1, 2],
                                            "opts": {"mode": "fast"}}


class Perturbed:
    """The ground truth with a mistake: simple entries get the first argument changed; multi-turn
    entries skip the last call of every turn."""

    def __init__(self, entry):
        self.inner, self.entry = ReplayAgent(entry), entry

    def act(self, messages, tools):
        reply = copy.deepcopy(self.inner.act(messages, tools))
        calls = reply.get("tool_calls") or []
        if "involved_classes" in self.entry:
            reply["tool_calls"] = calls[:-1]
        elif calls:
            args = json.loads(calls[0]["function"]["arguments"])
            key = next(iter(args), None)
            if key is not None:
                args[key] = [args[key], "x"] if not isinstance(args[key], list) else args[key] + ["x"]
            else:
                args["unexpected"] = 1
            calls[0]["function"]["arguments"] = json.dumps(args)
        return reply


def test_wrong_agents_score_below_full(simple, multi):
    assert sum(run_simple(e, Perturbed(e)).valid for e in simple) == 0
    mt = [run_multi_turn(e, Perturbed(e)) for e in multi]
    assert sum(r.valid for r in mt) < len(mt) and all(r.error for r in mt if not r.valid)

    class Dead:
        def act(self, messages, tools):
            raise ConnectionError("down")

    class Garbage:
        def act(self, messages, tools):
            return {"content": "", "tool_calls": [{"function": {"name": tools[0]["function"]["name"],
                                                                "arguments": "{oops"}}]}

    assert run_simple(simple[0], Dead()).error.startswith("agent_error")
    assert run_simple(simple[0], Garbage()).error.startswith("decode_error")
    r = run_multi_turn(multi[0], Garbage())
    assert not r.valid and "empty model response" in r.error


def test_multi_turn_state_semantics(multi):
    fs = next(e for e in multi if "GorillaFileSystem" in e["involved_classes"])

    class ExtraReads(ReplayAgent):
        """Ground truth plus a harmless pwd() each turn: state and results still match."""

        def act(self, messages, tools):
            reply = super().act(messages, tools)
            if reply.get("tool_calls"):
                reply["tool_calls"].append({"id": "x", "type": "function", "function": {"name": "pwd",
                                                                                      "arguments": "{}"}})
            return reply

    assert run_multi_turn(fs, ExtraReads(fs)).valid
    turns = run_multi_turn(fs, ReplayAgent(fs)).calls
    assert check_multi_turn(fs, turns) is None
    assert check_multi_turn(fs, turns[:-1] + [[]]).endswith("empty model response")


def test_cli_replay_json(capsys):
    assert main(["eval", "bfcl", "--replay", "--category", "simple", "--limit", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["correct"] == 5 and len(report["entries"]) == 5
    assert main(["eval", "bfcl", "--replay", "--limit", "0"]) == 2
    assert main(["eval", "bfcl", "--replay", "--base-url", "http://x/v1"]) == 2
    assert main(["eval", "bfcl", "--base-url", "localhost:1", "--model", "m"]) == 2
    assert "error" in capsys.readouterr().err
