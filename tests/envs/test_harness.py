"""Harness variation: renamed tools, restyled schemas, memory tool, context management, oracle under
every profile."""

from __future__ import annotations

import json
import random

import pytest

from k3.chat import render_text
from k3.envs.base import Environment, Reward, TaskInfo, ToolError, run_episode
from k3.envs.harness import (PROFILES, HarnessEnv, HarnessProfile, get_profile, manage_context, name_map,
                             rename, restyle_schema, sample_profile)
from k3.envs.schema import ToolSpec
from tests.envs.test_base import Counter


class Ledger(Environment):
    """Toy world with multi-word tool names: bring the balance to `target` one entry at a time; the
    oracle decides from the latest tool result it sees (as scripted world oracles do)."""

    world = "ledger"

    def _reset(self, seed):
        self.balance, self.target = 0, 3 + seed % 5
        msgs = [{"role": "system", "content": "You keep the books of ACME Corp."},
                {"role": "user", "content": f"Bring the balance to {self.target}. Use small entries."}]
        return msgs, TaskInfo(self.world, f"ledger-{seed}", seed)

    def tool_specs(self):
        return [ToolSpec("add_entry", "Add a ledger entry. Amount must be positive.",
                         {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1,
                                                                      "description": "units to add"},
                                                           "memo": {"type": "string"}},
                          "required": ["amount"]}),
                ToolSpec("get_balance", "Read the balance.", {"type": "object", "properties": {}})]

    def call_tool(self, name, args):
        if name == "get_balance":
            return {"balance": self.balance}
        if self.balance + args["amount"] > self.target:
            raise ToolError("over target")
        self.balance += args["amount"]
        return {"ok": True, "blob": "y" * 300}

    def verify(self):
        return Reward(float(self.balance == self.target), {"balance": self.balance})

    def oracle(self):
        target = self.target

        class Oracle:
            def act(self, messages, tools):
                assert {t["function"]["name"] for t in tools} == {"add_entry", "get_balance"}
                last = messages[-1]
                if last["role"] != "tool" or last["name"] == "add_entry":
                    return _msg("get_balance", {})
                left = target - json.loads(last["content"])["balance"]
                return _msg("add_entry", {"amount": 1}) if left else {"content": "done"}
        return Oracle()


class LazyOracle:
    """env.oracle() built at the episode's first turn (after reset)."""

    def __init__(self, env):
        self.env, self.agent = env, None

    def act(self, messages, tools):
        self.agent = self.agent or self.env.oracle()
        return self.agent.act(messages, tools)


def _msg(name, args):
    return {"content": "", "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": name, "arguments": json.dumps(args)}}]}


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("world", [Ledger, Counter])
def test_oracle_scores_full_under_every_profile(profile, world):
    for seed in range(3):
        env = HarnessEnv(world(), get_profile(profile))
        ep = run_episode(env, LazyOracle(env), seed=seed, max_turns=40, view=env.view)
        assert ep.reward.success and ep.finished and env.stats.errors == 0
        # every tool the agent saw was declared under the harness's names
        names = {t["function"]["name"] for t in ep.tools}
        called = {c["function"]["name"] for m in ep.messages for c in m.get("tool_calls", [])}
        assert called <= names


def test_names_and_opening_messages():
    assert rename("add_entry", "camel", "w") == "addEntry" and rename("add_entry", "pascal", "w") == "AddEntry"
    assert rename("add_entry", "mcp", "my world") == "mcp__my_world__add_entry"
    assert name_map(["a_b", "aB"], "camel", "w") == {"a_b": "a_b", "aB": "aB"}  # would collide: kept
    assert name_map(["x" * 60], "mcp", "world") == {"x" * 60: "x" * 60}  # too long: unchanged
    env = HarnessEnv(Ledger(), get_profile("kimi-cli-like"))
    msgs, tools = env.reset(4)
    assert [t["function"]["name"] for t in tools] == ["mcp__ledger__add_entry", "mcp__ledger__get_balance",
                                                      "mcp__ledger__notes"]
    assert msgs[0]["role"] == "system" and "ACME Corp" in msgs[0]["content"] and "MCP" in msgs[0]["content"]
    assert msgs[1]["content"].startswith("Ticket ledger-4") and "Bring the balance to 7." in msgs[1]["content"]
    plain = HarnessEnv(Ledger(), get_profile("plain"))
    assert plain.reset(4) == Ledger().reset(4)


def test_calls_under_renamed_tools():
    env = HarnessEnv(Ledger(), get_profile("claude-code-like"))
    env.reset(0)
    out = env.step([_msg("AddEntry", {"amount": 1})["tool_calls"][0], _msg("add_entry", {"amount": 1})["tool_calls"][0],
                    _msg("GetBalance", {})["tool_calls"][0], _msg("AddEntry", {"amount": 99})["tool_calls"][0]])
    assert json.loads(out[0]["content"])["ok"] and out[0]["name"] == "AddEntry"
    assert "unknown tool 'add_entry'" in out[1]["content"]
    assert json.loads(out[2]["content"]) == {"balance": 1} and out[3]["content"] == "Error: over target"
    assert env.stats.calls == 4 and env.stats.invalid == 1 and env.stats.errors == 2


def test_schema_styles():
    schema = Ledger().tool_specs()[0].parameters
    terse = restyle_schema(schema, terse=True, strict=True)
    assert "description" not in terse["properties"]["amount"] and terse["additionalProperties"] is False
    assert "description" in schema["properties"]["amount"] and "additionalProperties" not in schema
    assert restyle_schema({"type": "object"}, False, True) == {"type": "object"}  # free-form stays open
    strict = HarnessEnv(Ledger(), get_profile("codex-like"))
    strict.reset(0)
    assert strict.tools()[0]["function"]["description"] == "Add a ledger entry."
    extra = _msg("add_entry", {"amount": 1, "color": "red"})["tool_calls"]
    assert "unexpected field 'color'" in strict.step(extra)[0]["content"]
    loose = HarnessEnv(Ledger(), get_profile("plain"))
    loose.reset(0)
    assert json.loads(loose.step(extra)[0]["content"])["ok"]


def test_memory_tool():
    env = HarnessEnv(Ledger(), get_profile("codex-like"))
    env.reset(0)
    calls = [_msg("update_plan", a)["tool_calls"][0] for a in
             ({"op": "append", "text": "step 1"}, {"op": "append", "text": "step 2"}, {"op": "read"},
              {"op": "append"}, {"op": "erase"}, {"op": "clear"}, {"op": "read"})]
    out = [m["content"] for m in env.step(calls)]
    assert json.loads(out[2]) == {"lines": ["step 1", "step 2"]}
    assert out[3].startswith("Error: append needs") and "not one of" in out[4]
    assert json.loads(out[6]) == {"lines": []} and env.reset(0) and env.memory == []
    # a world tool with the memory tool's name keeps its name; the scratchpad moves aside

    class NotesWorld(Ledger):
        def tool_specs(self):
            return super().tool_specs() + [ToolSpec("notes", "world notes", {"type": "object", "properties": {}})]

        def call_tool(self, name, args):
            return "world notes" if name == "notes" else super().call_tool(name, args)

    env = HarnessEnv(NotesWorld(), HarnessProfile("p", memory_tool="notes"))
    _, tools = env.reset(0)
    assert [t["function"]["name"] for t in tools][-2:] == ["notes", "harness_notes"]
    out = env.step([_msg("notes", {})["tool_calls"][0], _msg("harness_notes", {"op": "read"})["tool_calls"][0]])
    assert out[0]["content"] == "world notes" and json.loads(out[1]["content"]) == {"lines": []}


def _transcript(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"a{t}", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": f"b{t}", "type": "function", "function": {"name": "g", "arguments": "{}"}}]})
        msgs += [{"role": "tool", "tool_call_id": f"a{t}", "name": "f", "content": f"result {t} " + "z" * 200},
                 {"role": "tool", "tool_call_id": f"b{t}", "name": "g", "content": "short"}]
    return msgs + [{"role": "assistant", "content": "done"}]


def test_context_management():
    msgs = _transcript(6)
    assert manage_context(msgs, "all", 2) == msgs and manage_context(msgs, "last_k", 9) == msgs
    cut = manage_context(msgs, "last_k", 3)
    assert cut[:2] == msgs[:2] and "4 earlier turns" in cut[2]["content"] and cut[3:] == msgs[-7:]
    dig = manage_context(msgs, "digest", 3)
    assert len(dig) == len(msgs) and dig[-7:] == msgs[-7:]
    assert dig[3]["content"].startswith("[digest of an earlier result: 209 chars] result 0 zzz")
    assert dig[4]["content"] == "[digest of an earlier result: 5 chars] short"
    for view in (cut, dig):  # still a valid conversation for the chat template
        render_text(view, add_generation_prompt=True)


def test_sample_profile_varies_and_is_seeded():
    got = [sample_profile(random.Random(s)) for s in range(60)]
    assert [p.name for p in got] == [sample_profile(random.Random(s)).name for s in range(60)]
    assert {p.name.split("+")[0] for p in got} == set(PROFILES)
    assert len({(p.context, p.interaction, p.schema_style) for p in got}) >= 6
    with pytest.raises(ValueError, match="unknown harness profile"):
        get_profile("nope")
    with pytest.raises(ValueError, match="naming"):
        HarnessProfile("x", naming="kebab")
