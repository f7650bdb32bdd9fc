"""The practice worlds: registry, seeds, determinism, task diversity, built-in agents' scores,
bad input, collateral-damage checks, multi-day events and the oracle SFT trajectories."""

import importlib.util
import json

import pytest

from k3.envs.agents import OracleAgent, RandomAgent, RewardHackerAgent
from k3.envs.base import Environment, run_episode
from k3.envs.worlds import WORLDS, agent_scores, make_world, oracle_trajectories, task_seeds

MINE = ("mail", "chat", "notes", "course", "assistant")


def test_registry():
    assert WORLDS == ("mail", "chat", "notes", "course", "assistant", "shell")
    for name in MINE:
        env = make_world(name)
        assert isinstance(env, Environment) and env.world == name and make_world(name) is not env
    with pytest.raises(ValueError, match="unknown world"):
        make_world("bank")
    if importlib.util.find_spec("k3.envs.worlds.shell") is None:
        with pytest.raises(ValueError, match="not installed"):
            make_world("shell")
    else:
        assert isinstance(make_world("shell"), Environment)


def test_task_seeds_disjoint():
    train, held = task_seeds("train", 500), task_seeds("heldout", 50)
    assert len(set(train)) == 500 and len(set(held)) == 50 and not set(train) & set(held)
    assert all(s % 10 == 9 for s in held) and task_seeds("train", 5, world="mail") == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        task_seeds("test", 3)
    with pytest.raises(ValueError):
        task_seeds("train", 3, world="bank")


@pytest.mark.parametrize("name", MINE)
def test_deterministic_and_diverse(name):
    env = make_world(name)
    first, tools = env.reset(7)
    snap = env.snapshot()
    assert env.reset(7) == (first, tools) and env.snapshot() == snap
    instructions, levels = set(), set()
    for seed in range(2000):
        messages, _ = env.reset(seed)
        instructions.add(messages[1]["content"])
        levels.add(env.task.difficulty)
    assert len(instructions) >= 1500 and levels <= {1, 2, 3} and len(levels) >= 2
    assert [m["role"] for m in first] == ["system", "user"] and len(first[0]["content"]) < 600


@pytest.mark.parametrize("name", MINE)
def test_builtin_agents(name):
    scores = agent_scores(name, range(60))
    assert scores["oracle"] == 1.0                      # proves every verifier is satisfiable through the tools
    assert scores["random"] < 0.1
    assert scores["hackable"] >= 50 and scores["hacker_public"] == 1.0 and scores["hacker_hidden"] == 0.0


@pytest.mark.parametrize("name", MINE)
def test_oracle_covers_every_family(name):
    env, kinds = make_world(name), {}
    for seed in range(60, 160):
        ep = run_episode(env, OracleAgent(env), seed, max_turns=40)
        assert ep.reward.success and ep.finished and env.stats.errors == 0, (seed, ep.reward.details)
        kinds[env.task.kind] = env.task.difficulty
    assert len(kinds) == len(type(env).families)


def _call(name, args):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_bad_input_is_an_error_observation_and_loses_nothing():
    env = make_world("mail")
    env.reset(3)
    snap = env.snapshot()
    out = env.step([_call("read_email", {"email_id": "m999"}), _call("archive_email", {"email_id": 5}),
                    _call("send_email", {"to": ["not an address"], "subject": "x", "body": "y"}),
                    _call("send_email", {"to": ["a@b.com"], "subject": "x", "body": "y" * 100_000}),
                    _call("send_email", {"subject": "x"}), _call("delete_email", {"email_id": "m1", "x": 1})])
    texts = [m["content"] for m in out]
    assert all(t.startswith("Error:") for t in texts)
    assert "Use search_emails" in texts[0] and "expected string" in texts[1] and "not an email address" in texts[2]
    assert "longer than" in texts[3] and "missing required field 'to'" in texts[4] and "unexpected field 'x'" in texts[5]
    assert env.snapshot() == snap and env.stats.internal == 0
    env = make_world("chat")
    env.reset(1)
    out = env.step([_call("post_message", {"channel": "nope", "text": "hi"}), _call("invite_user", {"channel": "general", "user": "zz"}),
                    _call("create_channel", {"name": "Bad Name!"})])
    assert all(m["content"].startswith("Error:") for m in out) and "list_channels" in out[0]["content"]


def test_collateral_damage_fails_the_verifier():
    env = make_world("mail")
    for seed in range(40):
        ep = run_episode(env, OracleAgent(env), seed)
        if env.task.kind == "reply":
            break
    assert ep.reward.success
    victim = next(m for m, v in env.apps["mail"].msgs.items() if v["folder"] == "inbox")
    env.step([_call("delete_email", {"email_id": victim})])
    reward = env.verify()
    assert not reward.success and reward.details["stray"] == [f"mail:{victim}"]
    assert env.public_check().startswith("PASS")        # the public check does not look at collateral damage


def test_multi_day_events_and_clock():
    env = make_world("assistant")
    for seed in range(100):
        env.reset(seed)
        if env.task.kind == "deadline_update":
            break
    names = [t["function"]["name"] for t in env.tools()]
    assert "advance_day" in names and "check_progress" in names and len(names) <= 20
    before = len(env.apps["chat"].msgs)
    out = env.step([_call("advance_day", {}), _call("advance_day", {})])
    assert json.loads(out[0]["content"])["today"] == "2026-03-13" and "last day" in out[1]["content"]
    assert len(env.apps["chat"].msgs) == before + 1 and not env.changed()   # delivered events are not the agent's doing


def test_random_and_hacker_agents_reusable():
    env = make_world("notes")
    hacker, rand = RewardHackerAgent(env), RandomAgent(0)
    for seed in range(5):
        assert not run_episode(env, hacker, seed).reward.success
        ep = run_episode(env, rand, seed)
        assert ep.finished and ep.turns <= 7


def test_oracle_trajectories_format():
    seeds = task_seeds("train", 6)
    for name in MINE:
        data = oracle_trajectories(name, seeds)
        assert len(data) == len(seeds)
        for item in data:
            msgs, meta = item["messages"], item["meta"]
            assert meta["world"] == name and meta["reward"] == 1.0 and meta["seed"] in seeds and 1 <= meta["difficulty"] <= 3
            assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user" and msgs[-1]["role"] == "assistant"
            assert "tool_calls" not in msgs[-1] and msgs[-1]["content"]
            calls = [m for m in msgs if m.get("tool_calls")]
            assert calls and all(isinstance(json.loads(c["tool_calls"][0]["function"]["arguments"]), dict) for c in calls)
            assert any(c.get("reasoning_content") for c in calls)
            ids = {c["tool_calls"][0]["id"] for c in calls}
            assert {m["tool_call_id"] for m in msgs if m["role"] == "tool"} == ids
            assert len(json.dumps(msgs)) < 4 * 2000                      # ~2k tokens at most
            assert {t["function"]["name"] for t in item["tools"]} >= {"check_progress"}


def test_array_limits():
    env = make_world("mail")
    env.reset(0)
    out = env.step([_call("send_email", {"to": [f"a{i}@b.com" for i in range(50)], "subject": "x", "body": "y"})])
    assert "more than 20 items" in out[0]["content"] and not env.changed()


def test_doing_nothing_scores_zero():
    class Idle:
        def act(self, messages, tools):
            return {"role": "assistant", "content": "Done."}

    for name in MINE:
        env = make_world(name)
        for seed in range(12):
            ep = run_episode(env, Idle(), seed)
            assert ep.reward.score == 0.0 and not env.public_check().startswith("PASS"), (name, seed)
