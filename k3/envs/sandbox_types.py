"""Shared types and the process runner of the agent sandboxes (``k3.envs.sandbox``).

Kept apart from ``sandbox.py`` so that the backends (``sandbox_bwrap``, ``sandbox_runsc``) can use
them without importing the facade that imports the backends.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

# Exit status reported when a command is killed at its wall timeout (as coreutils' `timeout`).
TIMEOUT_RC = 124
# Exit status reported when the kernel (or runsc's cgroup) killed the command for memory (128 + SIGKILL).
KILLED_RC = 137
# How long the runner keeps reading output after the command's main process exited: background
# processes that inherited stdout would otherwise keep the pipe open forever.
_EXIT_GRACE_S = 0.2
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The whole environment of a sandboxed command (nothing leaks in from the host's environment).
SANDBOX_ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}


# PID 1 of every sandbox (perl is Essential in Debian): reaps orphans (zombies would pile up), and as an init without signal
# handlers it ignores kill -9 from inside, so `kill -9 -1` or `pkill perl` can not end the sandbox.
INIT = ["/usr/bin/perl", "-e", "while (1) { sleep 1 if wait() == -1 }"]


class SandboxError(RuntimeError):
    """A sandbox operation failed (backend missing, sandbox dead or closed, bad argument)."""


@dataclass(frozen=True)
class Limits:
    """Per-sandbox resource limits.

    mem_mb: memory of the whole sandbox (cgroup limit), MiB.
    pids: processes (bwrap: cgroup ``pids.max`` of the sandbox; runsc: ``RLIMIT_NPROC`` inside gVisor).
    cpu_s: CPU seconds per command (``RLIMIT_CPU``; enforced by bwrap; the gVisor 2022-12 Sentry
        ignores it, so runsc commands are bounded by the wall timeout only).
    wall_s: default wall-clock timeout of one ``exec``, seconds.
    """

    mem_mb: int = 512
    pids: int = 64
    cpu_s: int = 60
    wall_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mem_mb < 16 or self.pids < 4 or self.cpu_s < 1 or not self.wall_s > 0:
            raise SandboxError(f"limits too small or invalid: {self}")


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command: exit status (TIMEOUT_RC on timeout, KILLED_RC when killed for
    memory, 128+N for signal N), decoded output (utf-8, undecodable bytes replaced), whether the
    wall timeout fired and whether stdout or stderr was cut at ``max_output`` bytes."""

    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool


@dataclass
class RawResult:
    """Byte-level outcome of ``run_process`` (decoded into ExecResult by the facade)."""

    rc: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool


def command_argv(cmd: str | list[str]) -> list[str]:
    """A shell string runs via ``/bin/sh -c``; a list is the argv itself."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
    if not argv or not isinstance(argv, list) or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise SandboxError(f"command must be a string or a non-empty list of strings without NUL, got {cmd!r:.200}")
    return list(argv)


def truncate(data: bytes, total: int, max_output: int) -> tuple[bytes, bool]:
    """Keep the first ``max_output`` bytes of a stream of ``total`` bytes and append a marker."""
    if total <= max_output:
        return data, False
    return data[:max_output] + f"\n[... output truncated: {total - max_output} more bytes ...]\n".encode(), True


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def run_process(argv: list[str], stdin: bytes | None, timeout: float, max_output: int,
                on_timeout: Callable[[subprocess.Popen], None], env: dict | None = None) -> RawResult:
    """Run ``argv`` on the host, capture at most ``max_output`` bytes per stream (the rest is read
    and dropped), and call ``on_timeout(proc)`` once when ``timeout`` seconds pass.

    The process gets its own session so ``on_timeout`` can kill its whole process group.
    Returns when the process exited and its pipes closed (or ``_EXIT_GRACE_S`` after exit).
    """
    with tempfile.TemporaryFile() as fin:
        if stdin:
            fin.write(stdin)
            fin.seek(0)
        proc = subprocess.Popen(argv, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=env)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    totals = dict.fromkeys(bufs, 0)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out, exited_at = False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break
            if not timed_out and now > deadline:
                timed_out = True
                on_timeout(proc)
                deadline = now + 5.0  # give up reading 5 s after the kill, whatever is left
            elif timed_out and now > deadline:
                break
            for key, _ in sel.select(timeout=0.05):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                totals[key.fd] += len(chunk)
                if len(bufs[key.fd]) <= max_output:
                    bufs[key.fd] += chunk
    except BaseException:  # e.g. KeyboardInterrupt: never leave the command running
        if not timed_out:
            on_timeout(proc)
        raise
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    rc = _wait_rc(proc)
    out, t1 = truncate(bytes(bufs[out_fd]), totals[out_fd], max_output)
    err, t2 = truncate(bytes(bufs[err_fd]), totals[err_fd], max_output)
    return RawResult(TIMEOUT_RC if timed_out else rc, out, err, timed_out, t1 or t2)


def _wait_rc(proc: subprocess.Popen) -> int:
    """Exit status of ``proc`` (128+N for signal N); kills it if it does not exit within 5 s."""
    try:
        rc = proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        rc = proc.wait()
    return 128 - rc if rc < 0 else rc


def kill_group(pgid: int, tries: int = 5) -> None:
    """SIGKILL a host process group until it is gone (a group that is already gone is fine)."""
    for _ in range(tries):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)
