"""gVisor (``runsc``) backend of ``k3.envs.sandbox``.

Each sandbox is one OCI container started with ``runsc --platform=ptrace --network=none run
--detach`` whose init is a tiny reaper (perl: PID 1 must wait() for orphans, or zombies of killed
commands would count against RLIMIT_NPROC). Commands run with ``runsc exec --process <json>``;
pause / resume / checkpoint / restore are runsc's own. All containers of this interpreter share a
private ``--root`` state directory under a temp dir (removed with the last sandbox).

Root filesystem: an empty read-only directory with read-only binds of the host's system
directories (symlinks such as /bin -> usr/bin recreated), gVisor's own /proc and /dev, tmpfs /tmp
(inside the sandbox memory, so it is part of checkpoints) and the workspace bound read-write at
/workspace.

Limits: memory = the container cgroup (``linux.resources.memory`` + a cgroupsPath relative to this
process's cgroups): exceeding it kills the *whole* gVisor sandbox (the Sentry is one host process);
the exec reports rc 137 and later calls raise SandboxError. pids = RLIMIT_NPROC inside gVisor (a
host ``pids.max`` would starve the Sentry's own threads and crash it); commands run as root, and a
timed-out command's process group is killed by a helper that runs as uid 65534 with CAP_KILL, so
it is not refused by the exhausted root process count. cpu = RLIMIT_CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from k3.envs.sandbox_types import (
    INIT, KILLED_RC, SANDBOX_ENV, Limits, RawResult, SandboxError, command_argv, kill_group, run_process,
)

RUNSC = "runsc"
_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Runs `runsc run/restore --detach` (argv[2:]) as a child subreaper: the detached Sentry and gofer
# re-parent to it instead of the host's PID 1, so they are reaped at once when killed (`runsc
# delete` waits until the Sentry's pid is gone; a slow host init made that take seconds). It
# prints runsc's exit status, then reaps until no child is left. stdio of the detached sandbox:
# /dev/null and a log file (a pipe to it would never close).
_REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
with open(sys.argv[1], "wb") as log:
    rc = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log).returncode
print(rc, flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""
_ids = itertools.count()
_lock = threading.Lock()
_state: dict = {"dir": None, "live": 0}
_NO_CAPS: dict = {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}


def _acquire_state() -> Path:
    """The per-interpreter state dir (runsc --root and a shared empty rootfs), made on first use."""
    with _lock:
        if _state["dir"] is None:
            d = Path(tempfile.mkdtemp(prefix=f"k3-runsc-{os.getpid()}-"))
            (d / "root").mkdir()
            rootfs = d / "rootfs"
            rootfs.mkdir()
            for name in _SYSTEM_DIRS:
                host = Path("/") / name
                if host.is_symlink():
                    (rootfs / name).symlink_to(os.readlink(host))
                elif host.is_dir():
                    (rootfs / name).mkdir()
            for name in ("proc", "dev", "sys", "tmp", "workspace"):
                (rootfs / name).mkdir()
            _state["dir"] = d
        _state["live"] += 1
        return _state["dir"]


def _release_state() -> None:
    with _lock:
        _state["live"] -= 1
        if _state["live"] == 0 and _state["dir"] is not None:
            shutil.rmtree(_state["dir"], ignore_errors=True)
            _state["dir"] = None


def _own_memory_cgroup() -> Path | None:
    """This process's v1 memory cgroup directory (runsc's relative cgroupsPath lands below it)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if "memory" in names.split(","):
                return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


def _rlimits(limits: Limits) -> list[dict]:
    return [{"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids},
            {"type": "RLIMIT_CPU", "hard": limits.cpu_s, "soft": limits.cpu_s}]


def _process(args: list[str], limits: Limits, uid: int = 0, caps: list[str] | None = None) -> dict:
    """OCI process object (used for the init and for every exec)."""
    capabilities = {k: list(caps or []) for k in _NO_CAPS}
    return {"terminal": False, "user": {"uid": uid, "gid": uid}, "args": args, "cwd": "/workspace",
            "env": [f"{k}={v}" for k, v in SANDBOX_ENV.items()],
            "rlimits": _rlimits(limits), "capabilities": capabilities}


def _spec(workspace: Path, rootfs: Path, limits: Limits, cgroup: str) -> dict:
    mounts = [{"destination": "/proc", "type": "proc", "source": "proc"},
              {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
              {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
              {"destination": "/workspace", "type": "bind", "source": str(workspace), "options": ["rbind", "rw"]}]
    for name in _SYSTEM_DIRS:
        host = Path("/") / name
        if host.is_dir() and not host.is_symlink():
            mounts.append({"destination": str(host), "type": "bind", "source": str(host), "options": ["rbind", "ro"]})
    # The init runs as nobody with cwd /: this gVisor lets PID 1 be killed from inside, and root
    # commands without CAP_KILL can not signal another uid's process.
    init = {**_process(INIT, limits, uid=65534), "cwd": "/"}
    return {"ociVersion": "1.0.0", "process": init, "hostname": "sandbox",
            "root": {"path": str(rootfs), "readonly": True}, "mounts": mounts,
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                      "resources": {"memory": {"limit": limits.mem_mb << 20}}, "cgroupsPath": cgroup}}


class RunscBox:
    """One gVisor container (see module docstring)."""

    backend = "runsc"

    def __init__(self, workspace: Path, limits: Limits, image: Path | None = None) -> None:
        """Start a fresh container, or restore one from a ``runsc checkpoint`` image directory."""
        if shutil.which(RUNSC) is None:
            raise SandboxError("gVisor runsc not installed (apt-get install -y runsc)")
        self.workspace, self.limits = workspace, limits
        self.state = _acquire_state()
        self.id = f"k3-{os.getpid()}-{next(_ids)}"
        self.bundle = self.state / "bundles" / self.id
        self.bundle.mkdir(parents=True)
        self.dead = self.paused = False
        self.reaper: subprocess.Popen | None = None
        self._execs = itertools.count()
        spec = _spec(workspace, self.state / "rootfs", limits, f"k3-sbx-{self.id}")
        (self.bundle / "config.json").write_text(json.dumps(spec))
        try:
            self._start(image)
        except BaseException:
            self.close()
            raise

    def _runsc(self, *args: str) -> list[str]:
        return [RUNSC, f"--root={self.state / 'root'}", "--platform=ptrace", "--network=none", *args]

    def _ctl(self, *args: str, timeout: float = 60.0) -> None:
        """Run a runsc control command; raise SandboxError with its stderr on failure."""
        r = subprocess.run(self._runsc(*args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=timeout)
        if r.returncode != 0:
            raise SandboxError(f"runsc {args[0]} failed: {r.stderr.decode(errors='replace').strip()[-2000:]}")

    def _start(self, image: Path | None) -> None:
        """``runsc run|restore --detach`` under a subreaper (see _REAPER); waits for its status."""
        cmd = ["restore", f"--image-path={image}"] if image is not None else ["run"]
        log = self.bundle / "runsc.log"
        argv = [sys.executable, "-c", _REAPER, str(log),
                *self._runsc(*cmd, "--detach", f"--bundle={self.bundle}", self.id)]
        self.reaper = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL)
        with self.reaper.stdout:
            line = self.reaper.stdout.readline()
        if line.strip() != b"0":
            self.reaper.wait(timeout=60)
            raise SandboxError(f"runsc {cmd[0]} failed: {log.read_text()[-2000:] if log.exists() else line!r}")

    def status(self) -> str:
        r = subprocess.run(self._runsc("state", self.id), capture_output=True, timeout=30)
        return json.loads(r.stdout).get("status", "") if r.returncode == 0 else "gone"

    def alive(self) -> bool:
        return not self.dead and self.status() in ("running", "paused")

    def run(self, cmd: str | list[str], stdin: bytes | None, timeout: float, max_output: int) -> RawResult:
        if self.dead:
            raise SandboxError("runsc sandbox is dead (killed by its memory limit or closed)")
        n = next(self._execs)
        pfile, pidfile = self.bundle / f"exec-{n}.json", self.bundle / f"exec-{n}.pid"
        pfile.write_text(json.dumps(_process(command_argv(cmd), self.limits)))
        argv = self._runsc("exec", f"--process={pfile}", f"--internal-pid-file={pidfile}", self.id)
        try:
            res = run_process(argv, stdin, timeout, max_output, lambda p: self._kill_exec(p, pidfile))
        finally:
            pfile.unlink(missing_ok=True)
        pidfile.unlink(missing_ok=True)
        if res.rc >= 128 and not res.timed_out and self.status() not in ("running", "paused"):
            self.dead = True
            why = "memory limit" if self._memory_failcnt() > 0 else "unknown reason"
            res.rc = KILLED_RC
            res.stderr += f"\n[sandbox: gVisor sandbox died ({why}); create a new one]\n".encode()
        return res

    def _kill_exec(self, proc: subprocess.Popen, pidfile: Path) -> None:
        """Timeout: SIGKILL the command's process group inside gVisor (runsc exec makes each command a
        session leader), then the host ``runsc exec`` client."""
        try:
            pgid = int(pidfile.read_text())
        except (OSError, ValueError):
            pgid = 0
        if pgid > 1:
            script = f"for i in 1 2 3 4 5; do kill -9 -{pgid} 2>/dev/null || break; sleep 0.05; done"
            helper = _process(["/bin/sh", "-c", script], self.limits, uid=65534, caps=["CAP_KILL"])
            hfile = pidfile.with_suffix(".kill.json")
            hfile.write_text(json.dumps(helper))
            try:
                subprocess.run(self._runsc("exec", f"--process={hfile}", self.id), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
            except subprocess.TimeoutExpired:
                pass
            hfile.unlink(missing_ok=True)
        kill_group(proc.pid)

    def _memory_cgroup(self) -> Path | None:
        own = _own_memory_cgroup()
        return None if own is None else own / f"k3-sbx-{self.id}"

    def _memory_failcnt(self) -> int:
        d = self._memory_cgroup()
        try:
            return int((d / "memory.failcnt").read_text()) if d else 0
        except OSError:
            return 0

    def memory_bytes(self) -> int:
        d = self._memory_cgroup()
        if d is None:
            raise SandboxError("no v1 memory cgroup to measure")
        return int((d / "memory.usage_in_bytes").read_text())

    def pause(self) -> None:
        self._ctl("pause", self.id)
        self.paused = True

    def resume(self) -> None:
        self._ctl("resume", self.id)
        self.paused = False

    def checkpoint(self, image: Path, while_stopped: Callable[[], None]) -> None:
        """Save the container's memory state into directory ``image`` and call ``while_stopped``
        (the workspace copy) while nothing runs. ``checkpoint`` stops the container and this runsc's
        ``--leave-running`` hangs, so the container is restored from the image under the same id."""
        shutil.rmtree(image, ignore_errors=True)  # runsc refuses to overwrite an image
        image.mkdir(parents=True)
        was_paused = self.paused
        if was_paused:  # a checkpointed paused container can not be deleted by this runsc
            self.resume()
        self._ctl("checkpoint", f"--image-path={image}", self.id)
        try:
            while_stopped()
        finally:
            self._ctl("delete", "--force", self.id)
            self._wait_reaper()
            self._start(image)
            if was_paused:
                self.pause()

    def _wait_reaper(self) -> None:
        """After ``runsc delete``: the reaper exits once the Sentry and gofer are reaped."""
        if self.reaper is not None:
            try:
                self.reaper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
            self.reaper = None

    def close(self) -> None:
        """Delete the container (kills it), its cgroup and its bundle (idempotent)."""
        if self.bundle is None:
            return
        self.dead = True
        try:
            self._ctl("delete", "--force", self.id)
        except (SandboxError, subprocess.TimeoutExpired):
            pass  # never started, or already gone
        self._wait_reaper()
        shutil.rmtree(self.bundle, ignore_errors=True)
        self.bundle = None
        _release_state()
