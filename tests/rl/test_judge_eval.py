import pytest

from k3.reward.genrm import GenRM, GenRMConfig
from k3.rl.judge_eval import (evaluate_judge, first_position_backend, longest_backend, math_items,
                                  oracle_backend, truth_table, world_items)


@pytest.fixture(scope="module")
def items():
    return math_items(6) + world_items("mail", [9, 19])


def test_items_have_hidden_truth(items):
    maths = [it for it in items if len(it.candidates) == 4]
    assert all(it.truth == [1.0, 0.0, 1.0, 0.0] for it in maths)
    worlds = [it for it in items if it.states]
    assert worlds and all(max(it.truth) == 1.0 for it in worlds)  # the oracle solves every task
    assert all(min(it.truth) < 1.0 for it in worlds)               # the random agent does not
    assert all(isinstance(s(), str) for it in worlds for s in it.states)


@pytest.mark.parametrize("mode", ["listwise", "pairwise"])
def test_oracle_judge_agrees_with_the_verifier(items, mode):
    m = evaluate_judge(GenRM(oracle_backend(truth_table(items)), GenRMConfig(mode=mode)), items)
    assert m["accuracy"] == 1.0 and m["tie_rate"] == 0.0
    assert m["position_bias_rate"] == 0.0 and m["length_bias_rate"] == 0.0
    assert m["decided_pairs"] > 0 and m["tied_pairs"] > 0 and m["fallback_rewards"] == 0


def test_biased_judges_are_measured(items):
    pos = evaluate_judge(GenRM(first_position_backend(), GenRMConfig(beta=0)), items)
    assert pos["position_bias_rate"] == 1.0
    assert pos["accuracy"] == 0.0 and pos["tie_rate"] == 1.0  # both orders averaged: every pair a tie
    long = evaluate_judge(GenRM(longest_backend(), GenRMConfig(beta=0)), items)
    assert long["length_bias_rate"] == 1.0 and long["position_bias_rate"] == 0.0


def test_garbage_judge_gives_fallbacks_not_errors(items):
    m = evaluate_judge(GenRM(lambda msgs: "I refuse.", GenRMConfig(fallback=0.0)), items[:2])
    assert m["fallback_rewards"] > 0 and m["accuracy"] == 0.0
