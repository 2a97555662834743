"""Start a `kvedit server` process on free ports (tests, benchmarks, the demo)."""
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

from kvedit.auth import SECRET_ENV, SECRET_FILE_ENV
from kvedit.launch.process_group import spawn_tied


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
                 env: dict[str, str] | None = None):
        self._args, self._startup_timeout = args, startup_timeout
        self.secret_file = secret_file   # what a client passes as secret_file=
        self._env = env
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
        cmd = [sys.executable, "-m", "kvedit.server.cli", *self._args]
        with open(self.log_path, "ab") as logf:
            self.proc = spawn_tied(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=self._env)
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvedit server exited with {self.proc.returncode} at start:"
                                   f"\n{self.log()}")
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=1) as r:  # open
                    if json.load(r).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.05)  # waiting for a child process to come up, not for data
        self.stop()
        raise RuntimeError(f"kvedit server did not answer {self.http_url}/health within "
                           f"{self._startup_timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (clean shutdown), SIGKILL after `timeout`. Returns the exit code."""
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

    def restart(self) -> None:
        """Stop and start again with the same ports and flags (a new, empty server)."""
        self.stop()
        self._start()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(l1_size_gb: float = 1.0, *, chunk_size: int = 256, shm: bool = True,
                 eviction: str = "LRU", lazy: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, http_port: int | None = None,
                 secret_file: str | os.PathLike | None = None, secret: str | None = None,
                 extra_args=()) -> ServerProcess:
    """A server on free ports. `secret_file` (or `secret`, passed through $KVEDIT_SECRET so it
    is not on the command line) turns authentication on; without either the child does not
    inherit $KVEDIT_SECRET/$KVEDIT_SECRET_FILE from this process by accident, and runs open
    to local users (`--insecure`: tests and benchmarks speak the raw protocol), where a bare
    `kvedit server` would make a secret of its own (kvedit.rundir)."""
    port = port or free_port()
    http_port = http_port or free_port()
    while http_port == port:
        http_port = free_port()
    shm_name = f"kvedit-{os.getpid()}-{port}" if shm else ""
    args = ["--l1-size-gb", str(l1_size_gb), "--chunk-size", str(chunk_size),
            "--eviction", eviction, "--host", host, "--port", str(port),
            "--http-port", str(http_port), "--shm-name", shm_name,
            "--l1-use-lazy" if lazy else "--no-l1-use-lazy", *extra_args]
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    if secret_file is not None:
        args += ["--secret-file", os.fspath(secret_file)]
    elif secret is not None:
        env[SECRET_ENV] = secret
    else:
        args.append("--insecure")
    server = ServerProcess(args, host, port, http_port, shm_name, env=env,
                           secret_file=secret_file and os.fspath(secret_file))
    server.secret = secret
    return server
