"""Acceptance tests of k3.envs.sandbox on both backends (needs root, bubblewrap and runsc: .ci/run
installs them)."""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from k3.envs.sandbox import KILLED_RC, TIMEOUT_RC, Limits, Sandbox, SandboxError, runsc_usable

BACKENDS = ["bwrap", "runsc"]


@pytest.fixture(scope="module", params=BACKENDS)
def sb(request):
    """One shared sandbox per backend for the tests that leave no state behind."""
    with Sandbox.create(backend=request.param, limits=Limits(wall_s=20)) as s:
        yield s


def _wait_for(pred, timeout=10.0, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return False


def _count_procs(s: Sandbox, cmdline: str | None = None) -> int:
    """Processes inside the sandbox (with exactly this space-joined command line, if given)."""
    probe = ("import os, sys\n"
             "n = 0\n"
             "for p in filter(str.isdigit, os.listdir('/proc')):\n"
             "    try: c = open(f'/proc/{p}/cmdline', 'rb').read().decode().replace(chr(0), ' ').strip()\n"
             "    except OSError: continue\n"
             "    n += sys.argv[1] == '*' or c == sys.argv[1]\n"
             "print(n)\n")
    r = s.exec(["python3", "-c", probe, cmdline or "*"])
    assert r.rc == 0, r
    return int(r.stdout)


def _counter(s: Sandbox, path: str) -> int:
    text = s.read_file(path).strip()
    return int(text) if text else 0


COUNTER = "i=0; while :; do i=$((i+1)); echo $i > {path}.new; mv {path}.new {path}; sleep 0.02; done >/dev/null 2>&1 &"


def _start_counter(s: Sandbox, path: str) -> None:
    assert s.exec(COUNTER.format(path=path)).rc == 0
    assert _wait_for(lambda: s.exec(["test", "-s", path]).rc == 0 and _counter(s, path) > 2)


def test_exec_and_files(sb):
    r = sb.exec("echo out; echo err >&2; pwd; echo $HOME; exit 3")
    want = (3, "out\n/workspace\n/workspace\n", "err\n", False, False)
    assert (r.rc, r.stdout, r.stderr, r.timed_out, r.truncated) == want
    assert sb.exec("env").stdout.count("=") <= 5  # nothing from the host's environment
    assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"
    assert sb.exec("tr a-z A-Z", stdin="hello").stdout == "HELLO"
    sb.write_file("sub/dir/t.txt", "héllo\n")
    assert sb.read_file("sub/dir/t.txt") == "héllo\n"
    assert (sb.workspace / "sub/dir/t.txt").read_text() == "héllo\n"  # the workspace is the host dir
    blob = bytes(range(256)) * 4
    sb.write_file("/workspace/b.bin", blob)
    assert sb.read_file("b.bin") == blob
    sb.write_file("/tmp/inside.txt", "tmp")  # outside the workspace: only inside the sandbox
    assert sb.read_file("/tmp/inside.txt") == "tmp"
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing.txt")
    sb.exec("ln -sf /tmp/inside.txt link")  # symlinks resolve inside the sandbox, never on the host
    assert sb.read_file("link") == "tmp"


def test_hung_command_times_out(sb):
    t = time.monotonic()
    r = sb.exec("echo started; sleep 123", timeout=1.0)
    assert r.timed_out and r.rc == TIMEOUT_RC and r.stdout == "started\n"
    assert time.monotonic() - t < 8
    assert sb.exec("echo still usable").stdout == "still usable\n"
    assert _count_procs(sb, "sleep 123") == 0  # the killed command left nothing running


def test_commands_can_not_kill_the_sandbox(sb):
    sb.exec("kill -9 1; pkill -9 perl; kill -9 -1")
    assert sb.alive() and sb.exec("echo alive").stdout == "alive\n"


def test_huge_output_truncated(sb):
    r = sb.exec("head -c 5000000 /dev/zero | tr '\\0' x; echo tail", max_output=1000)
    assert r.truncated and r.rc == 0 and not r.timed_out
    assert r.stdout.startswith("x" * 1000) and "truncated: 4999005 more bytes" in r.stdout
    assert len(r.stdout) < 1100


def test_no_network(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    threading.Thread(target=lambda: srv.accept()[0].close(), daemon=True).start()
    probe = ("import socket\n"
             f"try:\n socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\n"
             "except OSError as e: print('blocked', e)\n"
             "try:\n socket.getaddrinfo('pypi.org', 443); print('RESOLVED')\n"
             "except OSError as e: print('noresolve', e)\n")
    r = sb.exec(["python3", "-c", probe])
    srv.close()
    assert r.rc == 0, r.stderr
    assert "blocked" in r.stdout and "noresolve" in r.stdout, r.stdout


def test_host_filesystem_read_only(sb):
    targets = ["/etc/k3_probe", "/usr/k3_probe", "/root/k3_probe", "/work/k3_probe", "/tmp/../k3_probe"]
    for t in targets:
        sb.exec(f"echo pwned > {t}; mkdir -p {os.path.dirname(t)}/k3_probe_dir")
    for t in targets:
        assert not os.path.exists(os.path.normpath(t)), t
        assert not os.path.exists(os.path.join(os.path.dirname(os.path.normpath(t)), "k3_probe_dir")), t
    assert sb.exec("ls /root /work 2>/dev/null | head -1").stdout == ""  # not even visible
    assert sb.exec("echo ok > /workspace/w && cat /workspace/w").stdout == "ok\n"
    assert (sb.workspace / "w").read_text() == "ok\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_stops_progress_resume_continues(backend):
    with Sandbox.create(backend=backend) as s:
        _start_counter(s, "/workspace/c")
        s.pause()
        with pytest.raises(SandboxError):
            s.exec("true")
        frozen = int((s.workspace / "c").read_text())
        time.sleep(0.4)
        assert int((s.workspace / "c").read_text()) == frozen
        s.resume()
        assert _wait_for(lambda: _counter(s, "c") > frozen + 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_isolation(backend, tmp_path):
    with Sandbox.create(backend=backend, workspace=tmp_path) as a:
        a.write_file("f.txt", "orig")
        a.write_file("/tmp/mem.txt", "in-memory")
        with a.fork() as b:
            assert b.backend == backend and b.workspace != a.workspace
            assert b.read_file("f.txt") == "orig"
            b.write_file("f.txt", "fork")
            a.write_file("g.txt", "only-a")
            assert a.read_file("f.txt") == "orig" and b.read_file("f.txt") == "fork"
            assert b.exec(["test", "-e", "g.txt"]).rc == 1
            # runsc forks the memory state (the tmpfs /tmp); bwrap copies workspace files only
            assert (b.exec(["cat", "/tmp/mem.txt"]).stdout == "in-memory") == (backend == "runsc")
        assert tmp_path.joinpath("f.txt").read_text() == "orig"
    assert tmp_path.is_dir()  # a caller's workspace is kept


def _state(s: Sandbox) -> list[str]:
    """[counter, /tmp/mem.txt, ws.txt, /tmp/c.mark or "-"] of the checkpoint test, in one exec."""
    r = s.exec("for f in /tmp/c /tmp/mem.txt ws.txt /tmp/c.mark; do cat $f 2>/dev/null || printf -; echo; done")
    assert r.rc == 0 and len(r.stdout.split()) == 4, r
    return r.stdout.split()


def test_runsc_checkpoint_restore_twice_continue_independently(tmp_path):
    with Sandbox.create(backend="runsc") as s:
        _start_counter(s, "/tmp/c")  # /tmp is tmpfs: the counter lives in sandbox memory only
        s.write_file("ws.txt", "saved")
        s.write_file("/tmp/mem.txt", "memory")
        before = int(_state(s)[0])
        s.checkpoint(tmp_path / "ck")
        after = int(_state(s)[0])
        time.sleep(0.3)
        assert int(_state(s)[0]) > after >= before  # the original runs on
    copies = [Sandbox.restore(tmp_path / "ck"), Sandbox.restore(tmp_path / "ck")]
    try:
        first = []
        for c in copies:
            counter, mem, ws, mark = _state(c)
            assert (c.backend, mem, ws, mark) == ("runsc", "memory", "saved", "-")
            assert int(counter) >= before > 2  # resumes from the checkpointed counter, not from 0
            first.append(int(counter))
        copies[0].write_file("/tmp/c.mark", "copy0")
        copies[0].write_file("ws.txt", "changed")
        time.sleep(0.3)
        s0, s1 = _state(copies[0]), _state(copies[1])
        assert s0[2:] == ["changed", "copy0"] and s1[2:] == ["saved", "-"]  # independent copies
        assert int(s0[0]) > first[0] and int(s1[0]) > first[1]  # both keep counting
    finally:
        for c in copies:
            c.close()


def test_bwrap_checkpoint_restore_copies_workspace_only(tmp_path):
    with Sandbox.create(backend="bwrap") as s:
        s.write_file("ws.txt", "saved")
        s.write_file("/tmp/mem.txt", "lost")
        s.checkpoint(tmp_path / "ck")
    with Sandbox.restore(tmp_path / "ck") as a, Sandbox.restore(tmp_path / "ck") as b:
        a.write_file("ws.txt", "a")
        assert b.read_file("ws.txt") == "saved" and a.read_file("ws.txt") == "a"
        assert b.exec(["test", "-e", "/tmp/mem.txt"]).rc == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_limit_kills_only_the_sandbox(backend):
    with Sandbox.create(backend=backend, limits=Limits(mem_mb=128)) as s:
        r = s.exec(["python3", "-c", "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); print('ALLOCATED')"])
        assert r.rc == KILLED_RC and "ALLOCATED" not in r.stdout, r
        assert "memory limit" in r.stderr
        if backend == "bwrap":  # only the offending process died
            assert s.exec("echo alive").stdout == "alive\n"
        else:  # the gVisor Sentry is one host process: the whole sandbox died
            assert not s.alive()
            with pytest.raises(SandboxError):
                s.exec("true")
    assert Path("/proc/self").exists()  # the host (this process) survived


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_contained(backend):
    with Sandbox.create(backend=backend, limits=Limits(pids=32, wall_s=20)) as s:
        r = s.exec(["bash", "-c", ":(){ :|:& };: ; sleep 100"], timeout=2.0)
        assert r.timed_out and r.rc == TIMEOUT_RC
        # the bomb is gone and the sandbox is usable again (zombies are reaped by the init)
        assert _wait_for(lambda: s.exec("echo ok").stdout == "ok\n", timeout=10, step=0.2)
        assert _wait_for(lambda: _count_procs(s) <= 3, timeout=10, step=0.2)  # init (+ bwrap's PID 1), the probe


def test_bwrap_cpu_limit():
    with Sandbox.create(backend="bwrap", limits=Limits(cpu_s=1)) as s:
        r = s.exec("while :; do :; done", timeout=15)
        assert not r.timed_out and r.rc in (128 + 9, 128 + 24), r  # SIGKILL / SIGXCPU at RLIMIT_CPU


def _leftovers() -> dict[str, set]:
    pid = os.getpid()
    kids = set()
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        kids |= set(Path(task).read_text().split())
    return {"children": kids,
            "mounts": set(Path("/proc/self/mounts").read_text().splitlines()),
            "cgroups": set(glob.glob(f"/sys/fs/cgroup/**/k3-sbx-*{pid}-*", recursive=True)),
            "tmp": set(glob.glob(f"{tempfile.gettempdir()}/k3-*-{pid}-*"))}


def _live_sandboxes() -> list:
    """Diagnostics for a leak: unclosed Sandbox objects and what refers to them."""
    live = [o for o in gc.get_objects() if type(o) is Sandbox and not o.closed]
    return [(o, [type(r) for r in gc.get_referrers(o)]) for o in live]


@pytest.mark.parametrize("backend,cycles", [("bwrap", 200), ("runsc", 3)])
def test_cycles_leave_nothing_behind(backend, cycles):
    before = _leftovers()
    for i in range(cycles):
        with Sandbox.create(backend=backend) as s:
            assert s.exec(f"echo {i}; sleep 30 >/dev/null 2>&1 &").stdout == f"{i}\n"
    s = Sandbox.create(backend=backend)  # dropped without close(): the finalizer cleans up
    s.exec("true")
    del s
    gc.collect()
    after = _leftovers()
    for key in before:
        assert after[key] - before[key] == set(), (key, _live_sandboxes())


def test_auto_picks_runsc_and_bad_input():
    assert runsc_usable()
    with Sandbox.create() as s:
        assert s.backend == "runsc"
    with pytest.raises(SandboxError):
        Sandbox.create(backend="docker")
    with pytest.raises(SandboxError):
        Limits(mem_mb=1)
    with pytest.raises(SandboxError):
        Sandbox.restore("/nonexistent")
    with pytest.raises(SandboxError):
        Sandbox.create(backend="bwrap", workspace="/nonexistent/ws")
    s = Sandbox.create(backend="bwrap")
    with pytest.raises(SandboxError):
        s.exec([])
    s.close()
    s.close()
    with pytest.raises(SandboxError):
        s.exec("true")


def test_async_api():
    async def main():
        async with await Sandbox.acreate(backend="bwrap") as s:
            rs = await asyncio.gather(*(s.aexec(f"echo {i}") for i in range(4)))
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(4)]
            await s.awrite_file("x", "y")
            assert await s.aread_file("x") == "y"
            await s.apause()
            await s.aresume()
            async with await s.afork() as f:
                assert await f.aread_file("x") == "y"
    asyncio.run(main())
