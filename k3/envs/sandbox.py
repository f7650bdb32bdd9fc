"""Isolated, persistent sandboxes for agent "practice worlds" (``docs/envs_sandbox.md``).

    with Sandbox.create(backend="auto", limits=Limits(mem_mb=512)) as sb:
        sb.write_file("a.py", "print(6 * 7)")
        r = sb.exec("python3 a.py")          # ExecResult(rc=0, stdout='42\\n', ...)
        sb.pause(); sb.resume()
        child = sb.fork()                    # independent copy

Backends:
  * ``runsc`` (gVisor, ptrace platform): a long-lived OCI container; pause / checkpoint / restore /
    fork keep the full memory state (running processes included).
  * ``bwrap`` (bubblewrap + one cgroup per sandbox): a long-lived namespace set; pause freezes the
    cgroup; checkpoint / restore / fork copy the workspace files only (no process memory, /tmp
    and running processes are lost).
  * ``auto``: runsc when a probe container really runs on this host (checked once), else bwrap.

Inside, both show read-only system directories, a private /tmp, the workspace read-write at
/workspace (the working directory; relative paths of read_file / write_file are relative to it)
and no network. Every process, mount, cgroup, container and temp dir is removed by ``close()``,
by garbage collection of the Sandbox, or at interpreter exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from k3.envs.sandbox_bwrap import BwrapBox
from k3.envs.sandbox_runsc import RunscBox
from k3.envs.sandbox_types import (
    KILLED_RC, TIMEOUT_RC, ExecResult, Limits, SandboxError, decode,
)

__all__ = ["Sandbox", "Limits", "ExecResult", "SandboxError", "TIMEOUT_RC", "KILLED_RC", "runsc_usable"]
log = logging.getLogger(__name__)
BACKENDS = ("auto", "runsc", "bwrap")
_META = "k3_sandbox.json"
_FILE_MAX = 1 << 30  # read_file limit (bytes)
_runsc_ok: list[bool] = []


def runsc_usable() -> bool:
    """Whether a gVisor container really starts and runs a command here (probed once per process)."""
    if not _runsc_ok:
        try:
            with Sandbox.create(backend="runsc", limits=Limits(mem_mb=256)) as sb:
                ok = sb.exec(["/bin/true"], timeout=30).rc == 0
        except (SandboxError, OSError) as e:
            log.info("runsc not usable: %s", e)
            ok = False
        _runsc_ok.append(ok)
    return _runsc_ok[0]


def _cleanup(box, workspace: Path | None) -> None:
    """Finalizer: must not reference the Sandbox itself."""
    try:
        box.close()
    finally:
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)


def _new_workspace(template: Path | None = None) -> Path:
    ws = Path(tempfile.mkdtemp(prefix=f"k3-ws-{os.getpid()}-"))
    if template is not None:
        shutil.copytree(template, ws, symlinks=True, dirs_exist_ok=True)
    return ws


class Sandbox:
    """A running sandbox. Build with ``Sandbox.create`` / ``Sandbox.restore`` / ``fork``.

    Attributes: ``backend`` ("runsc" | "bwrap"), ``workspace`` (host path bound at /workspace),
    ``limits``. ``exec`` calls may run concurrently from several threads.
    """

    def __init__(self, box, workspace: Path, owns_workspace: bool, limits: Limits) -> None:
        self._box = box
        self.backend: str = box.backend
        self.workspace, self.limits = workspace, limits
        self.paused = False
        self._finalizer = weakref.finalize(self, _cleanup, box, workspace if owns_workspace else None)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, backend: str = "auto", workspace: str | Path | None = None,
               limits: Limits | None = None) -> "Sandbox":
        """Start a sandbox. ``workspace``: host directory bound read-write at /workspace (kept at
        close); None makes a temporary one (deleted at close)."""
        if backend not in BACKENDS:
            raise SandboxError(f"backend must be one of {BACKENDS}, got {backend!r}")
        limits = limits or Limits()
        if backend == "auto":
            backend = "runsc" if runsc_usable() else "bwrap"
            log.info("sandbox backend: %s", backend)
        owns = workspace is None
        ws = _new_workspace() if owns else Path(workspace).resolve()
        if not ws.is_dir():
            raise SandboxError(f"workspace {ws} is not a directory")
        return cls._start(backend, ws, owns, limits)

    @classmethod
    def _start(cls, backend: str, ws: Path, owns: bool, limits: Limits, image: Path | None = None) -> "Sandbox":
        try:
            box = RunscBox(ws, limits, image) if backend == "runsc" else BwrapBox(ws, limits)
        except BaseException:
            if owns:
                shutil.rmtree(ws, ignore_errors=True)
            raise
        return cls(box, ws, owns, limits)

    @classmethod
    def restore(cls, path: str | Path) -> "Sandbox":
        """A new sandbox from a ``checkpoint`` directory (may be restored any number of times; each
        copy continues independently from the saved state). The workspace is a fresh temp copy."""
        path = Path(path)
        try:
            meta = json.loads((path / _META).read_text())
        except (OSError, ValueError) as e:
            raise SandboxError(f"{path} is not a sandbox checkpoint: {e}") from e
        limits = Limits(**meta["limits"])
        ws = _new_workspace(path / "workspace")
        image = path / "image" if meta["backend"] == "runsc" else None
        return cls._start(meta["backend"], ws, True, limits, image)

    # ---- commands and files -------------------------------------------------------------------
    def exec(self, cmd: str | list[str], timeout: float | None = None, stdin: str | bytes | None = None,
             max_output: int = 64_000) -> ExecResult:
        """Run ``cmd`` in /workspace (a string via /bin/sh -c). A command still running at
        ``timeout`` (default ``limits.wall_s``) seconds is killed with its process group:
        ``timed_out=True``, rc TIMEOUT_RC, the sandbox stays usable. Each of stdout / stderr keeps
        its first ``max_output`` bytes plus a truncation marker. Background processes it starts
        keep running (redirect their output, or the call waits ~0.2 s for the pipes)."""
        raw = self._run(cmd, timeout, stdin, max_output)
        return ExecResult(raw.rc, decode(raw.stdout), decode(raw.stderr), raw.timed_out, raw.truncated)

    def _run(self, cmd, timeout, stdin, max_output):
        self._check_open()
        if self.paused:
            raise SandboxError("sandbox is paused; call resume() first")
        timeout = self.limits.wall_s if timeout is None else float(timeout)
        if not timeout > 0 or max_output < 0:
            raise SandboxError(f"bad timeout {timeout!r} or max_output {max_output!r}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return self._box.run(cmd, data, timeout, max_output)

    def read_file(self, path: str) -> str | bytes:
        """Contents of ``path`` as seen inside the sandbox: str when valid utf-8, else bytes.
        Read from inside (so a symlink can not reach host files). Raises FileNotFoundError."""
        raw = self._run(["cat", "--", path], self.limits.wall_s, None, _FILE_MAX)
        if raw.rc != 0:
            raise FileNotFoundError(f"{path}: {decode(raw.stderr).strip()}")
        try:
            return raw.stdout.decode("utf-8")
        except UnicodeDecodeError:
            return raw.stdout

    def write_file(self, path: str, data: str | bytes) -> None:
        """Create / overwrite ``path`` inside the sandbox (parent directories made)."""
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        raw = self._run(["/bin/sh", "-c", script, "sh", path], self.limits.wall_s, data, 4096)
        if raw.rc != 0:
            raise OSError(f"write_file({path!r}) failed: {decode(raw.stderr).strip()}")

    # ---- lifecycle ----------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop every process of the sandbox (no CPU progress) until ``resume``."""
        self._check_open()
        if not self.paused:
            self._box.pause()
            self.paused = True

    def resume(self) -> None:
        self._check_open()
        if self.paused:
            self._box.resume()
            self.paused = False

    def checkpoint(self, path: str | Path) -> Path:
        """Save the sandbox into directory ``path``: workspace files (both backends) and, with
        runsc, the full memory image. The sandbox keeps running. Returns ``path``."""
        self._check_open()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)

        def copy_files() -> None:
            shutil.rmtree(path / "workspace", ignore_errors=True)
            shutil.copytree(self.workspace, path / "workspace", symlinks=True)

        self._box.checkpoint(path / "image", copy_files)
        meta = {"backend": self.backend, "limits": dataclasses.asdict(self.limits)}
        (path / _META).write_text(json.dumps(meta))
        return path

    def fork(self) -> "Sandbox":
        """An independent copy (runsc: memory state included; bwrap: workspace files only)."""
        self._check_open()
        if self.backend == "bwrap":
            ws = _new_workspace()
            self._box.checkpoint(None, lambda: shutil.copytree(self.workspace, ws, symlinks=True, dirs_exist_ok=True))
            return Sandbox._start("bwrap", ws, True, self.limits)
        tmp = Path(tempfile.mkdtemp(prefix=f"k3-fork-{os.getpid()}-"))
        try:
            return Sandbox.restore(self.checkpoint(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox's cgroup (bytes)."""
        self._check_open()
        return self._box.memory_bytes()

    def alive(self) -> bool:
        return self._finalizer.alive and self._box.alive()

    def close(self) -> None:
        """Kill everything, remove cgroup / container / temp workspace (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError("sandbox is closed")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "paused" if self.paused else "running"
        return f"Sandbox(backend={self.backend!r}, workspace={str(self.workspace)!r}, {state})"

    # ---- asyncio ------------------------------------------------------------------------------
    @classmethod
    async def acreate(cls, *args, **kwargs) -> "Sandbox":
        return await asyncio.to_thread(cls.create, *args, **kwargs)

    @classmethod
    async def arestore(cls, path: str | Path) -> "Sandbox":
        return await asyncio.to_thread(cls.restore, path)

    async def aexec(self, *args, **kwargs) -> ExecResult:
        return await asyncio.to_thread(self.exec, *args, **kwargs)

    async def aread_file(self, path: str) -> str | bytes:
        return await asyncio.to_thread(self.read_file, path)

    async def awrite_file(self, path: str, data: str | bytes) -> None:
        await asyncio.to_thread(self.write_file, path, data)

    async def apause(self) -> None:
        await asyncio.to_thread(self.pause)

    async def aresume(self) -> None:
        await asyncio.to_thread(self.resume)

    async def acheckpoint(self, path: str | Path) -> Path:
        return await asyncio.to_thread(self.checkpoint, path)

    async def afork(self) -> "Sandbox":
        return await asyncio.to_thread(self.fork)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
