"""The lookup world's shaped credit: milestones short of a correct submission, exact at P = 0."""

import pytest

from k3.rl.tasks import build_tasks
from k3.rl.tasks.tools import LookupWorld, lookup_task


def _call(name, args):
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": args}}


def _world(partial):
    env = LookupWorld(partial)
    env.reset(7)
    return env


def test_milestones_earn_thirds_of_partial():
    env = _world(0.6)
    assert env.verify().score == 0.0                                   # nothing done
    env.step([_call("search_emails", {"query": "x"})])                 # parseable call, undeclared tool
    assert env.verify().score == pytest.approx(0.2)
    other = next(k for k in env.table if k != env.target)
    env.step([_call("lookup", {"key": other})])                        # a valid declared call
    assert env.verify().score == pytest.approx(0.4)
    env.step([_call("lookup", {"key": env.target})])                   # the target looked up
    assert env.verify().score == pytest.approx(0.6)
    env.step([_call("submit", {"answer": env.table[env.target] + 1})])  # wrong answer: still 3 milestones
    assert env.verify().score == pytest.approx(0.6)
    env.step([_call("submit", {"answer": env.table[env.target]})])
    assert env.verify().score == 1.0                                   # correct: full reward


def test_plain_verifier_and_reset():
    env = _world(0.0)
    env.step([_call("lookup", {"key": env.target})])
    assert env.verify().score == 0.0
    env = _world(0.9)
    env.step([_call("lookup", {"key": env.target})])
    env.reset(8)                                                       # a new episode forgets milestones
    assert env.verify().score == 0.0
    with pytest.raises(ValueError):
        LookupWorld(1.0)


def test_tool_partial_reaches_the_tasks():
    [t] = build_tasks(("worlds",), "heldout", 1, tool_partial=0.3)
    assert t.make_env().partial == 0.3 and lookup_task("heldout", 0).make_env().partial == 0.0
