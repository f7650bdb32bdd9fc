"""Effort-conditioned default data: reasoning length follows the conversation's thinking effort, the calls
and answers are unchanged, the effort message is rendered, and the thinking-length metric orders efforts."""

import json
from dataclasses import dataclass

import pytest

from k3.chat import render
from k3.sft import effort, instruct, sources
from k3.sft import eval as sft_eval

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "What is stored under k3?  Submit it."},
    {"role": "assistant", "reasoning_content": "Look it up first.", "content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k3"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k4"}'}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "7"},
    {"role": "assistant", "reasoning_content": "Both found.", "content": "42 and 7."},
]


def _reasonings(messages):
    return [m.get("reasoning_content") or "" for m in messages if m["role"] == "assistant"]


def test_trajectory_reasoning_grows_with_effort_and_keeps_the_calls():
    low, high, mx = (effort.expand_trajectory(MESSAGES, e) for e in ("low", "high", "max"))
    assert low == MESSAGES
    strip = lambda ms: [{k: v for k, v in m.items() if k != "reasoning_content"} for m in ms]  # noqa: E731
    assert strip(high) == strip(MESSAGES) == strip(mx)  # calls, results and answers untouched
    for a, b, c in zip(_reasonings(low), _reasonings(high), _reasonings(mx)):
        assert len(a) < len(b) < len(c)
    first_high, second_high, final_high = _reasonings(high)
    assert first_high == "The task: What is stored under k3? Submit it.\nLook it up first.\nNext: call lookup with key."
    assert second_high == "Next: call lookup with key."
    assert final_high == "Both found.\nNext: answer the user without a tool call."
    first_max, second_max, final_max = _reasonings(mx)
    assert 'Next: call lookup with key="k3".' in first_max and "Check: lookup is a declared tool" in first_max
    assert second_max.startswith("Progress: 1 tool call so far; the last result came from lookup.")
    assert 'key="k4"' in second_max
    assert "Check: 2 tool calls made" in final_max
    with pytest.raises(ValueError, match="effort"):
        effort.expand_trajectory(MESSAGES, "medium")


def test_instruction_reasoning_grows_with_effort():
    item = instruct.instruct_items("train", 1)[0]
    convs = [instruct.item_conversation(item, e) for e in effort.EFFORT_LEVELS]
    texts = [c["messages"][1]["reasoning_content"] for c in convs]
    assert texts[0] == item["reasoning"] and len(texts[0]) < len(texts[1]) < len(texts[2])
    assert item["check"] in texts[2]
    assert [c["thinking_effort"] for c in convs] == list(effort.EFFORT_LEVELS)
    assert all(c["messages"][1]["content"] == item["response"] for c in convs)
    assert instruct.item_conversation(item)["thinking_effort"] is None


def test_default_mix_cycles_efforts_and_renders_the_effort_message(worlds, tokenizer):
    convs = sources.default_train_conversations(["keys"], 3, 3, 3)
    assert [c["thinking_effort"] for c in convs] == ["low", "high", "max"] * 2
    for c in convs:
        ids, _ = render(c["messages"], tokenizer, c["tools"], thinking_effort=c["thinking_effort"])
        assert f"thinking_effort={c['thinking_effort']}" in tokenizer.decode(ids)
    mix = ["low", "high", "low", "max", "low"]  # the default's: an effort listed twice gets twice the share
    assert [c["thinking_effort"] for c in sources.default_train_conversations(["keys"], 5, 3, 5, efforts=mix)] \
        == mix * 2
    plain = sources.default_train_conversations(["keys"], 3, 3, 3, efforts=[])
    assert all(c["thinking_effort"] is None for c in plain)
    val = sources.validation_conversations(["keys"], 3, 4)
    assert [c["thinking_effort"] for c in val] == ["low", "high", "low", "high"]


@dataclass
class Config:
    thinking_effort: str = "low"
    max_new_tokens: int = 8


class EffortEcho:
    """Replies with one reasoning word per effort level (low 1, high 2, max 3) and remembers max_new_tokens."""

    def __init__(self):
        self.config, self.seen = Config(), []

    def act_batch(self, requests, return_exceptions=False):
        self.seen.append(self.config.max_new_tokens)
        words = {"low": 1, "high": 2, "max": 3}[self.config.thinking_effort]
        return [{"role": "assistant", "reasoning_content": " ".join(["w"] * words), "content": ""} for _ in requests]


def test_thinking_length_metric(worlds):
    held = sources.default_heldout(["keys"], 3, tool_turns=4, instruct_n=2, episodes_per_world=0,
                                   effort_prompts=5, efforts=effort.EFFORT_LEVELS, effort_max_new_tokens=99)
    assert len(held.effort_prompts) == 5 and len(held.instruct_items) == 2
    assert held.effort_prompts[0][1] and held.effort_prompts[1][1] is None  # a tool point, then an item
    agent = EffortEcho()
    count = lambda text: len(text.split())  # noqa: E731
    rec = sft_eval.eval_thinking_length(agent, held.effort_prompts, held.efforts, count, 99)
    assert rec == {"n": 5, "mean_think_tokens": {"low": 1.0, "high": 2.0, "max": 3.0}, "ordered": True}
    assert agent.config == Config() and agent.seen == [99, 99, 99]  # restored after the metric
    rec = sft_eval.eval_thinking_length(agent, held.effort_prompts, ("max", "low"), count, 99)
    assert rec["ordered"] is False
    assert "think tokens low 1 < high 2 < max 3" in sft_eval.summary({"thinking": {
        "n": 5, "mean_think_tokens": {"low": 1.0, "high": 2.0, "max": 3.0}, "ordered": True}})
    json.dumps(rec)


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_lean_declarations_keep_the_used_tools_and_some_distractors():
    tools = [_tool(n) for n in ("a", "lookup", "b", "c", "d")]
    conv = {"messages": MESSAGES, "tools": tools, "meta": {"seed": 7}}
    lean = sources.lean_tools(conv, 2)
    names = [t["function"]["name"] for t in lean["tools"]]
    assert "lookup" in names and len(names) == 3 and names == [n for n in "a lookup b c d".split() if n in names]
    assert lean["messages"] is MESSAGES and conv["tools"] == tools  # the conversation itself is untouched
    assert lean == sources.lean_tools(conv, 2)  # deterministic from the seed
    assert [t["function"]["name"] for t in sources.lean_tools(conv, 0)["tools"]] == ["lookup"]
    assert len(sources.lean_tools(conv, 9)["tools"]) == 5


def test_lean_fraction_spreads_evenly(worlds):
    stripped = sources.default_train_conversations(["keys"], 4, 3, 0, lean_fraction=1.0, lean_distractors=0)
    assert all({t["function"]["name"] for t in c["tools"]} == {"lookup", "submit"} for c in stripped)
    assert [sources.evenly(k, 0.5) for k in range(6)] == [False, True] * 3
    assert sum(sources.evenly(k, 0.25) for k in range(8)) == 2 and not any(sources.evenly(k, 0.0) for k in range(8))
    assert all(sources.evenly(k, 1.0) for k in range(8))
