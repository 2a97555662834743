"""A child in its own process group that dies with its parent, and stopping all of it; a
single-process child (the kvedit server, redis-server) that dies with its parent too.

vLLM's API server spawns an engine-core process (and on CPU, workers); signalling only the
PID we started leaves those running, holding the port and gigabytes of memory. So:
- the child leads a new process group (not a new session: it stays on our terminal), and
  everything it spawns inherits that group, so one `killpg` reaches all of it;
- `stop_group` sends SIGTERM to the group, waits, then SIGKILLs whatever is left of it;
- as a backstop for when we are SIGKILLed and run no cleanup, the child asks the kernel
  (prctl PR_SET_PDEATHSIG) for SIGTERM when its parent thread dies; vLLM's API server then
  shuts its engine down itself.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int, sig: int, group: bool = True):
    """preexec_fn: new process group (unless not `group`); `sig` when the parent dies (Linux
    only)."""
    def setup() -> None:
        if group:
            os.setpgid(0, 0)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            return  # not Linux: only the group and stop_group remain
        if os.getppid() != parent:  # the parent died before prctl: nobody will signal us
            os.kill(os.getpid(), sig)
    return setup


def spawn_group(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen `cmd` as the leader of a new process group (its PID is the group id), with
    SIGTERM asked for when we die."""
    return _spawn(cmd, True, popen_kwargs)


def spawn_tied(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen `cmd`, a child that spawns nothing of its own (the kvedit server, redis-server),
    in our process group, with SIGTERM asked for when we die: a launcher SIGKILLed (by the
    OOM killer, say) leaves no server holding its memory and port."""
    return _spawn(cmd, False, popen_kwargs)


def _spawn(cmd: list[str], group: bool, popen_kwargs: dict) -> subprocess.Popen:
    """The parent-death signal fires when the *thread* that forked exits, so it is only asked
    for from the main thread (whose end is the process's end)."""
    if threading.current_thread() is threading.main_thread():
        preexec = _die_with(os.getpid(), signal.SIGTERM, group)
    else:
        preexec = (lambda: os.setpgid(0, 0)) if group else None
    return subprocess.Popen(cmd, preexec_fn=preexec, **popen_kwargs)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group `pgid`, from /proc. A zombie holds no port or
    memory, and where PID 1 does not reap orphans it may linger: it does not count."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parens, so split after ")".
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    if os.path.isdir("/proc/self"):
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists but is not ours
        return True


def stop_group(proc: subprocess.Popen, timeout: float = 30.0,
               sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the group `proc` leads; after `timeout` s SIGKILL what is left.

    Returns when the leader is reaped and no process of the group remains (or after a
    SIGKILL, which the kernel does not let them ignore)."""
    pgid = proc.pid
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            return
        time.sleep(0.2)
    # The engine core may still be cleaning up (or hung): what remains is killed.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    end = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.1)
