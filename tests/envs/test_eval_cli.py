"""`k3 eval worlds`: built-in agents, harness profiles, user errors, a live tiny `k3 serve` endpoint
and an in-process checkpoint — on a toy world registry (the real registry is exercised by the
worlds tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
import urllib.request

import pytest
import torch

from k3.cli import main
from k3.envs import evaluate
from tests.envs.test_base import Counter
from tests.envs.test_harness import Ledger
from tests.envs.tiny_lm import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Broken(Counter):
    world = "broken"

    def verify(self):
        raise RuntimeError("verifier bug")


def _registry(worlds=("counter", "ledger")):
    classes = {"counter": Counter, "ledger": Ledger, "broken": Broken}
    return types.SimpleNamespace(
        WORLDS=worlds,
        make_world=lambda name: classes[name](),
        task_seeds=lambda split, n, world=None: [s for s in range(100) if (s % 10 == 9) == (split == "heldout")][:n])


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(evaluate, "default_registry", lambda: _registry())


def test_oracle_prints_full_success(toy, capsys):
    assert main(["eval", "worlds", "--agent", "oracle", "--tasks", "3"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert set(rows) == {"counter", "ledger", "all"}
    assert all(r[1] == "3" or r[0] == "all" for r in rows.values()) and rows["all"][1] == "6"
    assert all(r[2] == "100.0%" and r[3] == "1.000" for r in rows.values())


def test_json_report_and_harness(toy, capsys, tmp_path):
    assert main(["eval", "worlds", "--agent", "oracle", "--tasks", "4", "--harness", "random", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all"]["success_rate"] == 1.0 and len(report["episodes"]) == 8
    assert {e["seed"] for e in report["episodes"]} == {9, 19, 29, 39}
    assert len({e["harness"] for e in report["episodes"]}) > 1
    path = tmp_path / "r.json"
    trans = tmp_path / "t.jsonl"
    assert main(["eval", "worlds", "--agent", "oracle", "--tasks", "1", "--worlds", "ledger", "--harness",
                 "kimi-cli-like", "--json", str(path), "--transcripts", str(trans)]) == 0
    assert "ledger" in capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert saved["worlds"]["ledger"]["success_rate"] == 1.0 and saved["episodes"][0]["harness"] == "kimi-cli-like"
    msgs = json.loads(trans.read_text().splitlines()[0])["messages"]
    assert msgs[1]["content"].startswith("Ticket ledger-9")


def test_user_errors(toy, capsys):
    for argv in (["--agent", "oracle", "--worlds", "mail,nope"], ["--agent", "oracle", "--harness", "nope"],
                 ["--base-url", "http://127.0.0.1:9/v1", "--model", "m"], ["--base-url", "ftp://x", "--model", "m"],
                 ["--agent", "oracle", "--base-url", "http://127.0.0.1:9/v1"], ["--agent", "oracle", "--tasks", "0"],
                 ["--base-url", "http://127.0.0.1:9/v1"], []):
        assert main(["eval", "worlds", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("k3 eval") and "\n" not in err, (argv, err)
    assert main(["eval", "worlds", "--checkpoint", "/nonexistent/ckpt", "--tasks", "1"]) == 2


def test_builtin_agents_on_the_practice_worlds(capsys):
    assert main(["eval", "worlds", "--agent", "oracle", "--tasks", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["worlds"]) == {"mail", "chat", "notes", "course", "assistant", "shell"}
    assert all(s["success_rate"] == 1.0 and s["episodes"] == 2 for s in report["worlds"].values())
    assert main(["eval", "worlds", "--agent", "random", "--tasks", "5", "--harness", "random", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(s["success_rate"] < 0.1 and s["env_errors"] == 0 for s in report["worlds"].values())


def test_failures_are_recorded_not_raised():
    reg = _registry(("counter", "broken"))

    class Raises:
        def act(self, messages, tools):
            raise TimeoutError("slow endpoint")

    report = evaluate.evaluate_worlds(evaluate.shared(Raises()), evaluate.WorldsEvalConfig(tasks=2), reg)
    assert report["worlds"]["counter"]["agent_errors"] == 2 and report["worlds"]["counter"]["success_rate"] == 0
    assert report["worlds"]["broken"]["env_errors"] == 2
    assert "verifier bug" in report["episodes"][-1]["env_error"]


# ------------------------------------------------------------------------------------ real models


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("k3tiny_eval"))


@pytest.fixture(scope="module")
def live_server(checkpoint, tmp_path_factory):
    """`k3 serve` on the tiny checkpoint in a subprocess."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("serve_log") / "serve.log"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "k3", "serve", "--checkpoint", checkpoint, "--port", str(port),
           "--served-model-name", "k3-tiny", "--threads", "1", "--memory-budget-mb", "64", "--page-size", "16",
           "--unit-size", "64", "--max-model-len", "4096", "--default-max-tokens", "8"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_live_endpoint(toy, live_server, capsys):
    assert main(["eval", "worlds", "--base-url", live_server, "--model", "k3-tiny", "--tasks", "2", "--max-turns",
                 "2", "--max-tokens", "8", "--concurrency", "4", "--harness", "random", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all"]["episodes"] == 4 and report["all"]["agent_errors"] == 0 and report["all"]["env_errors"] == 0
    assert all(1 <= e["turns"] <= 2 for e in report["episodes"])
    assert main(["eval", "bfcl", "--base-url", live_server, "--model", "k3-tiny", "--limit", "2", "--max-tokens",
                 "8", "--json"]) == 0
    bfcl = json.loads(capsys.readouterr().out)
    assert bfcl["summary"]["entries"] == 2
    assert not any(e["error"].startswith("agent_error") for e in bfcl["entries"] if e["error"])
    assert main(["eval", "worlds", "--base-url", live_server, "--model", "other", "--tasks", "1",
                 "--worlds", "counter", "--json"]) == 0
    assert "not found" in json.loads(capsys.readouterr().out)["episodes"][0]["agent_error"]


def test_in_process_checkpoint(toy, checkpoint, capsys):
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["eval", "worlds", "--checkpoint", checkpoint, "--tasks", "2", "--max-turns", "2",
                     "--max-tokens", "8", "--memory-budget-mb", "32", "--json"]) == 0
    finally:
        torch.set_num_threads(prev)
    report = json.loads(capsys.readouterr().out)
    assert report["all"]["episodes"] == 4 and report["all"]["agent_errors"] == 0 and report["all"]["env_errors"] == 0
