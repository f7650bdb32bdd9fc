"""The behavioural evaluation: scores are right for known replies and the model's garbage never raises."""

from k3.model.causal_lm import K3ForCausalLM
from k3.sft import eval as sft_eval
from k3.sft import instruct, sources


class Replay:
    """Answers every teacher-forced point with the oracle's own turn, every item with its response."""

    def __init__(self, trajs, items):
        self.trajs, self.items = trajs, {it["prompt"]: it for it in items}

    def act_batch(self, requests, return_exceptions=False):
        out = []
        for msgs, tools in requests:
            if tools is None:
                out.append({"role": "assistant", "content": self.items[msgs[0]["content"]]["response"]})
                continue
            full = next(c["messages"] for c in self.trajs if c["messages"][:len(msgs)] == msgs)
            out.append(full[len(msgs)])
        return out


def test_scores_of_a_perfect_and_a_wrong_agent(worlds):
    held = sources.default_heldout(["keys"], 3, tool_turns=12, instruct_n=12, episodes_per_world=3)
    assert len(held.trajectories) == 6 and held.registry.task_seeds("heldout", 3, "keys") == [1, 5, 9]  # difficulty 1 first
    perfect = Replay(held.trajectories, held.instruct_items)
    tc = sft_eval.eval_tool_calls(perfect, held.trajectories, 6)
    assert tc == {"n": 6, "valid": 1.0, "right_tool": 1.0}
    assert sft_eval.eval_instructions(perfect, held.instruct_items)["pass"] == 1.0

    class Wrong:
        def act_batch(self, requests, return_exceptions=False):
            return [{"role": "assistant", "content": "no", "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "submit", "arguments": '{"value": "NaN"}'}}]}
                for _ in requests]

    tc = sft_eval.eval_tool_calls(Wrong(), held.trajectories, 12)  # 6 lookups (depth 0), then 6 submits
    assert tc == {"n": 12, "valid": 0.0, "right_tool": 0.5}  # a declared tool, but its schema is violated


def test_engine_agent_on_an_untrained_model_never_raises(worlds, base_dir, tokenizer):
    model = K3ForCausalLM.from_pretrained(base_dir, dtype="float32")
    agent = sft_eval.make_agent(model, tokenizer, max_new_tokens=4, memory_budget_bytes=64 << 20)
    held = sources.default_heldout(["keys"], 3, tool_turns=1, instruct_n=1, episodes_per_world=1)
    try:
        rec = sft_eval.evaluate_behaviour(agent, held, max_turns=2)
    finally:
        agent.close()
    assert rec["tool_calls"]["n"] == 1 and rec["instruct"]["n"] == 1 and rec["episodes"]["n"] == 1
    assert rec["episodes"]["errors"] == 0 and rec["episodes"]["success"] == 0.0
    assert "tool-call valid" in sft_eval.summary(rec)
    assert not instruct.check(held.instruct_items[0], None)
