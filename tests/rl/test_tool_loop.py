"""The multi-turn tool loop against a world, driven by a scripted stand-in engine (it replays
rendered assistant turns as 'sampled' tokens), so the loop logic is tested without a trained model."""

import json

from k3.chat import render
from k3.rl.rollout import NO_VERSION, RolloutConfig, RolloutManager
from k3.rl.tasks.tools import lookup_task
from k3.serve.engine import RequestOutput


class ScriptedEngine:
    """Engine stand-in: request k returns the k-th scripted token list, one token per step, logprob -0.5."""

    def __init__(self, turns):
        self.turns, self.requests, self.prompts, self.n = turns, {}, [], 0

    def max_tokens_limit(self, prompt_len):
        return 10_000

    def add_request(self, ids, params):
        rid = f"r{self.n}"
        self.requests[rid] = list(self.turns[self.n])
        self.prompts.append(list(ids))
        self.n += 1
        return rid

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        outs = []
        for rid in list(self.requests):
            tok = self.requests[rid].pop(0)
            done = not self.requests[rid]
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, [tok], "", [(-0.5, None)], done, "stop" if done else None, 0, 0, 1, 0.0))
        return outs


def _assistant_tokens(tok, messages, tools, reply):
    head, _ = render(messages, tok, tools, thinking_effort="high", add_generation_prompt=True)
    full, _ = render(messages + [reply], tok, tools, thinking_effort="high")
    assert full[: len(head)] == head
    return full[len(head):]


def _call(name, args, i):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_tool_loop_reaches_hidden_verifier(tokenizer):
    task = lookup_task("train", 2)
    env = task.make_env()
    key, value = env.target, env.table[env.target]
    msgs = list(task.messages)
    turn1 = {"role": "assistant", "reasoning_content": "look", "content": "", "tool_calls": [_call("lookup", {"key": key}, 0)]}
    t1 = _assistant_tokens(tokenizer, msgs, task.tools, turn1)
    msgs += [turn1, {"role": "tool", "tool_call_id": "c0", "name": "lookup", "content": json.dumps({"value": value})}]
    turn2 = {"role": "assistant", "reasoning_content": "ok", "content": "", "tool_calls": [_call("submit", {"answer": value}, 1)]}
    t2 = _assistant_tokens(tokenizer, msgs, task.tools, turn2)
    msgs += [turn2, {"role": "tool", "tool_call_id": "c1", "name": "submit", "content": "submitted"}]
    t3 = _assistant_tokens(tokenizer, msgs, task.tools, {"role": "assistant", "reasoning_content": "", "content": f"{value}"})
    eng = ScriptedEngine([t1, t2, t3])
    mgr = RolloutManager(eng, tokenizer, RolloutConfig(group_size=1, batch_groups=1, max_turns=4))
    [group] = mgr.collect(iter([(task, "high")]))
    a = group.attempts[0]
    assert a.turns == 3 and a.finish_reason == "stop" and mgr.counters["tool_calls"] == 2
    assert a.score == 1.0                                  # the world's hidden verifier saw the submission
    assert a.generated == len(t1) + len(t2) + len(t3)
    # the tool results were appended as context (not sampled), and each turn's prompt is the whole context
    assert eng.prompts[1] == a.ids[: len(eng.prompts[1])] and len(eng.prompts[2]) > len(eng.prompts[1])
    ctx = [i for i, g in enumerate(a.gen) if not g and i >= a.prompt_len]
    assert ctx and all(a.version[i] == NO_VERSION and a.mu[i] == 0.0 for i in ctx)
    assert str(value) in tokenizer.decode([a.ids[i] for i in ctx])


def test_garbage_turn_ends_attempt_without_crash(tokenizer):
    task = lookup_task("train", 3)
    garbage = tokenizer.encode("<tool_call>{{{ not xtml", allow_special=False) + [tokenizer.eos_id]
    mgr = RolloutManager(ScriptedEngine([garbage]), tokenizer, RolloutConfig(group_size=1, batch_groups=1))
    [group] = mgr.collect(iter([(task, "low")]))
    assert group.attempts[0].finished and group.attempts[0].score == 0.0
