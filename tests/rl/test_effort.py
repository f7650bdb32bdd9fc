import pytest

from k3.chat import render_text
from k3.rl.effort import BudgetTracker, EffortConfig, effort_reward, max_tokens_for, parse_efforts


def test_penalty_shape():
    cfg = EffortConfig(multiples={"low": 1, "high": 2, "max": 4}, alpha=0.5).validate()
    b = 10
    assert effort_reward(1.0, 10, b, "low", cfg) == 1.0
    assert effort_reward(1.0, 15, b, "low", cfg) == pytest.approx(1 - 0.5 * 0.5)
    assert effort_reward(1.0, 20, b, "low", cfg) == pytest.approx(0.5)
    assert effort_reward(1.0, 99, b, "low", cfg) == pytest.approx(0.5)   # saturated at alpha
    assert effort_reward(1.0, 40, b, "max", cfg) == 1.0
    assert effort_reward(1.0, 30, b, "high", cfg) == pytest.approx(1 - 0.5 * 0.5)
    # wrong answers are never rewarded for brevity; partial scores get the same length factor
    assert effort_reward(0.0, 1, b, "low", cfg) == 0.0
    assert effort_reward(0.0, 500, b, "low", cfg) == 0.0
    assert effort_reward(0.4, 10, b, "low", cfg) == pytest.approx(0.4)
    assert effort_reward(0.4, 15, b, "low", cfg) == pytest.approx(0.4 * 0.75)
    assert effort_reward(0.4, 500, b, "low", cfg) == pytest.approx(0.4 * 0.5)
    off = EffortConfig(scale_partial=False).validate()
    assert effort_reward(0.4, 500, b, "low", off) == 0.4
    assert effort_reward(1.0, 20, b, "low", off) == pytest.approx(0.5)


def test_caps_ordered_and_validation():
    cfg = EffortConfig().validate()
    caps = [max_tokens_for(10, e, cfg) for e in ("low", "high", "max")]
    assert caps == [20, 40, 80]
    with pytest.raises(ValueError):
        EffortConfig(multiples={"low": 2, "high": 1}).validate()
    with pytest.raises(ValueError):
        EffortConfig(multiples={"medium": 2}).validate()
    with pytest.raises(ValueError):
        parse_efforts("low,huge")
    assert parse_efforts("low, max") == ("low", "max")


def test_budget_tracker_uses_max_effort_correct_samples():
    t = BudgetTracker(min_samples=3)
    for n in (10, 20, 30):
        t.observe("a", "low", True, 1)      # low effort never shrinks the budget
        t.observe("a", "max", False, 1)     # wrong attempts do not count
        t.observe("a", "max", True, 500, capped=True)  # nor attempts cut at the sampling cap
        t.observe("a", "max", True, n)
    assert t.budget("a", 99) == 20
    assert t.budget("b", 7) == 7
    t2 = BudgetTracker(min_samples=3)
    t2.load_state_dict(t.state_dict())
    assert t2.budget("a", 99) == 20


def test_effort_is_rendered_as_thinking_effort_message():
    text = render_text([{"role": "user", "content": "hi"}], thinking_effort="low", add_generation_prompt=True)
    assert "thinking_effort=low" in text


def test_rollout_prompt_is_the_inference_render_per_effort(tokenizer):
    """The RL prompt is exactly what the serving endpoint renders for that reasoning effort (the same
    k3.chat.render call: thinking on, the effort's system message, the generation prompt)."""
    from k3.chat import render
    from k3.rl.rollout import RolloutConfig, RolloutManager
    from k3.rl.tasks.math import math_task
    from tests.rl.test_tool_loop import ScriptedEngine

    task = math_task("train", 0, 1)
    prompts = {}
    for effort in ("low", "high", "max"):
        eng = ScriptedEngine([[tokenizer.eos_id]])
        RolloutManager(eng, tokenizer, RolloutConfig(group_size=1, batch_groups=1)).collect(iter([(task, effort)]))
        served, _ = render(task.messages, tokenizer, None, thinking=True, thinking_effort=effort,
                           add_generation_prompt=True)
        assert eng.prompts[0] == served
        assert f"thinking_effort={effort}" in tokenizer.decode(served)
        prompts[effort] = served
    assert len({tuple(p) for p in prompts.values()}) == 3
    caps = [max_tokens_for(10, e, EffortConfig()) for e in ("low", "high", "max")]
    assert caps[0] < caps[1] < caps[2]


def test_effort_eval_reports_lengths_and_cap_shares(tokenizer, tmp_path):
    from k3.rl.effort_eval import effort_lengths
    from tests.rl.conftest import tiny_model

    tiny_model(tokenizer, seed=3).save_pretrained(tmp_path, dtype="float32")
    tokenizer.save(tmp_path)
    r = effort_lengths(str(tmp_path), tasks=2, group=1, cap_factor=1.0)
    for e in ("low", "high", "max"):
        assert 0.0 <= r[f"capped_{e}"] <= 1.0 and r[f"think_{e}"] >= 0
    assert r["attempts"] == 6
    # the lookup world through the command line: one effort, the table row names the kind
    from k3.rl.effort_eval import main

    assert main([str(tmp_path), "--kind", "worlds", "--efforts", "low", "--tasks", "2", "--group", "1",
                 "--cap-factor", "1"]) == 0
