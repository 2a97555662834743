"""Start a `kvedit server` process on free ports (benchmarks, evals, experiments, tests).

Secure by default: `start_server()` with no secret lets the server make its own, private to
this user (the runtime directory, kvedit/rundir.py), where this process's clients, the SDK
and a vLLM connector of this user find it; any other local user can neither read nor poison
the KV (an open server used to be the default here). `insecure=True` asks for an open one
(`--insecure`); the test suite speaks the raw protocol and sets OPEN_BY_DEFAULT.
Such a server serves one user's run, so by default one client session may pin the whole
pool (`client_pool_fraction=1`: an SDK batch or a bench sizes the pool to what it holds at
once); the server's own default, a quarter, guards a server that several users share.
The server dies with its launcher, from whatever thread it was started: it watches its end
of a pipe whose other end only this process holds (`--exit-with-fd`), and the kernel closes
that when this process ends, however it ends (the parent-death signal of spawn_tied follows
the thread that started it).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvedit import rundir
from kvedit.auth import SECRET_ENV, SECRET_FILE_ENV
from kvedit.launch.process_group import spawn_tied

OPEN_BY_DEFAULT = False   # start_server(insecure=None) runs --insecure (the test suite's)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, and not one this process was handed before: the kernel may give the
    same ephemeral port to two calls in a row (both picked before either is bound), and a
    server then fails with "Address already in use" (seen in CI: a test's data port and
    the server's HTTP port were one port)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.add(port)
    return port


class ServerProcess:
    """A running server; `.stop()` ends it (SIGTERM, then SIGKILL) and removes its segment.

    Its output goes to `.log_path` (kept when the server did not stop cleanly)."""

    def __init__(self, args: list[str], host: str, port: int, http_port: int, shm_name: str,
                 startup_timeout: float = 30.0, secret_file: str | None = None,
                 env: dict[str, str] | None = None, made_secret: bool = False):
        self._args, self._startup_timeout = args, startup_timeout
        self.secret_file = secret_file   # what a client passes as secret_file=
        self._env = env
        self._made_secret = made_secret  # the server makes its own: gone with stop()
        self._tie: int | None = None     # this process's end of the pipe the server watches
        self.host, self.port, self.http_port, self.shm_name = host, port, http_port, shm_name
        self.url = f"tcp://{host}:{port}"
        self.http_url = f"http://{host}:{http_port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"kvedit-server-{port}-", suffix=".log")[1])
        self._start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _start(self) -> None:
        watched, self._tie = os.pipe()   # both close-on-exec; the child gets `watched` only
        cmd = [sys.executable, "-m", "kvedit.server.cli", *self._args,
               "--exit-with-fd", str(watched)]
        try:
            with open(self.log_path, "ab") as logf:
                self.proc = spawn_tied(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=self._env,
                                       pass_fds=(watched,))
        except BaseException:
            self._untie()
            raise
        finally:
            os.close(watched)
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvedit server exited with {self.proc.returncode} at start:"
                                   f"\n{self.log()}")
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=1) as r:  # open
                    if json.load(r).get("status") == "ok":
                        self._found_secret()
                        return
            except OSError:
                pass
            time.sleep(0.05)  # waiting for a child process to come up, not for data
        self.stop()
        raise RuntimeError(f"kvedit server did not answer {self.http_url}/health within "
                           f"{self._startup_timeout} s:\n{self.log()}")

    def _found_secret(self) -> None:
        """A server that made its own secret: where its clients find it (secret_file)."""
        if self._made_secret:
            found = rundir.lookup(self.url)
            self.secret_file = str(found[1]) if found else None

    def _untie(self) -> None:
        if self._tie is not None:
            os.close(self._tie)
            self._tie = None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (clean shutdown), SIGKILL after `timeout`. Returns the exit code. The
        secret the server made is removed (its port is one of many free ones)."""
        rc = self._stop(timeout)
        if self._made_secret:
            rundir.withdraw(self.port)
        return rc

    def _stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        self._untie()
        if rc == 0:  # a clean stop: the log holds nothing worth keeping
            self.log_path.unlink(missing_ok=True)
        elif self.shm_name and os.path.exists(f"/dev/shm/{self.shm_name}"):
            os.unlink(f"/dev/shm/{self.shm_name}")  # the killed server could not do it
        return rc

    def kill(self) -> None:
        """SIGKILL, leaving a stale segment behind (for crash tests)."""
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self._untie()

    def restart(self) -> None:
        """Stop and start again with the same ports and flags (a new, empty server; a secret
        it made is reused)."""
        self._stop()
        self._start()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(l1_size_gb: float = 1.0, *, chunk_size: int = 256, shm: bool = True,
                 eviction: str = "LRU", lazy: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, http_port: int | None = None,
                 secret_file: str | os.PathLike | None = None, secret: str | None = None,
                 insecure: bool | None = None, client_pool_fraction: float | None = 1.0,
                 extra_args=()) -> ServerProcess:
    """A server on free ports. `secret_file` (or `secret`, passed through $KVEDIT_SECRET so it
    is not on the command line) gives it that secret; without either the child does not
    inherit $KVEDIT_SECRET/$KVEDIT_SECRET_FILE from this process by accident and makes a
    secret of its own in this user's runtime directory (kvedit.rundir: this user's clients
    find it; `.secret_file` names it), unless `insecure` (None: OPEN_BY_DEFAULT) asks for
    a server open to every local user (`--insecure`). `client_pool_fraction`: the server's
    --max-client-pool-fraction (None: the server's default)."""
    port = port or free_port()
    http_port = http_port or free_port()
    while http_port == port:
        http_port = free_port()
    shm_name = f"kvedit-{os.getpid()}-{port}" if shm else ""
    args = ["--l1-size-gb", str(l1_size_gb), "--chunk-size", str(chunk_size),
            "--eviction", eviction, "--host", host, "--port", str(port),
            "--http-port", str(http_port), "--shm-name", shm_name,
            "--l1-use-lazy" if lazy else "--no-l1-use-lazy"]
    if client_pool_fraction is not None:
        args += ["--max-client-pool-fraction", str(client_pool_fraction)]
    args += extra_args   # last: a flag given twice, the last one wins
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    made = False
    if secret_file is not None:
        args += ["--secret-file", os.fspath(secret_file)]
    elif secret is not None:
        env[SECRET_ENV] = secret
    elif OPEN_BY_DEFAULT if insecure is None else insecure:
        args.append("--insecure")
    else:
        made = True
    server = ServerProcess(args, host, port, http_port, shm_name, env=env,
                           secret_file=secret_file and os.fspath(secret_file),
                           made_secret=made)
    server.secret = secret
    return server
