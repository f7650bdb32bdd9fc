"""Verifiers: exact-answer math, Python unit tests run in an injected sandbox, and worlds' hidden
verifiers. Every verifier maps model output (already parsed into reasoning / content) to a score
in [0, 1] and never raises on model-produced garbage.

Answer extraction for math: the last integer of the response channel; when the model never left
its thinking channel (no response), the last integer of the thinking text (`strict=False`, the
default: small models learn the channel layout late, and the effort budget still charges every
token). `strict=True` scores only the response channel.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

_INT = re.compile(r"-?\d+")
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_int(content: str, reasoning: str = "", *, strict: bool = False) -> int | None:
    """The last integer in `content`, else (unless strict) in `reasoning`; None when there is none."""
    for text in (content,) if strict else (content, reasoning):
        found = _INT.findall(text or "")
        if found:
            try:
                return int(found[-1])
            except ValueError:
                return None
    return None


def math_score(answer: int, content: str, reasoning: str = "", *, strict: bool = False,
               partial: float = 0.0) -> float:
    """1.0 when the extracted integer equals `answer`; otherwise `partial`·1/(1 + |got − answer|) when
    an integer was given (a shaped reward for models too weak to hit exact answers: closer is better,
    always below an exact answer), else 0.0. partial = 0 is the plain exact-match verifier."""
    got = extract_int(content, reasoning, strict=strict)
    if got is None:
        return 0.0
    if got == answer:
        return 1.0
    return partial / (1.0 + abs(got - answer))


@dataclass
class ExecResult:
    """What running a program produced. timed_out: killed at the time limit."""

    returncode: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


class CodeRunner(Protocol):
    """Runs an untrusted Python program in isolation (k3.envs.sandbox.Sandbox in production; tests
    inject a subprocess stand-in)."""

    def run_python(self, source: str, timeout_s: float) -> ExecResult: ...


class SandboxRunner:
    """CodeRunner over a k3.envs.sandbox.Sandbox (duck-typed: `write_file(path, text)` and
    `exec(cmd, timeout=...) -> result with rc, stdout, stderr, timed_out`): each program is written
    to its own file in the sandbox's workspace and run with the sandbox's `python3`."""

    def __init__(self, sandbox: Any, python: str = "python3") -> None:
        self.sandbox, self.python, self.count = sandbox, python, 0

    def run_python(self, source: str, timeout_s: float) -> ExecResult:
        self.count += 1
        path = f"k3_candidate_{self.count}.py"
        self.sandbox.write_file(path, source)
        r = self.sandbox.exec([self.python, path], timeout=timeout_s)
        return ExecResult(int(r.rc), r.stdout or "", r.stderr or "", bool(r.timed_out))


def extract_code(content: str) -> str:
    """The last ```python block of the answer, else the whole answer."""
    blocks = _CODE_BLOCK.findall(content or "")
    return blocks[-1] if blocks else (content or "")


_HARNESS = """
import ast as _ast
_eval, _type, _isinstance, _print, _len, _all = eval, type, isinstance, print, len, all
_PLAIN = (int, float, str, bool, type(None), bytes)
def _plain(v):
    if _type(v) in _PLAIN:
        return True
    if _type(v) in (list, tuple):
        return _all(_plain(x) for x in v)
    if _type(v) is dict:
        return _all(_plain(k) and _plain(x) for k, x in v.items())
    return False
def _check(t, ns):
    node = _ast.parse(t, mode="eval").body
    if _isinstance(node, _ast.Compare) and _len(node.ops) == 1 and _isinstance(node.ops[0], _ast.Eq):
        a = _eval(compile(_ast.Expression(node.left), "test", "eval"), ns)
        b = _eval(compile(_ast.Expression(node.comparators[0]), "test", "eval"), ns)
        same = _type(a) is _type(b) or (_type(a) in (int, float) and _type(b) in (int, float))
        return _plain(a) and _plain(b) and same and a == b
    return _eval(t, ns) is True
_ns = {{"__name__": "candidate"}}
try:
    exec(compile({code!r}, "candidate", "exec"), _ns)
except BaseException:
    pass
_passed = 0
_tests = {tests!r}
for _t in _tests:
    try:
        if _check(_t, _ns):
            _passed += 1
    except BaseException:
        pass
_print({marker!r}, _passed, _len(_tests))
"""


def unit_test_program(code: str, tests: list[str], marker: str = "K3_TESTS_PASSED") -> str:
    """A program that runs the candidate's code in its own namespace, then evaluates each test
    expression (e.g. 'f(2) == 5') with builtins captured before the candidate ran, and prints
    `marker passed total`. An `a == b` test passes only when both sides are plain values (numbers,
    strings, None, and lists / tuples / dicts of them) of the same type (int and float compare as numbers): a returned object whose
    `__eq__` always answers True does not pass. A candidate that fails to import passes nothing.
    code_score uses a fresh random marker per run, so a candidate cannot print a fake tally."""
    return _HARNESS.format(code=code, tests=list(tests), marker=marker)


def code_score(runner: CodeRunner, content: str, tests: list[str], timeout_s: float = 5.0) -> float:
    """Fraction of unit tests the answer's code passes, run by `runner`; 0.0 on timeouts, crashes
    or output the harness did not write."""
    if not tests:
        raise ValueError("code_score needs at least one test")
    marker = "K3_TESTS_" + secrets.token_hex(8)
    try:
        res = runner.run_python(unit_test_program(extract_code(content), tests, marker), timeout_s)
    except Exception:  # a sandbox failure scores 0 for this candidate; the caller's counters see it
        return 0.0
    if res.timed_out:
        return 0.0
    m = re.findall(re.escape(marker) + r" (\d+) (\d+)", res.stdout or "")
    if not m:
        return 0.0
    passed, total = (int(x) for x in m[-1])
    return passed / total if total == len(tests) else 0.0


def world_score(env: Any) -> float:
    """A world's hidden verifier (k3.envs Environment.verify) as a score; a failing verifier is 0."""
    try:
        return float(env.verify().score)
    except Exception:
        return 0.0


__all__ = ["CodeRunner", "ExecResult", "SandboxRunner", "code_score", "extract_code", "extract_int", "math_score",
           "unit_test_program", "world_score"]
