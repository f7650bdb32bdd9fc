from k3.reward.judge import Judge, JudgeConfig, engine_backend
from k3.serve.engine import Engine, EngineConfig


def test_judge_on_an_in_process_k3_checkpoint(model, tokenizer):
    """A random-weight k3 judge writes garbage: every candidate gets the fallback, nothing raises."""
    eng = Engine(model, tokenizer, EngineConfig(memory_budget_bytes=16 << 20, page_size=8, unit_size=8))
    judge = Judge(engine_backend(eng, tokenizer, max_tokens=6), JudgeConfig(fallback=0.5))
    scores = judge.score("What is 2 + 2?", ["4", "five", "22"])
    assert scores == [0.5, 0.5, 0.5] and judge.stats["calls"] == 2 and judge.stats["malformed"] == 3
