"""Shell world: seeded tasks in a sandbox, oracle 100%, reward hacker 0 on the hidden checks,
bad commands become observations."""

from __future__ import annotations

import json

import pytest

from tests.envs.shell_standin import install_if_missing

install_if_missing()  # only while this checkout has no k3.envs.sandbox

from k3.envs.base import run_episode  # noqa: E402
from k3.envs.worlds.shell import ShellWorld, task_for  # noqa: E402
from k3.envs.worlds.shell_tasks import FAMILIES  # noqa: E402

KINDS = [f.__name__ for f in FAMILIES]


def _seeds_per_kind(per_kind: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {k: [] for k in KINDS}
    seed = 0
    while any(len(v) < per_kind for v in out.values()):
        kind = task_for(seed).kind
        if len(out[kind]) < per_kind:
            out[kind].append(seed)
        seed += 1
    return out


SEEDS = _seeds_per_kind(2)


class Lazy:
    """Builds env.oracle() / env.hacker() at the episode's first turn (after reset)."""

    def __init__(self, make):
        self.make, self.agent = make, None

    def act(self, messages, tools):
        self.agent = self.agent or self.make()
        return self.agent.act(messages, tools)


@pytest.fixture(scope="module")
def world():
    env = ShellWorld()
    yield env
    env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_solves_and_hacker_fails(world, kind):
    for seed in SEEDS[kind]:
        world.reset(seed)
        assert world.public_check().startswith("NOT DONE") and world.verify().score == 0.0
        ep = run_episode(world, Lazy(world.oracle), seed, max_turns=10)
        assert ep.reward.score == 1.0, (seed, ep.reward.details, ep.stats.log)
        assert world.public_check().startswith("PASS") and ep.stats.errors == 0
        ep = run_episode(world, Lazy(world.hacker), seed, max_turns=10)
        assert world.public_check().startswith("PASS"), (seed, world.public_check())
        assert ep.reward.score == 0.0, (seed, ep.reward.details)


def test_tasks_are_seeded_and_varied():
    a, b = task_for(7), task_for(7)
    assert a.instruction == b.instruction and a.files == b.files
    distinct = {(t.instruction, json.dumps(t.files, sort_keys=True)) for t in map(task_for, range(300))}
    assert len(distinct) >= 290
    assert {task_for(s).difficulty for s in range(60)} == {1, 2, 3}


def _call(name, args):
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_bad_commands_are_observations(world):
    world.reset(SEEDS["log_report"][0])
    out = world.step([_call("read_file", {"path": "/etc/passwd"}), _call("read_file", {"path": "../x"}),
                      _call("read_file", {"path": "missing.txt"}),
                      _call("run_command", {"command": "sleep 30", "timeout_s": 1}),
                      _call("run_command", {"command": "yes | head -c 100000"}),
                      _call("run_command", {"command": "exit 3"}),
                      _call("write_file", {"path": "a/b/c.txt", "content": "hi"}),
                      _call("read_file", {"path": "./a/b/c.txt"}), _call("run_command", {})])
    text = [m["content"] for m in out]
    assert "must be relative" in text[0] and "must be relative" in text[1] and text[2].startswith("Error: cannot read")
    slow = json.loads(text[3])
    assert slow["exit_code"] != 0 and "timed out" in slow["note"]
    assert "more characters" in json.loads(text[4])["stdout"] and json.loads(text[5])["exit_code"] == 3
    assert json.loads(text[6])["ok"] and text[7] == "hi" and "missing required field 'command'" in text[8]
    assert world.stats.internal == 0


class CountingWorld(ShellWorld):
    """Counts the sandbox's pause / resume calls of each episode."""

    def _reset(self, seed):
        out = super()._reset(seed)
        self.counts = {"pause": 0, "resume": 0}
        for name in self.counts:
            setattr(self.box, name, self._counted(name, getattr(self.box, name)))
        return out

    def _counted(self, name, fn):
        def call():
            self.counts[name] += 1
            fn()
        return call


def test_paused_between_steps_and_closed():
    env = CountingWorld()
    ep = run_episode(env, Lazy(env.oracle), SEEDS["rename_pattern"][0], max_turns=10)
    assert ep.reward.score == 1.0 and env.counts == {"pause": ep.turns, "resume": ep.turns}
    env.close()
    assert env.box is None
    env.close()  # idempotent
