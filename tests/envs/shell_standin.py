"""A stand-in for `k3.envs.sandbox` (no isolation: a temp directory and host subprocesses), used by
the shell-world tests only while this checkout has no real sandbox module."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    mem_mb: int = 512
    pids: int = 64
    cpu_s: int = 60
    wall_s: float = 30.0


@dataclass(frozen=True)
class ExecResult:
    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool


class Sandbox:
    live = 0

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="k3shell")
        self.paused = 0
        Sandbox.live += 1

    @classmethod
    def create(cls, backend="auto", workspace=None, limits=None):
        return cls()

    def exec(self, cmd, timeout=30):
        try:
            p = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=self.dir, capture_output=True, text=True,
                               timeout=timeout)
            return ExecResult(p.returncode, p.stdout, p.stderr, False, False)
        except subprocess.TimeoutExpired:
            return ExecResult(124, "", "", True, False)

    def read_file(self, path):
        with open(os.path.join(self.dir, path)) as f:
            return f.read()

    def write_file(self, path, content):
        full = os.path.join(self.dir, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(content)

    def pause(self):
        self.paused += 1

    def resume(self):
        pass

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        Sandbox.live -= 1


def install_if_missing() -> bool:
    """Register this module as k3.envs.sandbox unless the real one exists; True if installed."""
    if "k3.envs.sandbox" in sys.modules or importlib.util.find_spec("k3.envs.sandbox") is not None:
        return False
    mod = types.ModuleType("k3.envs.sandbox")
    mod.Sandbox, mod.Limits, mod.ExecResult = Sandbox, Limits, ExecResult
    sys.modules["k3.envs.sandbox"] = mod
    return True
