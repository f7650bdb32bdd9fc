import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from k3.reward.judge import Judge, JudgeConfig, openai_backend, parse_scores, verbosity_penalty


class ScriptedJudge:
    """Backend stand-in: rubric requests get a rubric; scoring requests score each shown candidate by
    a function of its text (so the tests can check that the shuffled order is undone)."""

    def __init__(self, fn, garbage=False):
        self.fn, self.garbage, self.prompts = fn, garbage, []

    def __call__(self, messages):
        text = messages[-1]["content"]
        self.prompts.append(text)
        if text.startswith("Write a grading rubric"):
            return "- correct (weight 1)"
        if self.garbage:
            return "I think they are all great!!"
        shown = text.split("\n\nCandidate ")[1:]
        return "\n".join(f"Candidate {k + 1}: {self.fn(c.split(':', 1)[1].strip())}" for k, c in enumerate(shown))


def test_scores_follow_candidates_through_the_shuffle():
    cands = ["answer 7", "answer 3", "answer 9", "answer 1"]
    judge = Judge(ScriptedJudge(lambda c: int(c.split()[-1])), JudgeConfig(beta=0.0, seed=5))
    assert judge.score("task", cands) == [0.7, 0.3, 0.9, 0.1]
    assert judge.stats["malformed"] == 0


def test_malformed_output_falls_back_and_counts():
    judge = Judge(ScriptedJudge(None, garbage=True), JudgeConfig(fallback=0.25))
    assert judge.score("task", ["a", "b", "c"]) == [0.25, 0.25, 0.25]
    assert judge.stats["malformed"] == 3

    def dead(messages):
        raise ConnectionError("down")

    judge = Judge(dead, JudgeConfig(fallback=0.0))
    assert judge.score("task", ["a"]) == [0.0] and judge.stats["errors"] == 2


def test_pairs_in_both_orders_position_bias_is_a_tie():
    biased = Judge(lambda m: "- ok" if "rubric" in m[-1]["content"][:30] else "Candidate 1: 9\nCandidate 2: 1",
                   JudgeConfig(beta=0.0))
    assert biased.score("task", ["x", "y"]) == [0.5, 0.5]
    assert biased.stats["order_disagreements"] == 1
    fair = Judge(ScriptedJudge(lambda c: 8 if c == "good" else 2), JudgeConfig(beta=0.0))
    assert fair.score("task", ["bad", "good"]) == [0.2, 0.8]


def test_parse_and_verbosity_penalty():
    assert parse_scores("Candidate 2: 7/10\ncandidate #1 = **4**\nCandidate 3: 11\nCandidate 1: 9", 3) == [4.0, 7.0, None]
    # shortest adequate answer has length 10: a 30-long one loses beta * (30/10 - 1)
    assert verbosity_penalty([1.0, 1.0, 0.2], [10, 30, 5], 0.1, 0.5) == [1.0, 0.8, 0.2]
    assert verbosity_penalty([0.1], [100], 0.1, 0.5) == [0.1]


def test_openai_backend_against_local_stub():
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"choices": [{"message": {"content": "Candidate 1: 6"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        judge = Judge(openai_backend(f"http://127.0.0.1:{srv.server_port}/v1", "judge-model"), JudgeConfig(rubric=False))
        assert judge.score("task", ["only one"]) == [0.6]
        assert seen["body"]["model"] == "judge-model" and seen["body"]["temperature"] == 0
    finally:
        srv.shutdown()
