"""`kvedit bench soak --restart-vllm`: the server restarted under a running vLLM (with the
kvedit connector) and an SDK client, everything on the default secret (the server makes it,
the clients find it in the runtime directory; nobody is given a secret file).

Requests keep going to vLLM (a fresh prompt each, its chunks stored as computed) and the SDK
client keeps looking keys up while the server stops and starts again on the same ports.
Measured from the moment the restarted server answers /health: when the SDK's calls succeed
again, when the connector's worker has registered the model again and its stores land, when
its scheduler follows the keys again (a key watch), and how many vLLM requests failed
(vLLM recomputes while the server is away: none should).
"""
from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvedit import auth
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.launch.server import ServerProcess, free_port
from kvedit.launch.vllm import start_vllm
from kvedit.sdk.context import connect

MODEL = "tiny-qwen3"


def env_with_rundir(rundir: Path) -> dict:
    """This process's environment for the run's processes: XDG_RUNTIME_DIR the run's private
    directory, no secret of its own (each finds the server's made one there)."""
    env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV,
                                                            auth.SECRET_FILE_ENV)}
    return env | {"XDG_RUNTIME_DIR": str(rundir)}


def made_secret_server(pool_gb: float, env: dict, extra: list[str]):
    """A server started as a user would start it: no secret flag (it makes one, or reuses the
    one its port left), on fixed ports (a restart keeps them, the data port too)."""
    port, http_port, data_port = free_port(), free_port(), free_port()
    shm = f"kvedit-soak-{os.getpid()}-{port}"
    srv = ServerProcess(["--l1-size-gb", str(pool_gb), "--port", str(port), "--http-port",
                         str(http_port), "--data-port", str(data_port), "--shm-name", shm,
                         *extra], "127.0.0.1", port, http_port, shm, env=env)
    srv.data_port = data_port
    return srv


def restart_under_vllm(down_s: float = 1.0, settle_s: float = 15.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvedit-restart-") as tmp:
        rundir = Path(tmp) / "run"
        rundir.mkdir(mode=0o700)
        env = env_with_rundir(rundir)
        srv = made_secret_server(0.25, env, [])
        secret_file = rundir / "kvedit" / f"{srv.port}.secret"
        try:
            with start_vllm(default_tiny_model(), server=srv, served_model_name=MODEL,
                            dtype="float32", kv_cache_gib=1, max_model_len=4096,
                            connector_config={"store": "eager"},
                            env={"XDG_RUNTIME_DIR": str(rundir)}) as vp:
                # the SDK finds the secret as a same-user client does: the port's file
                ctx = connect(srv.url, srv.http_url, MODEL, timeout=120,
                              secret_file=str(secret_file))
                try:
                    return _run(srv, vp, ctx, secret_file, down_s, settle_s) | {
                        "secret_reused": "reused the secret" in srv.log()}
                finally:
                    ctx.close()
        finally:
            srv.stop()


def _run(srv, vp, ctx, secret_file: Path, down_s: float, settle_s: float) -> dict:
    stop = threading.Event()
    vllm_log: list[tuple[float, bool]] = []
    sdk_log: list[tuple[float, bool]] = []
    rng = random.Random(0)

    def requests() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                prompt = [rng.randrange(1, 8000) for _ in range(600)]   # two chunks + a bit
                try:
                    r = http.post(vp.base_url + "/v1/completions", json={
                        "model": MODEL, "prompt": prompt, "max_tokens": 2,
                        "temperature": 0.0})
                    vllm_log.append((time.monotonic(), r.status_code == 200))
                except httpx.HTTPError:
                    vllm_log.append((time.monotonic(), False))

    def lookups() -> None:
        probe = [bytes(16)]
        while not stop.is_set():
            try:
                ctx.client.lookup(MODEL, probe)
                sdk_log.append((time.monotonic(), True))
            except Exception:   # noqa: BLE001 - counted: what the SDK saw
                sdk_log.append((time.monotonic(), False))
            time.sleep(0.05)

    threads = [threading.Thread(target=requests, daemon=True),
               threading.Thread(target=lookups, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(5)   # steady state before
    t_stop = time.monotonic()
    srv.stop()
    time.sleep(down_s)
    srv.restart()
    t_up = time.monotonic()
    got = _connector_back(srv, secret_file, t_up, settle_s)
    time.sleep(max(0.0, t_up + settle_s - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(120)

    def first_ok_after(log) -> float | None:
        return next((round(t - t_up, 3) for t, ok in log if t >= t_up and ok), None)

    after = [ok for t, ok in sdk_log if t >= t_up + 2.0]
    return got | {
        "server_down_s": round(t_up - t_stop, 3),
        "sdk_back_s": first_ok_after(sdk_log),
        "sdk_calls_from_2s": len(after), "sdk_failures_from_2s": after.count(False),
        "vllm_requests": len(vllm_log),
        "vllm_failures": sum(not ok for _, ok in vllm_log),
        "vllm_back_s": first_ok_after(vllm_log)}


def _connector_back(srv, secret_file: Path, t_up: float, settle_s: float) -> dict:
    """When, after t_up, the connector has registered the model, stored chunks and follows
    the keys with a watch again (from /status, polled)."""
    headers = auth.bearer_header(auth.load_secret(None, secret_file))
    out = {"connector_registered_s": None, "connector_storing_s": None,
           "connector_watching_s": None}
    with httpx.Client(base_url=srv.http_url, headers=headers, timeout=5) as http:
        while time.monotonic() < t_up + settle_s and None in out.values():
            st = http.get("/status").json()
            now = round(time.monotonic() - t_up, 3)
            if out["connector_registered_s"] is None and MODEL in st["models"]:
                out["connector_registered_s"] = now
            if out["connector_storing_s"] is None and st["objects"]["ready"] > 0:
                out["connector_storing_s"] = now
            if out["connector_watching_s"] is None and st["counters"]["key_watches"] > 0:
                out["connector_watching_s"] = now
            time.sleep(0.05)
    return out
