"""A real vLLM (tiny Qwen3, CPU) whose kvedit server's L2 is a real Redis Cluster (3 masters +
3 replicas), while a master is SIGKILLed mid-run and its replica promoted.

Requests keep coming: fresh prompts (prefilled, stored, written behind to the cluster) and
repeats whose chunks were dropped from the server's memory and vLLM's prefix cache, so the
connector's lookup falls through to the cluster. Checked: every request answers, a repeat
decodes exactly what its first run decoded (KV read from the cluster is right, or it was a
miss and vLLM recomputed), vLLM's log has no connector error, and repeats after the failover
load their chunks from the cluster again. Where the cluster cannot be made it skips.
"""
from __future__ import annotations

import random
import shutil
import threading
import time

import pytest

from kvedit.client import KVClient
from kvedit.keys import request_keys
from kvedit.launch.redis import INSTALL_HINT, redis_server_path
from kvedit.launch.server import start_server
from kvedit.launch.vllm import start_vllm
from tests.engine.test_connector import MODEL, complete, reset_prefix_cache

pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")
pytestmark = pytest.mark.skipif(redis_server_path() is None or shutil.which("redis-cli") is None,
                                reason=INSTALL_HINT)
CHUNK = 256


def test_engine_rides_through_a_master_failover(tiny_model):
    from kvedit.launch.redis_cluster import RedisClusterProcess

    rng = random.Random(7)
    with RedisClusterProcess() as cluster, \
            start_server(0.5, extra_args=["--l2-url", cluster.url, "--l2-timeout", "2"]) as s, \
            start_vllm(tiny_model, server=s, served_model_name=MODEL, dtype="float32",
                       kv_cache_gib=0.25, max_model_len=4096, chunk_size=CHUNK,
                       dev_mode=True) as vp, KVClient(s.url) as c:
        first: dict[int, list[int]] = {}
        prompts: list[list[int]] = []
        failures, repeats = [], []   # (index, loaded tokens, same output, after failover)
        failed_over = threading.Event()

        def request(i: int) -> None:
            if i < len(prompts):     # a repeat: gone from the server's memory and vLLM's cache
                keys = request_keys(MODEL, c.get_layout(MODEL), prompts[i], "")
                c.delete(MODEL, keys)
                reset_prefix_cache(vp)
                r = complete(vp, prompts[i])
                repeats.append((i, r["cached"], r["tokens"] == first[i], failed_over.is_set()))
                return
            prompts.append([rng.randrange(10, 8000) for _ in range(2 * CHUNK + 40)])
            first[i] = complete(vp, prompts[i])["tokens"]

        def run(stop: threading.Event) -> None:
            while not stop.is_set():
                try:   # fresh, then a repeat of one stored a while ago
                    request(len(prompts))
                    if len(prompts) > 3:
                        request(rng.randrange(len(prompts) - 3))
                except Exception as e:
                    failures.append(e)

        stop = threading.Event()
        t = threading.Thread(target=run, args=(stop,))
        t.start()
        try:
            deadline = time.monotonic() + 300
            while len(repeats) < 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            victim = cluster.masters()[0]
            on_victim = _key_on(cluster, victim, c.get_layout(MODEL))
            victim.kill()
            c.lookup(MODEL, [on_victim])   # its chunk lives on the victim: noticed at once
            cluster.wait_replaced(victim)
            victim.start()
            failed_over.set()
            deadline = time.monotonic() + 300
            while sum(r[3] for r in repeats) < 6 and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            stop.set()
            t.join(300)
        log = vp.log_tail(1_000_000)
        st = c.stats()
    assert failures == []                                          # every request answered
    assert all(same for _, _, same, _ in repeats), repeats         # never a wrong KV
    after = [r for r in repeats if r[3]]
    assert len(after) >= 6 and any(cached == 2 * CHUNK for _, cached, _, _ in after[-3:]), \
        repeats                                                    # the cluster serves again
    assert "Traceback" not in log and "call failed" not in log     # no connector error
    assert st["l2_outages"] >= 1 and st["l2_up"] == 1 and st["l2_corrupt"] == 0


def _key_on(cluster, node, layout) -> bytes:
    """A chunk key whose Redis keys the master `node` serves."""
    import os

    from kvedit.server.l2_redis import layout_tag, redis_key
    tag = layout_tag(layout)
    while True:
        k = os.urandom(16)
        if cluster.master_of(redis_key("kvedit", MODEL, tag, 0, k)).port == node.port:
            return k
