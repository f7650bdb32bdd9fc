"""Shared fixtures for the serving tests: a random-weight k3-tiny, a small BPE tokenizer trained
here, and engine factories. Serving is latency-bound on tiny tensors, where a second intra-op
thread only adds synchronisation cost (and stalls badly on a loaded 2-core machine), so these
tests run torch with one thread."""

from __future__ import annotations

import random

import pytest
import torch

from k3.config import k3_tiny
from k3.data.tokenizer import train_bpe_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.serve.engine import Engine, EngineConfig

WORDS = ("the quick brown fox jumps over lazy dog weather Paris tool call result hello world data model serve "
         "cache token agent search file read write python error retry answer question think step plan").split()


def corpus(n_docs: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n_docs)]
    docs += ['{"city": "Paris", "days": [1, 2, 3], "ok": true}', "def add(a, b):\n    return a + b\n"]
    return docs


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread`, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    tok = train_bpe_tokenizer(corpus(), 1024)
    directory = tmp_path_factory.mktemp("serve_tok")
    tok.save(directory)
    tok.directory = str(directory)
    return tok


@pytest.fixture(scope="session")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)  # reset_kda_parameters draws from the global generator
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).eval()


@pytest.fixture
def make_engine(model, tokenizer):
    def make(**overrides) -> Engine:
        cfg = dict(memory_budget_bytes=32 << 20, page_size=8, unit_size=8, checkpoint_every_units=4,
                   checkpoint_min_gap=2, max_model_len=4096)
        cfg.update(overrides)
        return Engine(model, tokenizer, EngineConfig(**cfg))

    return make


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n random ordinary token ids (pass the tokenizer's base_size: specials come after it)."""
    return [rng.randrange(vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------ live server

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc, base_url: str, log_path) -> None:
        self.proc, self.base_url, self.log_path = proc, base_url, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, tokenizer):
    """`k3 serve --checkpoint DIR` in a subprocess on 127.0.0.1: k3-tiny with random weights saved by
    save_pretrained and the test tokenizer next to them, or the checkpoint directory (with tokenizer
    files) named by $K3_SERVE_TEST_CHECKPOINT, e.g. `final/` of `k3 train --preset k3-tiny --max-steps 20`."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    ckpt = os.environ.get("K3_SERVE_TEST_CHECKPOINT")
    if not ckpt:
        ckpt = tmp_path_factory.mktemp("k3tiny_ckpt")
        torch.manual_seed(0)
        K3ForCausalLM(k3_tiny()).init_weights(seed=0).save_pretrained(ckpt)
        tokenizer.save(ckpt)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("live_log") / "serve.log"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "k3", "serve", "--checkpoint", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "k3-tiny", "--threads", "1", "--memory-budget-mb", "96", "--page-size", "16",
           "--unit-size", "64", "--max-model-len", "4096", "--default-max-tokens", "8", "--max-waiting", "4096"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"k3 serve exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"k3 serve did not become healthy:\n{server.log()}")
        time.sleep(0.5)
    yield server
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)
