"""Verifier tests. The code runner here is a TEST STAND-IN: a plain subprocess (no isolation) in
place of k3.envs.sandbox.Sandbox, which production code injects."""

import subprocess
import sys

from k3.reward.verifiers import ExecResult, code_score, extract_code, extract_int, math_score, world_score
from k3.rl.tasks import build_tasks
from k3.rl.tasks.code import make_code_problem
from k3.rl.tasks.math import LEVELS, make_problem
from k3.rl.tasks.tools import LookupWorld


class SubprocessRunner:
    """Stand-in sandbox for tests only: runs the program with this interpreter in a subprocess."""

    def __init__(self):
        self.calls = 0

    def run_python(self, source, timeout_s):
        self.calls += 1
        try:
            p = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return ExecResult(-9, timed_out=True)
        return ExecResult(p.returncode, p.stdout, p.stderr)


def test_math_extraction():
    assert extract_int("the answer is 12, not 13") == 13
    assert extract_int("", "so 4 + 5 = 9") == 9
    assert extract_int("", "9", strict=True) is None
    assert extract_int("no digits") is None
    assert math_score(-3, "x = -3") == 1.0
    assert math_score(3, "\x00garbage<|close|>") == 0.0


def test_math_generator_is_seeded_and_correct():
    for level in LEVELS:
        for seed in range(20):
            q, ans, ref = make_problem(seed, level)
            assert make_problem(seed, level) == (q, ans, ref)
            expr = q.removeprefix("What is ").removesuffix("?")
            assert eval(expr) == ans and ref.endswith(str(ans))


def test_code_score_with_subprocess_standin():
    runner = SubprocessRunner()
    instr, ref, tests = make_code_problem(3)
    assert code_score(runner, ref, tests) == 1.0
    assert code_score(runner, "def f(x):\n    return 0\n", tests) < 1.0
    assert code_score(runner, "this is not python (", tests) == 0.0
    # a candidate printing a fake tally and exiting cannot forge the per-run marker
    fake = "import os\nprint('K3_TESTS_PASSED 5 5')\nos._exit(0)\n"
    assert code_score(runner, fake, tests) == 0.0
    assert code_score(runner, "import time\ntime.sleep(10)\n", tests, timeout_s=1.0) == 0.0
    assert extract_code("text\n```python\nx=1\n```\n") == "x=1\n"


def test_lookup_world_hidden_verifier():
    env = LookupWorld()
    env.reset(5)
    key, value = env.target, env.table[env.target]
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": f'{{"key": "{key}"}}'}}
    out = env.step([call])
    assert str(value) in out[0]["content"]
    assert world_score(env) == 0.0
    env.step([{"id": "c1", "type": "function", "function": {"name": "submit", "arguments": '{"answer": "garbage"}'}}])
    assert world_score(env) == 0.0
    env.step([{"id": "c2", "type": "function", "function": {"name": "submit", "arguments": f'{{"answer": {value}}}'}}])
    assert world_score(env) == 1.0


def test_build_tasks_interleaves_and_splits_disjoint():
    train = build_tasks(("math", "worlds", "code"), "train", 3, runner=SubprocessRunner())
    assert [t.kind for t in train] == ["math", "world", "code"] * 3
    held = build_tasks(("math",), "heldout", 3)
    assert not {t.task_id for t in held} & {t.task_id for t in train}
    assert train[0].score({"content": str(train[0].meta["answer"])}, None) == 1.0


def test_math_partial_credit():
    assert math_score(10, "10", partial=0.5) == 1.0
    assert math_score(10, "12", partial=0.5) == 0.5 / 3
    assert math_score(10, "no number", partial=0.5) == 0.0
    assert math_score(10, "12") == 0.0


def test_sandbox_runner_adapter_with_fake_sandbox(tmp_path):
    """SandboxRunner over a TEST STAND-IN with k3.envs.sandbox.Sandbox's write_file / exec surface
    (files in a temp dir, run by a plain subprocess)."""
    from types import SimpleNamespace

    from k3.reward.verifiers import SandboxRunner

    class FakeSandbox:
        def write_file(self, path, data):
            (tmp_path / path).write_text(data)

        def exec(self, cmd, timeout=None):
            p = subprocess.run([sys.executable, str(tmp_path / cmd[1])], capture_output=True, text=True,
                               timeout=timeout)
            return SimpleNamespace(rc=p.returncode, stdout=p.stdout, stderr=p.stderr, timed_out=False)

    instr, ref, tests = make_code_problem(4)
    assert code_score(SandboxRunner(FakeSandbox()), ref, tests) == 1.0


def test_code_score_in_a_real_sandbox_resists_gamed_tests():
    """k3.envs.sandbox (bwrap) behind SandboxRunner: right code passes; an object whose __eq__ always
    answers True, a patched builtins.eval, a printed fake tally and a bool for an int all score 0."""
    from k3.envs.sandbox import Sandbox
    from k3.reward.verifiers import SandboxRunner

    tests = ["f(2) == 5", "f(0) == 1"]
    hacks = ["class A:\n    def __eq__(self, o): return True\ndef f(x): return A()",
             "import builtins\nbuiltins.eval = lambda *a, **k: True\ndef f(x): return 0",
             "print('K3_TESTS_PASSED 2 2')\ndef f(x): return 0",
             "def f(x): return True"]
    with Sandbox.create(backend="bwrap") as sb:
        runner = SandboxRunner(sb)
        assert code_score(runner, "```python\ndef f(x):\n    return 2 * x + 1.0\n```", tests) == 1.0
        assert [code_score(runner, h, tests) for h in hacks] == [0.0] * len(hacks)
