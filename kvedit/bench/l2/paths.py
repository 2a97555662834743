"""The paths `kvedit bench l2` measures, shared by its single-Redis and --cluster modes: a pair
of kvedit servers on one L2 (A stores and writes behind, B promotes into an empty L1), the
two-engine L2-hit TTFT, and the Qwen3-8B-shaped chunks. A module of its own so both modes call
the same paths (nothing re-implemented) without importing each other.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from contextlib import ExitStack

import torch

from kvedit.bench.connector.calls import complete_one as _complete
from kvedit.client import KVClient
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.launch.server import start_server
from kvedit.launch.vllm import start_vllm
from kvedit.layout import ModelLayout
from kvedit.server.l2_redis import RedisChunks, layout_tag, redis_key


def qwen3_8b_layout():
    return ModelLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                       chunk_size=256)


def random_chunks(layout, n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-2**15, 2**15 - 1, layout.chunk_shape, generator=g,
                          dtype=torch.int16).view(torch.bfloat16) for _ in range(n)]


def wait_counter(client, name: str, value: int, timeout: float = 300.0,
                  poll: float = 0.02) -> None:
    """Until the server's stats show counter `name` >= value (ZMQ Stats, an O(1) call, every
    `poll` s: rarely, as each one takes the server's GIL and lock from the writer thread)."""
    deadline = time.monotonic() + timeout
    while client.stats()[name] < value:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench l2: {name} stayed below {value}: {client.stats()}")
        time.sleep(poll)


class ServerPair:
    """Two kvedit servers on one L2 URL: A stores (and writes behind), B starts with an empty
    L1 and promotes from L2. `round()` is one store on A until written and one lookup on B
    that promotes every chunk; both paths are the servers' own (nothing re-implemented)."""

    def __init__(self, url: str, layout, n: int):
        self.url, self.layout, self.n = url, layout, n
        pool_gb = (n * layout.chunk_bytes) / 2**30 + 0.25
        args = ["--l2-url", url, "--l2-write-queue-mb", str(2 * n * 36 + 64),
                "--l2-lookup-wait", "60"]
        self._stack = ExitStack()
        try:
            a = self._stack.enter_context(start_server(pool_gb, extra_args=args))
            b = self._stack.enter_context(start_server(pool_gb, extra_args=args))
            self.ca = self._stack.enter_context(KVClient(a.url))
            self.cb = self._stack.enter_context(KVClient(b.url, timeout=120))
            self.l2 = RedisChunks(url, timeout=30)
            self._stack.callback(self.l2.close)
        except BaseException:
            self._stack.close()
            raise
        for c in (self.ca, self.cb):
            c.register("bench", layout)
        self.tag, self.written = layout_tag(layout), 0

    def round(self, data: list) -> dict:
        """-> store_s (the writer's own time for the commit), until_in_l2_s (the client's
        store plus the write-behind), fetch_s (B's lookup promoting every chunk), rkeys."""
        n = self.n
        keys = [os.urandom(16) for _ in range(n)]
        busy = self.ca.stats()["l2_write_seconds"]
        t0 = time.perf_counter()
        self.ca.store("bench", keys, data)          # one commit: the writer takes it from here
        self.written += n
        wait_counter(self.ca, "l2_writes", self.written)
        until_in_l2 = time.perf_counter() - t0
        store_s = self.ca.stats()["l2_write_seconds"] - busy   # the writer's own time
        t0 = time.perf_counter()                    # promotion: B's L1 is empty
        got = self.cb.lookup("bench", keys)
        fetch_s = time.perf_counter() - t0
        if got != n:   # say why: B's tier down (a node timed out), misses, corrupt reads
            st = self.cb.stats()
            why = ", ".join(f"{k}={st[k]}" for k in ("l2_up", "l2_outages", "l2_errors",
                                                      "l2_misses", "l2_corrupt"))
            raise RuntimeError(f"bench l2: promoted {got} of {n} chunks from {self.url} "
                               f"(server B: {why})")
        with self.cb.retrieve("bench", keys[:1]) as got1:   # spot check: byte-exact
            if not torch.equal(got1.tensors[0].view(-1).view(torch.int16),
                               data[0].view(-1).view(torch.int16)):
                raise RuntimeError("bench l2: a promoted chunk differs from the stored one")
        return {"store_s": store_s, "until_in_l2_s": until_in_l2, "fetch_s": fetch_s,
                "keys": keys, "rkeys": [redis_key("kvedit", "bench", self.tag, 0, k)
                                        for k in keys]}

    def forget(self, r: dict) -> None:
        """Drop a round's chunks from both servers and from L2."""
        self.ca.delete("bench", r["keys"])
        self.cb.delete("bench", r["keys"])
        for rk in r["rkeys"]:
            self.l2.delete(rk)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ServerPair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ttft_two_engines(url: str, tokens: int = 4096, rounds: int = 4) -> dict:
    """Prompts prefilled on engine A (server A) are served to engine B (server B, empty
    memory) from L2, vs fresh prompts recomputed on B, in alternation. One vLLM at a time
    (A stops before B starts): the hand-off goes through Redis alone."""
    model = default_tiny_model()
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(tokens)]

    kw = dict(max_model_len=max(8192, tokens + 16), dtype="float32", dev_mode=True,
              kv_cache_gib=0.5)
    args = ["--l2-url", url, "--l2-lookup-wait", "1.5"]
    prompts = [fresh() for _ in range(rounds)]
    hit, recompute, cached = [], [], []
    with start_server(1.0, extra_args=args) as sa, start_server(1.0, extra_args=args) as sb, \
            KVClient(sa.url) as ca, KVClient(sb.url) as cb:
        with start_vllm(model, server=sa, **kw) as va:
            for p in prompts:                      # prefill on A: stored, written behind
                _complete(va, p)
            wait_counter(ca, "l2_writes", rounds * (tokens // 256))
        with start_vllm(model, server=sb, **kw) as vb:
            print("kvedit bench l2: engine B up, measuring", file=sys.stderr)
            _complete(vb, fresh())                 # warm-up
            for p in prompts:
                recompute.append(_complete(vb, fresh())[0])
                dt, usage = _complete(vb, p)       # B has never seen p: its chunks from L2
                hit.append(dt)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            promoted = cb.stats()["l2_hits"]
    med = statistics.median
    return {"ttft_prompt_tokens": tokens, "ttft_model": "tiny-qwen3 (float32, CPU)",
            "l2_hit_ttft_median_s": med(hit), "recompute_ttft_median_s": med(recompute),
            "l2_hit_cached_tokens": min(cached), "l2_chunks_promoted_on_b": promoted,
            "l2_hit_ttft_vs_recompute": med(h / r for h, r in zip(hit, recompute))}
