"""Shell world: file-system and scripting tasks inside a sandbox (`k3.envs.sandbox`).

Each task gets a fresh sandbox whose workspace holds the task's files (the agent's working
directory). Tools: `run_command` (bash in the workspace, with a timeout), `read_file`,
`write_file` and `check_progress` (the public check, e.g. the visible test). The hidden verifier
runs its checks in fresh processes inside the same sandbox after the episode: it re-runs the
agent's code on inputs the agent never saw, compares file contents by hash, and recomputes
reports, so special-casing the visible test does not pay. Every check script prints its verdict
behind a per-run random marker, so output printed by the agent's code cannot forge it.

The sandbox is paused while the model generates and closed by `close()` (or the next `reset`).
Task families live in `k3.envs.worlds.shell_tasks`.
"""

from __future__ import annotations

import json
import random
import secrets
from typing import Any

from k3.envs.base import Environment, Reward, TaskInfo, ToolError
from k3.envs.sandbox import Limits, Sandbox
from k3.envs.schema import ToolSpec
from k3.envs.worlds.shell_tasks import FAMILIES, ShellTask

MAX_STREAM = 6000        # characters of stdout / stderr shown per command
MAX_FILE = 64_000        # characters read_file returns / write_file accepts
DEFAULT_TIMEOUT = 20     # seconds per agent command


def _tool(name: str, desc: str, props: dict, required: tuple[str, ...] = ()) -> ToolSpec:
    return ToolSpec(name, desc, {"type": "object", "properties": props, "required": list(required),
                                 "additionalProperties": False})


TOOLS = [
    _tool("run_command", "Run a bash command in the workspace (your working directory); returns exit code, "
          "stdout and stderr. No network.",
          {"command": {"type": "string", "description": "the bash command line", "maxLength": 8000},
           "timeout_s": {"type": "integer", "minimum": 1, "maximum": 60,
                         "description": f"kill the command after this many seconds (default {DEFAULT_TIMEOUT})"}},
          ("command",)),
    _tool("read_file", "Read a text file of the workspace.",
          {"path": {"type": "string", "description": "path relative to the workspace", "maxLength": 500}},
          ("path",)),
    _tool("write_file", "Create or overwrite a text file of the workspace (parent directories are created).",
          {"path": {"type": "string", "description": "path relative to the workspace", "maxLength": 500},
           "content": {"type": "string", "maxLength": MAX_FILE}}, ("path", "content")),
    _tool("check_progress", "Run the task's public check (e.g. the visible test) for feedback.", {}),
]


# writes {path: text} read as JSON from stdin, relative to the working directory (the workspace)
_WRITER = ("import json, os, sys\n"
           "for p, t in json.load(sys.stdin).items():\n"
           "    d = os.path.dirname(p)\n"
           "    if d: os.makedirs(d, exist_ok=True)\n"
           "    open(p, 'w').write(t)\n")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"


def _rel(path: str) -> str:
    """A workspace-relative path; absolute paths and `..` escapes are refused."""
    p = path.strip()
    parts = [s for s in p.split("/") if s not in ("", ".")]
    if p.startswith("/") or not parts or ".." in parts:
        raise ToolError(f"path {path!r} must be relative to the workspace and stay inside it")
    return "/".join(parts)


def task_for(seed: int) -> ShellTask:
    """The task of `seed` (a pure function of the seed; no sandbox needed)."""
    rng = random.Random(f"shell:{seed}")
    return FAMILIES[rng.randrange(len(FAMILIES))](rng)


class ScriptedCalls:
    """An agent that makes a fixed list of tool calls, one per turn, then answers `final`."""

    def __init__(self, calls: list[tuple[str, dict]], final: str = "Done.") -> None:
        self.calls, self.final, self.n = list(calls), final, 0

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if self.n >= len(self.calls):
            return {"role": "assistant", "content": self.final}
        name, args = self.calls[self.n]
        self.n += 1
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{self.n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


class ShellWorld(Environment):
    """Seeded shell tasks in a sandbox. backend: `Sandbox.create` backend ("auto", "bwrap", "runsc").

    bwrap by default: the tasks need no process-memory checkpoints, bwrap starts ~15x faster, and
    Debian's 2022 runsc rejects a system call GNU `ls PATH` makes (docs/envs_sandbox.md)."""

    world = "shell"

    def __init__(self, backend: str = "bwrap", limits: Limits | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.limits = limits or Limits(mem_mb=512, pids=128)
        self.box: Sandbox | None = None
        self.current: ShellTask | None = None

    # ---- sandbox helpers -----------------------------------------------------------------------------
    def sh(self, command: str, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Run bash `command` in the workspace -> ExecResult(rc, stdout, stderr, timed_out, truncated)."""
        return self.box.exec(["bash", "-c", command], timeout=timeout)

    def run_checker(self, script: str, timeout: float = 30) -> Any:
        """Run a Python check script in a fresh isolated process (`python3 -I`: workspace files cannot
        shadow the standard library); it must `emit(value)` once. Returns the emitted JSON value, or
        None when the script failed, timed out or emitted nothing."""
        nonce = secrets.token_hex(8)
        prelude = (f"import json as _j, sys as _s\n"
                   f"def emit(v):\n"
                   f"    _s.__stdout__.write('K3V{nonce}' + _j.dumps(v) + '\\n'); _s.__stdout__.flush()\n")
        res = self.box.exec(["python3", "-I", "-"], timeout=timeout, stdin=prelude + script)
        for line in (res.stdout or "").splitlines():
            if line.startswith(f"K3V{nonce}"):
                try:
                    return json.loads(line[len(nonce) + 3:])
                except json.JSONDecodeError:
                    return None
        return None

    def write_files(self, files: dict[str, str]) -> None:
        """Create the task's files (parents included) in one exec; OSError if that fails."""
        res = self.box.exec(["python3", "-I", "-c", _WRITER], timeout=30, stdin=json.dumps(files))
        if res.rc != 0:
            raise OSError(res.stderr.strip()[-500:] or f"exit code {res.rc}")

    # ---- Environment hooks -----------------------------------------------------------------------------
    def _reset(self, seed: int) -> tuple[list[dict], TaskInfo]:
        self.close()
        self.current = task = task_for(seed)
        self.box = Sandbox.create(backend=self.backend, limits=self.limits)
        self.write_files(task.files)
        system = ("You work in a Linux shell workspace through the run_command, read_file and write_file tools "
                  "(paths are relative to the workspace; there is no network). Call check_progress for the "
                  "task's public check. Reply without a tool call when the task is done.")
        info = TaskInfo(self.world, f"shell-{seed}", seed, task.difficulty, task.kind, ("shell",))
        return [{"role": "system", "content": system}, {"role": "user", "content": task.instruction}], info

    def tool_specs(self) -> list[ToolSpec]:
        return list(TOOLS)

    def call_tool(self, name: str, args: dict) -> Any:
        if name == "run_command":
            res = self.sh(args["command"], args.get("timeout_s", DEFAULT_TIMEOUT))
            out = {"exit_code": res.rc, "stdout": _cut(res.stdout or "", MAX_STREAM),
                   "stderr": _cut(res.stderr or "", MAX_STREAM)}
            if res.timed_out:
                out["note"] = "the command timed out and was killed"
            return out
        if name == "read_file":
            try:
                data = self.box.read_file(_rel(args["path"]))
                text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
                return _cut(text, MAX_FILE)
            except (OSError, ValueError) as e:
                raise ToolError(f"cannot read {args['path']!r}: {e}") from None
        if name == "write_file":
            path = _rel(args["path"])
            try:
                self.write_files({path: args["content"]})
            except (OSError, ValueError) as e:
                raise ToolError(f"cannot write {args['path']!r}: {e}") from None
            return {"ok": True, "path": path, "chars": len(args["content"])}
        if name == "check_progress":
            return self.public_check()
        raise ToolError(f"unknown tool {name!r}")

    def public_check(self) -> str:
        ok, text = self.current.public(self)
        return ("PASS: " if ok else "NOT DONE: ") + text

    def verify(self) -> Reward:
        """Hidden checks on the final workspace; score = fraction passed."""
        try:
            checks = self.current.hidden(self)
        except Exception as e:  # a broken sandbox scores 0 with the reason, it never ends an eval
            return Reward(0.0, {"error": f"{type(e).__name__}: {e}"})
        score = sum(map(bool, checks.values())) / max(len(checks), 1)
        return Reward(score, {"checks": checks})

    def oracle(self) -> ScriptedCalls:
        return ScriptedCalls(self.current.solution)

    def hacker(self) -> ScriptedCalls | None:
        """Games the public check (hard-codes the visible cases, fakes the output) without solving."""
        return ScriptedCalls(self.current.hack) if self.current.hack else None

    def pause(self) -> None:
        if self.box is not None:
            self.box.pause()

    def resume(self) -> None:
        if self.box is not None:
            self.box.resume()

    def close(self) -> None:
        if self.box is not None:
            box, self.box = self.box, None
            box.close()
