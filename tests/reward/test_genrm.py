import subprocess
import sys

import pytest

from k3.reward.genrm import GenRM, GenRMConfig, ToolBox, length_penalty, parse_rubric


def subprocess_executor(source: str, timeout_s: float) -> tuple[int, str]:
    """TEST STAND-IN, NOT A SANDBOX: runs the code in a plain subprocess (trusted test snippets only)."""
    p = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout_s)
    return p.returncode, p.stdout + p.stderr


class Script:
    """A backend replying from a list (cycling on the last), recording the prompts."""

    def __init__(self, *replies):
        self.replies, self.prompts = list(replies), []

    def __call__(self, messages):
        self.prompts.append(messages)
        r = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(r, Exception):
            raise r
        return r(messages) if callable(r) else r


RUBRIC = "- correct result (weight 3)\n- clear (weight 1)"


def test_rubric_parsing_and_fallback():
    assert parse_rubric(RUBRIC) == [("correct result", 3.0), ("clear", 1.0)]
    assert parse_rubric("no rubric here") == [] and parse_rubric(None) == []
    rm = GenRM(Script("garbage", "Candidate 1: 7\nCandidate 2: 3"), GenRMConfig(beta=0))
    rm.score("t", ["a", "b"])
    assert rm.stats["rubric_fallbacks"] == 1 and "correct and complete" in rm.backend.prompts[1][0]["content"]
    assert rm.last["rubric"] == [("the answer is correct and complete", 1.0)]


def test_listwise_both_orders_cancel_position():
    """A judge preferring the first shown candidate: listwise runs a random order and its reverse, so
    both candidates get the same mean score and the disagreement is counted."""
    def first_high(messages):
        return "Candidate 1: 9\nCandidate 2: 1" if "Rubric:" in messages[0]["content"] else RUBRIC
    rm = GenRM(Script(first_high), GenRMConfig(beta=0))
    s = rm.score("t", ["x", "y"])
    assert s[0] == s[1] == pytest.approx(0.5) and rm.stats["order_disagreements"] == 1


def test_pairwise_win_rates_and_disagreement_tie():
    def by_content(messages):  # scores candidates by their text: 'good' 9, 'ok' 5, 'bad' 1
        text = messages[0]["content"]
        if "Rubric:" not in text:
            return RUBRIC
        body = text.split("Rubric:", 1)[1]
        out = []
        for k in (1, 2):
            c = body.split(f"Candidate {k}:\n", 1)[1].split("\n\n", 1)[0]
            out.append(f"Candidate {k}: {dict(good=9, ok=5, bad=1)[c]}")
        return "\n".join(out)
    rm = GenRM(Script(by_content), GenRMConfig(mode="pairwise", beta=0))
    assert rm.score("t", ["bad", "good", "ok"]) == pytest.approx([0.0, 1.0, 0.5])
    assert rm.stats["comparisons"] == 3 and rm.stats["order_disagreements"] == 0


def test_verbosity_penalty_relative_to_shortest_adequate():
    assert length_penalty([1.0, 1.0, 0.2], [10, 30, 5], [True, True, False], 0.1) == pytest.approx([1.0, 0.8, 0.2])
    assert length_penalty([0.3, 0.2], [10, 50], [False, False], 0.1) == [0.3, 0.2]
    rm = GenRM(Script(RUBRIC, "Candidate 1: 10\nCandidate 2: 10"), GenRMConfig(beta=0.1))
    assert rm.score("t", ["short", "x" * 15]) == pytest.approx([1.0, 0.8])


@pytest.mark.parametrize("mode", ["listwise", "pairwise"])
@pytest.mark.parametrize("reply", ["", "Candidate one: great", "Candidate 1: 99\nCandidate 7: 3", None, 42,
                                   RuntimeError("endpoint down"), "Candidate 1: NaN", "\x00" * 50])
def test_malformed_judge_output_never_crashes(mode, reply):
    rm = GenRM(Script(reply), GenRMConfig(mode=mode, fallback=0.25))
    assert rm.score("t", ["a", "bb", "ccc"]) == [0.25, 0.25, 0.25]
    assert rm.stats["fallback_rewards"] == 3 and rm.stats["malformed"] > 0
    assert rm.score("t", []) == []


def test_partially_malformed_reply_scores_what_it_can():
    """Only position 1 is scored: over the random order and its reverse, the middle candidate of three
    never sits there and keeps the fallback; the other two are scored."""
    rm = GenRM(Script(RUBRIC, "Candidate 1: 8\nCandidate 2: ???"), GenRMConfig(beta=0, fallback=0.0))
    s = rm.score("t", ["a", "b", "c"])
    assert sorted(s) == [0.0, pytest.approx(0.8), pytest.approx(0.8)] and rm.stats["fallback_rewards"] == 1


def test_tool_checks_run_code_and_view_state():
    """The judge asks to run candidate code (subprocess stand-in for the sandbox) and to view a world
    state, then scores from the results it was shown."""
    def judge(messages):
        text = messages[0]["content"]
        if "Rubric:" not in text:
            return RUBRIC
        if len(messages) == 1:
            return "TOOL run_code 1\nTOOL run_code 2\nTOOL view_state 1\nTOOL view_state 9"
        results = messages[-1]["content"]
        first_ok = results.split("[run_code 2]")[0].count("exit status 0") == 1
        return f"Candidate 1: {9 if first_ok else 2}\nCandidate 2: {2 if first_ok else 9}"
    good, bad = "```python\nprint(2 + 2)\n```", "```python\nraise SystemExit(3)\n```"
    rm = GenRM(Script(judge), GenRMConfig(beta=0, mode="pairwise"), ToolBox(run_code=subprocess_executor))
    s = rm.score("print 4", [good, bad], states=[lambda: "state A", lambda: (_ for _ in ()).throw(OSError("gone"))])
    assert s == [1.0, 0.0] and rm.stats["tool_calls"] > 0
    # results reached the judge: exit statuses, a state view, an error for a failing view, a bad index
    seen = [m[-1]["content"] for m in rm.backend.prompts if len(m) > 1]
    assert any("exit status 3" in t and "state A" in t for t in seen)
    assert any("error: OSError: gone" in t for t in seen) and any("no candidate 9" in t for t in seen)
    rm2 = GenRM(Script(judge), GenRMConfig(beta=0))  # no executor: run_code answers 'unavailable'
    rm2.score("t", [good, bad], states=[lambda: "s1", lambda: "s2"])
    assert rm2.stats["fallback_rewards"] == 0
    assert any("[run_code 1] unavailable" in m[-1]["content"] for m in rm2.backend.prompts if len(m) > 1)
    rm3 = GenRM(Script(judge), GenRMConfig(beta=0))  # no tools offered: a reply of requests only is malformed
    assert rm3.score("t", [good, bad]) == [0.0, 0.0] and rm3.stats["fallback_rewards"] == 2


def test_config_validation():
    with pytest.raises(ValueError):
        GenRMConfig(mode="tournament").validate()
    with pytest.raises(ValueError):
        GenRM(Script(""), GenRMConfig(fallback=2.0))
    with pytest.raises(ValueError, match="state views"):
        GenRM(Script("")).score("t", ["a"], states=[])
