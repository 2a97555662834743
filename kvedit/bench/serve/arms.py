"""The arms of `kvedit bench serve`: how each one starts (its vLLM's flags and environment, a
kvedit server for the kvedit arms), and what a failed or degraded arm's log says.

A module of its own because this is the only place that knows what an arm is made of; the
run (run.py) starts them by name and measures them alike. The launchers are used through
their modules (`launch_vllm.start_vllm`), so a test can stand in for the processes.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvedit.launch import server as launch_server
from kvedit.launch import vllm as launch_vllm

MODEL_NAME = "bench"   # every arm's served model name, what the workloads ask for


class ArmUnavailable(Exception):
    """The arm could not start here; the message says why."""


@dataclass
class RunningArm:
    """One started arm: its vLLM, and the kvedit server's HTTP address for kvedit arms."""
    vllm: object                        # kvedit.launch.vllm.VllmProcess
    server_http_url: str | None = None

    @property
    def base_url(self) -> str:
        return self.vllm.base_url

    @property
    def log_path(self):
        return self.vllm.log_path

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.vllm.log_tail(n_chars)


def root_cause(log: str) -> str:
    """The first exception line of a failed vLLM's log (the root cause, not the re-raise)."""
    for line in log.splitlines():
        if " WARNING " in line or " INFO " in line:
            continue
        m = re.search(r"(?:^|\] |: )((?:[A-Za-z_.]+)?(?:Error|Exception): .+)$", line)
        if m and "Engine core initialization failed" not in m[1]:
            return m[1].strip()[:400]
    return log.strip().splitlines()[-1][:400] if log.strip() else "no log"


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def start_arm(arm: str, model_dir, *, tier_bytes: int, vllm_kv_bytes: int, dtype: str,
              max_model_len: int, chunk: int, eviction: str, lmcache_python: str | None,
              vllm_args, connector_config: dict | None = None):
    """Start the processes of one arm -> a RunningArm; ArmUnavailable if it cannot run.
    `connector_config`: more kv_connector_extra_config keys for a kvedit arm."""
    extra = ["--kv-cache-memory-bytes", str(vllm_kv_bytes), *vllm_args]
    tier_gib = tier_bytes / 2**30
    kw = dict(served_model_name=MODEL_NAME, dtype=dtype, kv_cache_gib=None,
              max_model_len=max_model_len, dev_mode=True)
    env: dict = {}
    python = None
    server_http = None
    stack = contextlib.ExitStack()
    with stack:
        if arm in ("native", "native_simple"):
            extra += ["--kv-offloading-backend", "native",
                      "--kv-offloading-size", f"{tier_gib:.6f}"]
            env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1" if arm == "native_simple" else "0"
        elif arm == "lmcache":
            python = lmcache_python or sys.executable
            _check_lmcache(python)
            extra += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
            env.update(LMCACHE_CHUNK_SIZE=chunk, LMCACHE_LOCAL_CPU="True",
                       LMCACHE_MAX_LOCAL_CPU_SIZE=f"{tier_bytes / 1e9:.6f}")
        elif arm.startswith("kvedit_"):
            server = stack.enter_context(launch_server.start_server(
                tier_gib, chunk_size=chunk, eviction=eviction))
            server_http = server.http_url
            # stats lines each second: measure reads them at its workload boundaries
            extra += ["--kv-transfer-config", launch_vllm.kv_transfer_config(
                server.url, server.http_url, chunk, store=arm.removeprefix("kvedit_"),
                extra_config={"stats_interval_s": 1.0, **(connector_config or {})})]
        with _env(**env):
            try:
                vp = stack.enter_context(launch_vllm.start_vllm(
                    model_dir, server=None, extra_args=extra, python=python, **kw))
            except RuntimeError as e:   # the whole log: the message has only its tail
                m = re.search(r"log (\S+\.log)", str(e))
                log = Path(m[1]).read_text(errors="replace") if m else str(e)
                raise ArmUnavailable(root_cause(log)) from None
        yield RunningArm(vp, server_http)


def degraded(log: str) -> str | None:
    """Why an arm that served did so without its cache (LMCache falls back to recomputing
    when it has no connector for the device), or None."""
    if "degraded mode" not in log:
        return None
    for line in log.splitlines():
        m = re.match(r"\s*(RuntimeError|ImportError|Exception): (.+)$", line)
        if m:
            return f"{m[1]}: {m[2]}"[:400]
    return "LMCache reported degraded mode (recompute)"


def _check_lmcache(python: str) -> None:
    r = subprocess.run([python, "-c", "import lmcache, vllm; print(vllm.__version__)"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise ArmUnavailable(f"lmcache does not import with {python} ({root_cause(r.stderr)});"
                             f" pass --lmcache-python with an interpreter where it does")
