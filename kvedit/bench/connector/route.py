"""`kvedit bench route`: routing by KV events with an existing router (vLLM's router,
`vllm-router` on PyPI, run as it ships), two vLLMs each with its own kvedit server.

Why: a router that reads vLLM's KV events can send a repeated prefix to the engine whose cache
holds it; with the connector's events ("kv_events") it also sees what each engine's kvedit
server holds (medium CPU), not only vLLM's own blocks. This runs the same workload through the
router under each policy (fresh router, caches emptied between arms) and reports the share of
prompt tokens served from a cache and the latency of each request (max_tokens=1: its TTFT).

Workload: `docs` documents of `doc_tokens` random tokens, then `rounds` rounds over them in a
fresh shuffled order, each request (token ids: the router reads them) a document and a new
16-token question, `concurrency` requests in flight (so a router that knows nothing spreads
new documents over both engines by load; one at a time, every tie goes to the first engine).
Each vLLM's KV cache holds about `gpu_docs` documents, so it evicts; store mode "evict" puts
what it evicts into that engine's kvedit server.
Arms: round_robin; kv_aware (the router's event-driven policy, vLLM's GPU events and the
connector's CPU events); kv_aware_gpu_only (the same engines, the CPU events taken out of the
stream between vLLM and the router: what a router sees without the connector's events).
vLLM's publisher binds only wildcard TCP or ipc endpoints and vllm-router connects only to
TCP: each engine publishes on ipc, and a forwarder here binds 127.0.0.1 for the router (and
drops the CPU events in the gpu_only arm). Needs the router's Python package and its
dependencies (orjson): `--router-path DIR[:DIR...]` (prepended to the router's PYTHONPATH,
e.g. a `pip install --target` of the vllm-router wheel) or vllm_router importable.
"""
from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import msgspec
import zmq

from kvedit.bench.http import get_text, post_json
from kvedit.harness.kv_index import decode_batch
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.launch.process_group import spawn_group, stop_group
from kvedit.launch.server import free_port, start_server
from kvedit.launch.vllm import kv_transfer_config, start_vllm

BLOCK = 128              # vLLM's block size on the CPU
BLOCK_BYTES = 512 << 10  # one block of the tiny model's KV in float32


def run(args, arms: list[str]) -> int:
    """`kvedit bench route` with `arms` (of cli.ARMS, checked there)."""
    result = route_bench(args.docs, args.doc_tokens, args.rounds, args.gpu_docs, arms,
                         args.router_path, args.concurrency)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _documents(n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`n` documents of `tokens` random token ids (vllm-router reads token-id prompts; it
    does not tokenize text for HTTP workers: its log says "missing_tokens")."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(tokens)] for _ in range(n)]


class Forwarder:
    """vLLM's PUB (ipc) -> a PUB bound on 127.0.0.1 for the router, batch by batch as sent;
    with `drop_cpu`, the CPU-medium events are taken out of each batch (re-encoded)."""

    def __init__(self, source: str, drop_cpu: bool):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.drop_cpu, self.dropped = drop_cpu, 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="kv-forward")
        self.thread.start()

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while not self._stop:
            if not self.sub.poll(100):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            if self.drop_cpu:
                batch = decode_batch(payload)
                kept = [e for e in batch.events if getattr(e, "medium", None) != "CPU"]
                self.dropped += len(batch.events) - len(kept)
                batch.events = kept
                payload = enc.encode(batch)
            self.pub.send_multipart([topic, seq, payload])

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.ctx.destroy(linger=0)


def _router(workers: dict[str, str], policy: str, model_dir, router_path: str | None,
            log_path: str):
    """vllm-router on a free loopback port -> (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *workers, "--policy", policy]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model_dir)]
        for worker, endpoint in workers.items():
            cmd += ["--kv-event-source", f"{worker}={endpoint}"]
    env = dict(os.environ)
    if router_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (router_path, env.get("PYTHONPATH"))
                                            if p)
    log = open(log_path, "w")
    proc = spawn_group(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n"
                               f"{open(log_path).read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"vllm-router did not answer {url}/health in 120 s")


def route_bench(n_docs: int, doc_tokens: int, rounds: int, gpu_docs: float, arms: list[str],
                router_path: str | None, concurrency: int = 2) -> dict:
    model_dir = default_tiny_model()
    docs = _documents(n_docs, doc_tokens)
    max_len = doc_tokens + 256
    blocks = max(int(gpu_docs * doc_tokens / BLOCK) + 1, -(-max_len // BLOCK) + 1)
    pool_gb = 2 * n_docs * doc_tokens * BLOCK_BYTES / BLOCK / 2**30 + 0.02   # every doc, twice
    out: dict = {"docs": n_docs, "doc_tokens": doc_tokens, "rounds": rounds,
                 "concurrency": concurrency, "vllm_kv_blocks": blocks, "block_size": BLOCK,
                 "router": _router_version(router_path), "arms": {}}
    with tempfile.TemporaryDirectory(prefix="kvedit-route-") as d, ExitStack() as stack:
        servers = [stack.enter_context(start_server(pool_gb, chunk_size=256)) for _ in range(2)]
        engines = [stack.enter_context(_engine(model_dir, s, f"ipc://{d}/e{i}", blocks,
                                               max_len)) for i, s in enumerate(servers)]
        print("kvedit bench route: engines up", file=sys.stderr)
        for vp in engines:   # one-off costs of the first requests, before any arm
            for doc in _documents(2, doc_tokens, seed=99):
                post_json(vp.base_url + "/v1/completions",
                          {"model": "tiny", "prompt": doc, "max_tokens": 1})
        for arm in arms:
            _empty(engines, servers)
            fwds = [Forwarder(f"ipc://{d}/e{i}-pub", drop_cpu=arm.endswith("gpu_only"))
                    for i in range(2)]
            policy = "round_robin" if arm == "round_robin" else "kv_aware"
            time.sleep(1.0)   # the forwarders' subscriptions are in place
            before = [_metrics(vp) for vp in engines]
            proc, url = _router({vp.base_url: f.endpoint for vp, f in zip(engines, fwds)},
                                policy, model_dir, router_path, f"{d}/router-{arm}.log")
            try:
                res = _workload(url, docs, rounds, concurrency)
            finally:
                stop_group(proc, timeout=10)
                for f in fwds:
                    f.close()
            after = [_metrics(vp) for vp in engines]
            res["engines"] = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]
            res["cpu_events_dropped"] = sum(f.dropped for f in fwds)
            out["arms"][arm] = res
            print(f"kvedit bench route: {arm} done", file=sys.stderr)
    return _ratios(out)


def _engine(model_dir, server, prefix: str, blocks: int, max_len: int):
    conn = kv_transfer_config(server.url, server.http_url, store=None,
                              extra_config={"kv_events": True})
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"{prefix}-pub",
          "replay_endpoint": f"{prefix}-replay"}
    return start_vllm(model_dir, server=None, served_model_name="tiny", dtype="float32",
                      kv_cache_gib=None, max_model_len=max_len, dev_mode=True,
                      extra_args=["--kv-transfer-config", conn, "--kv-events-config",
                                  json.dumps(ev), "--kv-cache-memory-bytes",
                                  str(blocks * BLOCK_BYTES)])


def _empty(engines, servers) -> None:
    """Each arm starts cold: vLLM's prefix caches and the kvedit servers emptied."""
    for vp in engines:
        post_json(vp.base_url + "/reset_prefix_cache", {})
    for s in servers:
        httpx.delete(s.http_url + "/cache", timeout=30).raise_for_status()


def _metrics(vp) -> dict[str, float]:
    """vLLM's counters of one engine: requests, prompt tokens, hits in its own prefix cache
    and from the connector (the kvedit tier)."""
    text = get_text(vp.base_url + "/metrics", timeout=30)
    names = {"requests": "vllm:request_success_total",
             "prompt_tokens": "vllm:prompt_tokens_total",
             "local_hit_tokens": "vllm:prefix_cache_hits_total",
             "kvedit_hit_tokens": "vllm:external_prefix_cache_hits_total"}
    out = {}
    for key, name in names.items():
        vals = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[key] = sum(float(v) for v in vals)
    return out


def _workload(url: str, docs: list[list[int]], rounds: int, concurrency: int,
              seed: int = 1) -> dict:
    """Rounds over the documents in shuffled order, `concurrency` requests in flight (a
    request's latency with max_tokens=1 is its TTFT); round 0 meets every document for the
    first time. The same requests, in the same order, for every arm."""
    rng = random.Random(seed)
    todo = []
    for r in range(rounds):
        order = list(range(len(docs)))
        rng.shuffle(order)
        todo += [(r, docs[i] + [rng.randrange(10, 8000) for _ in range(16)]) for i in order]

    def one(job):
        r, prompt = job
        t0 = time.perf_counter()
        res = post_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0})
        dt = time.perf_counter() - t0
        usage = res["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return r, dt, usage["prompt_tokens"], cached

    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, todo))
    rep = [x for x in rows if x[0] >= 1]
    med = statistics.median
    hits = [x[1] for x in rep if x[3] > 0]
    misses = [x[1] for x in rep if x[3] == 0]
    return {"requests": len(rows),
            "repeat_cached_share": sum(x[3] for x in rep) / max(1, sum(x[2] for x in rep)),
            "repeat_ttft_median_s": med(x[1] for x in rep) if rep else None,
            "repeat_ttft_mean_s": statistics.fmean(x[1] for x in rep) if rep else None,
            "repeat_hits": len(hits), "repeat_misses": len(misses),
            "hit_ttft_median_s": med(hits) if hits else None,
            "miss_ttft_median_s": med(misses) if misses else None,
            "first_round_ttft_median_s": med(x[1] for x in rows if x[0] == 0)}


def _router_version(router_path: str | None) -> str:
    env = dict(os.environ)
    if router_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (router_path, env.get("PYTHONPATH"))
                                            if p)
    r = subprocess.run([sys.executable, "-c", "import vllm_router.launch_router; from "
                        "vllm_router.version import __version__ as v; print(v)"],
                       capture_output=True, text=True, env=env, timeout=60)
    if r.returncode:
        raise RuntimeError("kvedit bench route needs vLLM's router and its dependencies "
                           "(pip install vllm-router, or --router-path DIR[:DIR...]): "
                           f"{r.stderr.strip()[-300:]}")
    return f"vllm-router {r.stdout.strip()}"


def _ratios(out: dict) -> dict:
    arms = out["arms"]
    rr = arms.get("round_robin")
    for name, res in arms.items():
        if rr and name != "round_robin" and rr["repeat_ttft_median_s"]:
            res["repeat_ttft_vs_round_robin"] = (res["repeat_ttft_median_s"]
                                                 / rr["repeat_ttft_median_s"])
    return out
