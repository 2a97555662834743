"""Helpers of the L2 tests (tests/server/test_l2*.py): a kvedit server on an L2 URL, its
/status, waiting for the tier's background work, chunks read back from Redis through the
record format, the model they use."""
from __future__ import annotations

import json
import time
import urllib.request

import torch

from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.server.l2_redis import RedisChunks, layout_tag, redis_key
from tests.kv_helpers import SMALL, chunk_for, matches

CHUNK = SMALL.chunk_bytes                  # 256 KiB
POOL_4 = 4 * CHUNK / 2**30                 # an L1 of exactly four chunks (GiB)
MODEL = "m"


def l2_server(redis_url: str, pool_gb: float = 0.05, *extra: str):
    # one client fills these small pools on its own: no per-session share (quota.py)
    return start_server(pool_gb, extra_args=["--l2-url", redis_url,
                                             "--max-client-pool-fraction", "1", *extra])


def status(server) -> dict:
    with urllib.request.urlopen(server.http_url + "/status", timeout=10) as r:
        return json.load(r)


def wait_for(server, pred, timeout: float = 30.0) -> dict:
    """The server's /status once `pred(status["counters"])` holds (background work: the
    write-behind thread, the reconnect); fails with the last status."""
    deadline = time.monotonic() + timeout
    while True:
        s = status(server)
        if pred(s["counters"]):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {s['counters']}")
        time.sleep(0.02)


def in_redis(url: str, keys: list[bytes], model: str = MODEL) -> list[bool]:
    """Which keys Redis holds byte-exact (read back through the record format)."""
    rc = RedisChunks(url, timeout=5)
    try:
        rkeys = [redis_key("kvedit", model, layout_tag(SMALL), 0, k) for k in keys]
        out = []
        for k, rk, meta in zip(keys, rkeys, rc.probe(rkeys)):
            buf = torch.empty(SMALL.chunk_shape, dtype=torch.float32)
            ok = meta is not None and rc.read_into(rk, meta, buf.numpy().reshape(-1).view("u1"))
            out.append(bool(ok and matches(k, buf)))
        return out
    finally:
        rc.close()


def store(client: KVClient, keys: list[bytes]) -> None:
    client.register(MODEL, SMALL)
    client.store(MODEL, keys, [chunk_for(k) for k in keys])


def retrieved_match(client: KVClient, keys: list[bytes]) -> list[bool]:
    with client.retrieve(MODEL, keys) as got:
        return [matches(k, t) for k, t in zip(keys, got.tensors)]
