"""Start a throwaway redis-server on a free loopback port (tests, `kvedit bench l2`, the
two-engine example). Persistence is off (--save '' --appendonly no): a restart is empty, as a
crashed cache would be. Stopped by its PID, never by name."""
from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kvedit.launch.process_group import spawn_tied
from kvedit.launch.server import free_port

INSTALL_HINT = ("redis-server is not installed: `make setup` installs it when run as root "
                "(apt-get install -y redis-server), or install Redis/Valkey 7+ yourself")


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """A running redis-server; `.url` for clients, `.kill()` (SIGKILL), `.start()` again on the
    same port, `.stop()` (SIGTERM, then SIGKILL)."""

    def __init__(self, port: int | None = None, maxmemory_mb: int = 0,
                 startup_timeout: float = 10.0, password: str | None = None,
                 maxmemory_policy: str = "allkeys-lru", extra_args: tuple[str, ...] = (),
                 workdir: Path | None = None):
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError(INSTALL_HINT)
        self.exe, self.port = exe, port or free_port()
        self.maxmemory_mb = maxmemory_mb
        self.password = password
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = tuple(extra_args)   # a cluster node's options (redis_cluster.py)
        self.workdir = workdir                 # where a cluster node keeps its nodes.conf
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.startup_timeout = startup_timeout
        self.log_path = Path(tempfile.mkstemp(prefix=f"redis-{self.port}-", suffix=".log")[1])
        self.start()

    def start(self) -> None:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
                "--logfile", str(self.log_path)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb",
                     "--maxmemory-policy", self.maxmemory_policy]
        if self.workdir is not None:
            args += ["--dir", str(self.workdir)]
        self.proc = spawn_tied([*args, *self.extra_args], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1,
                             socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                       f"{self.log_path.read_text(errors='replace')[-2000:]}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.02)   # waiting for a child process to come up
            self.stop()
            raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                               f"{self.startup_timeout} s")
        finally:
            client.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL (a crash: the data is gone, the port frees)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: Redis hangs (connections stay open, nothing answers): a slow Redis."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # a paused one cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
