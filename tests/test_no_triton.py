"""k3 without Triton (an optional dependency): importing k3, the CLI, serving and training, building
k3-tiny and a training forward/backward on the CPU must work when `import triton` fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"{name} is blocked for this test")
        return None


sys.meta_path.insert(0, NoTriton())
sys.modules.pop("triton", None)

import torch

import k3
import k3.cli
import k3.serve.engine
import k3.train.trainer
from k3.config import k3_tiny
from k3.model.causal_lm import K3ForCausalLM

torch.manual_seed(0)
model = K3ForCausalLM(k3_tiny())
model.init_weights()
ids = torch.randint(0, 200, (2, 12))
out = model(ids, labels=ids)
out.loss.backward()
assert torch.isfinite(out.loss), out.loss
assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
assert not loaded, loaded
print("forward without triton: loss", float(out.loss))
'''


def test_model_runs_on_cpu_without_triton() -> None:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "forward without triton" in r.stdout
