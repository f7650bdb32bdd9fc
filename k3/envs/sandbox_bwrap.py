"""bubblewrap backend of ``k3.envs.sandbox``.

Layout: one long-lived ``bwrap --unshare-all --die-with-parent --new-session`` per sandbox whose
namespaces (mount, pid, net, ipc, uts, cgroup, user where available) hold the sandbox; bwrap is
started with ``--as-pid-1`` so that INIT (a reaper loop) is PID 1 inside. Root filesystem: read-only
binds of /usr and /etc (+ the /bin, /lib, ... symlinks or binds as on the host), fresh /proc and
/dev, private tmpfs /tmp, the workspace bound read-write at /workspace, no network (only a down
``lo``).

Each ``exec`` enters those namespaces with ``nsenter --all --root --wd`` (target: INIT,
whose root is the sandbox root and cwd /workspace) after the wrapper shell joined the
sandbox's cgroup (writes its PID into every ``cgroup.procs`` before exec'ing nsenter) and set
RLIMIT_CPU (``ulimit -t``); ``setpriv`` drops every capability and sets no_new_privs; the
environment is exactly SANDBOX_ENV. Processes started in the background by one exec keep running
in the sandbox until ``close``. The cgroup gives the memory / pids limits, ``pause`` (freeze) and
teardown (kill all).

Checkpoint / restore / fork copy the workspace files only: process memory, /tmp and running
processes are not saved (CRIU does not work on 6.13+ kernels with Debian's 3.17).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from k3.envs.sandbox_cgroup import Cgroup
from k3.envs.sandbox_types import (
    INIT, KILLED_RC, SANDBOX_ENV, Limits, RawResult, SandboxError, command_argv, kill_group, run_process,
)

log = logging.getLogger(__name__)
BWRAP = "bwrap"
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# argv: CPU-seconds limit, the cgroup.procs files to join, "--", the command to exec.
_JOIN = 'ulimit -t "$1"; shift; while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _root_args() -> list[str]:
    """bwrap arguments that rebuild the host's system directories read-only (symlinks stay symlinks)."""
    args: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def _wait_exec(pid: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """bwrap reports the child's pid before it has pivoted and exec'd INIT; wait for the exec, or
    ``nsenter -r -w`` would see the old root and working directory."""
    want = INIT[0].encode()
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0", 1)[0] == want:
                    return
        except FileNotFoundError:
            break
        time.sleep(0.0005)
    raise SandboxError(f"bwrap did not start its init (exit status {proc.poll()})")


class _Spawner:
    """Starts long-lived bwrap processes from one thread that lives as long as the interpreter:
    ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that forked exits
    (e.g. an asyncio.to_thread worker), not only when the process does."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            fn, box, done = self._q.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            finally:
                done.set()

    def call(self, fn):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="k3-sandbox-spawner", daemon=True)
                self._thread.start()
        box: list = []
        done = threading.Event()
        self._q.put((fn, box, done))
        done.wait()
        ok, val = box[0]
        if not ok:
            raise val
        return val


_spawner = _Spawner()


class BwrapBox:
    """One running bubblewrap sandbox (see module docstring). Not thread-safe for close()."""

    backend = "bwrap"

    def __init__(self, workspace: Path, limits: Limits) -> None:
        if shutil.which(BWRAP) is None:
            raise SandboxError("bubblewrap not installed (apt-get install -y bubblewrap)")
        self.workspace, self.limits = workspace, limits
        self.cgroup = Cgroup.create(limits.mem_mb << 20, limits.pids)
        self.proc: subprocess.Popen | None = None
        self.paused = False
        try:
            self.proc, self.init_pid = _spawner.call(self._launch)
        except BaseException:
            self.close()
            raise

    def _launch(self) -> tuple[subprocess.Popen, int]:
        r, w = os.pipe()
        argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", *_root_args(),
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--bind", str(self.workspace), "/workspace", "--chdir", "/workspace",
                "--hostname", "sandbox", "--remount-ro", "/", "--as-pid-1", "--info-fd", str(w), "--", *INIT]
        join = ["/bin/sh", "-c", _JOIN, "sh", "unlimited", *self.cgroup.procs_files(), "--"]
        # stderr: a file, not a pipe (bwrap outlives this call; a closed pipe would SIGPIPE it)
        with tempfile.TemporaryFile() as errf:
            try:
                proc = subprocess.Popen(join + argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=errf, pass_fds=(w,), env=SANDBOX_ENV)
            finally:
                os.close(w)
            with os.fdopen(r) as f:
                info = f.read()  # bwrap closes the info fd once the namespaces are set up
            if not info:
                proc.wait()
                errf.seek(0)
                raise SandboxError(f"bwrap failed to start: {errf.read().decode(errors='replace').strip()}")
        pid = int(json.loads(info)["child-pid"])
        try:
            _wait_exec(pid, proc)
        except SandboxError:
            proc.kill()
            proc.wait()
            raise
        return proc, pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, cmd: str | list[str], stdin: bytes | None, timeout: float, max_output: int) -> RawResult:
        if not self.alive():
            raise SandboxError("bwrap sandbox is not running")
        if self.paused:
            raise SandboxError("sandbox is paused; resume() it before exec")
        argv = ["/bin/sh", "-c", _JOIN, "sh", str(self.limits.cpu_s), *self.cgroup.procs_files(), "--",
                "nsenter", "-t", str(self.init_pid), "--all", "-r", "-w",
                "setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", *command_argv(cmd)]
        oom_before = self.cgroup.oom_kills()
        res = run_process(argv, stdin, timeout, max_output, lambda p: kill_group(p.pid), env=SANDBOX_ENV)
        if res.rc == KILLED_RC and self.cgroup.oom_kills() > oom_before:
            res.stderr += b"\n[sandbox: killed by the memory limit]\n"
        return res

    def pause(self) -> None:
        self.cgroup.freeze()
        self.paused = True

    def resume(self) -> None:
        self.cgroup.thaw()
        self.paused = False

    def checkpoint(self, image: Path | None, while_stopped: Callable[[], None]) -> None:
        """No memory image (see module docstring): only ``while_stopped`` (the workspace copy) runs,
        with the sandbox frozen so the copy is consistent."""
        was_paused = self.paused
        if not was_paused:
            self.pause()
        try:
            while_stopped()
        finally:
            if not was_paused:
                self.resume()

    def memory_bytes(self) -> int:
        return self.cgroup.memory_bytes()

    def close(self) -> None:
        """Kill every process of the sandbox, wait for bwrap, remove the cgroup (idempotent)."""
        self.cgroup.remove()
        if self.proc is not None:
            if self.proc.poll() is None:
                kill_group(self.proc.pid)
                self.proc.kill()
            self.proc.wait()
            self.proc = None
