"""A user's mistake on the command line is one line and exit code 2, not a traceback."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["generate", "--checkpoint", "{missing}", "--prompt", "hi"],
                                  ["info", "--checkpoint", "{missing}"]])
def test_missing_checkpoint(tmp_path, argv):
    argv = [a.format(missing=tmp_path / "nope") for a in argv]
    r = subprocess.run([sys.executable, "-m", "k3", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"k3 {argv[0]}: error: no config.json at" in r.stderr
    assert "Traceback" not in r.stderr


def test_debug_env_keeps_the_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3", "info", "--checkpoint", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "K3_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr
