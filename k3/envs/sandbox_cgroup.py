"""One cgroup per bubblewrap sandbox: limits (memory, pids), freeze / thaw, kill-all, removal.

Works on hybrid hosts (cgroup v1 controllers + a controller-less cgroup2 "unified" mount) and on
pure cgroup2 hosts. Choice per function:
  * limits: v1 ``memory.limit_in_bytes`` / ``pids.max`` when those hierarchies are mounted, else
    v2 ``memory.max`` / ``pids.max`` (needs the controllers enabled in the parent);
  * freeze / kill: v2 ``cgroup.freeze`` / ``cgroup.kill`` (core cgroup2 files, no controller
    needed, freeze ~1 ms), else the v1 freezer + SIGKILL of every listed pid.
Each sandbox cgroup is a child of this process's own cgroup in every hierarchy (so limits the
caller runs under still apply) named ``k3-sbx-<pid>-<n>``.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

_counter = itertools.count()
_V2 = "unified"


def _mounts() -> dict[str, Path]:
    """Map of v1 controller name (memory, pids, freezer) / "unified" to its mount point."""
    out: dict[str, Path] = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fstype, opts = line.split()[:4]
            if fstype == "cgroup2":
                out.setdefault(_V2, Path(mnt))
            elif fstype == "cgroup":
                for opt in opts.split(","):
                    if opt in ("memory", "pids", "freezer"):
                        out[opt] = Path(mnt)
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller and for v2 (key "unified")."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [_V2]:
                out[name] = path
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def cgroups_available() -> bool:
    """True when this process can create cgroups with freeze support (root on a cgroup host)."""
    m = _mounts()
    return (_V2 in m or "freezer" in m) and os.access(next(iter(m.values()), Path("/")), os.W_OK)


@dataclass
class Cgroup:
    """Directories of one sandbox's cgroup, keyed by hierarchy ("memory", "pids", "freezer", "unified")."""

    dirs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, mem_bytes: int, pids: int) -> "Cgroup":
        """Make the cgroup in each mounted hierarchy we use and set the limits."""
        mounts, own = _mounts(), _own_paths()
        name = f"k3-sbx-{os.getpid()}-{next(_counter)}"
        cg = cls()
        try:
            for key in ("memory", "pids", "freezer", _V2):
                if key in mounts and key in own:
                    d = mounts[key] / own[key].lstrip("/") / name
                    d.mkdir()
                    cg.dirs[key] = d
            cg._set_limits(mem_bytes, pids)
        except BaseException:
            cg.remove()
            raise
        return cg

    def _set_limits(self, mem_bytes: int, pids: int) -> None:
        if "memory" in self.dirs:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", str(mem_bytes))
        elif (self.dirs[_V2] / "memory.max").exists():
            _write(self.dirs[_V2] / "memory.max", str(mem_bytes))
            _write(self.dirs[_V2] / "memory.swap.max", "0")
        else:
            raise OSError("no memory controller available for the sandbox cgroup")
        if "pids" in self.dirs:
            _write(self.dirs["pids"] / "pids.max", str(pids))
        elif (self.dirs[_V2] / "pids.max").exists():
            _write(self.dirs[_V2] / "pids.max", str(pids))
        else:
            raise OSError("no pids controller available for the sandbox cgroup")

    @property
    def _v2_freeze(self) -> bool:
        return _V2 in self.dirs and (self.dirs[_V2] / "cgroup.freeze").exists()

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process must be written into to join this cgroup."""
        keys = [k for k in self.dirs if not (k == "freezer" and self._v2_freeze)]
        return [str(self.dirs[k] / "cgroup.procs") for k in keys]

    def pids(self) -> list[int]:
        """Host pids of all processes in the cgroup."""
        d = self.dirs[_V2] if _V2 in self.dirs else next(iter(self.dirs.values()))
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def memory_bytes(self) -> int:
        """Current memory charge of the cgroup (bytes)."""
        if "memory" in self.dirs:
            return int((self.dirs["memory"] / "memory.usage_in_bytes").read_text())
        return int((self.dirs[_V2] / "memory.current").read_text())

    def oom_kills(self) -> int:
        """How many processes the OOM killer killed in this cgroup so far."""
        f = self.dirs["memory"] / "memory.oom_control" if "memory" in self.dirs else self.dirs[_V2] / "memory.events"
        for line in f.read_text().splitlines():
            key, _, val = line.partition(" ")
            if key == "oom_kill":
                return int(val)
        return 0

    def freeze(self) -> None:
        """Stop every process of the cgroup; returns once the kernel reports it frozen."""
        if self._v2_freeze:
            _write(self.dirs[_V2] / "cgroup.freeze", "1")
            self._wait_events("frozen 1")
        else:
            _write(self.dirs["freezer"] / "freezer.state", "FROZEN")
            self._wait_file(self.dirs["freezer"] / "freezer.state", "FROZEN")

    def thaw(self) -> None:
        if self._v2_freeze:
            _write(self.dirs[_V2] / "cgroup.freeze", "0")
        else:
            _write(self.dirs["freezer"] / "freezer.state", "THAWED")

    def _wait_events(self, want: str, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while want not in (self.dirs[_V2] / "cgroup.events").read_text().splitlines():
            if time.monotonic() > end:
                raise TimeoutError(f"cgroup {self.dirs[_V2]} did not reach {want!r}")
            time.sleep(0.0005)

    def _wait_file(self, path: Path, want: str, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while path.read_text().strip() != want:
            if time.monotonic() > end:
                raise TimeoutError(f"{path} did not reach {want!r}")
            time.sleep(0.0005)

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every process of the cgroup (also frozen ones) and wait until it is empty."""
        if _V2 in self.dirs and (self.dirs[_V2] / "cgroup.kill").exists():
            _write(self.dirs[_V2] / "cgroup.kill", "1")
        end = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:  # v1 path, and stragglers that raced cgroup.kill
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if "freezer" in self.dirs and not self._v2_freeze:
                _write(self.dirs["freezer"] / "freezer.state", "THAWED")
            if time.monotonic() > end:
                raise TimeoutError(f"cgroup still has processes {pids}")
            time.sleep(0.002)
        if self._v2_freeze:
            _write(self.dirs[_V2] / "cgroup.freeze", "0")

    def remove(self) -> None:
        """Kill what is left and remove the directories (idempotent)."""
        if not self.dirs:
            return
        try:
            self.kill()
        except (OSError, TimeoutError):
            pass
        for key, d in list(self.dirs.items()):
            for _ in range(200):  # rmdir fails with EBUSY while exiting tasks are being released
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
            self.dirs.pop(key)
