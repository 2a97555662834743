"""L2 records that whoever can write to Redis cannot forge (kvedit/server/l2_redis.py, --l2-mac).

Reproduction of an outside red-team run: with a secret set and an L2 Redis without a
password (the `make setup` default), any local user could write a re-checksummed poisoned
record that a server promoted into L1 as is. Now such a server warns at start, and with
--l2-mac a record must carry an HMAC of the secret: a planted one is a miss.
"""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch

from kvedit import auth
from kvedit.client import KVClient
from kvedit.launch.redis import INSTALL_HINT, redis_server_path
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key, matches

pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")
# slow: every test starts its own redis-server and kvedit servers (~1.5-2.5 s each)
pytestmark = [pytest.mark.skipif(redis_server_path() is None, reason=INSTALL_HINT),
              pytest.mark.slow]
OPEN_L2 = "has no password and no TLS"


def _counters(server, secret: bytes) -> dict:
    req = urllib.request.Request(server.http_url + "/status", headers=auth.bearer_header(secret))
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["counters"]


def _wait_written(server, secret: bytes, n: int) -> None:
    end = time.monotonic() + 30
    while _counters(server, secret)["l2_writes"] < n:
        assert time.monotonic() < end, _counters(server, secret)
        time.sleep(0.05)


def _plant(url: str, k: bytes, mac_key: bytes | None) -> None:
    """Write a poisoned record for `k` the way a local user without the secret can: a valid
    checksum (plain format), or the MAC'd format with a MAC of a guessed key."""
    from kvedit.server.l2_redis import RedisChunks, layout_tag, redis_key
    rc = RedisChunks(url, timeout=5, mac_key=mac_key)
    try:
        poison = torch.full(SMALL.chunk_shape, 666.0, dtype=torch.float32)
        rc.put(redis_key("kvedit", "m", layout_tag(SMALL), 0, k),
               poison.numpy().reshape(-1).view("u1"))
    finally:
        rc.close()


def test_records_without_the_secret_s_mac_are_not_promoted(redis_srv, tmp_path):
    secret_file = tmp_path / "secret"
    secret = auth.generate_secret(secret_file)
    flags = ["--l2-url", redis_srv.url, "--l2-mac"]
    ks = [key(i, "mac") for i in range(3)]
    with start_server(0.05, secret_file=secret_file, extra_args=flags) as a, \
            KVClient(a.url, secret_file=secret_file) as ca:
        assert OPEN_L2 not in a.log()   # the MAC is the answer to an open Redis
        ca.register("m", SMALL)
        ca.store("m", ks, [chunk_for(k) for k in ks])
        _wait_written(a, secret, 3)
    _plant(redis_srv.url, ks[1], None)            # re-checksummed, plain format
    _plant(redis_srv.url, ks[2], b"g" * 32)       # MAC'd format, guessed key
    with start_server(0.05, secret_file=secret_file, extra_args=flags) as b, \
            KVClient(b.url, secret_file=secret_file) as cb:
        cb.register("m", SMALL)
        assert cb.lookup("m", ks[:1]) == 1        # the honest record, promoted
        assert cb.lookup("m", ks[1:2]) == 0
        assert cb.lookup("m", ks[2:3]) == 0
        with cb.retrieve("m", ks[:1]) as r:
            assert matches(ks[0], r.tensors[0])
        c = _counters(b, secret)
        assert c["l2_hits"] == 1 and c["l2_corrupt"] == 1 and c["l2_misses"] >= 1, c


def test_a_secret_with_an_open_redis_is_warned_about(redis_srv, tmp_path):
    secret_file = tmp_path / "secret"
    auth.generate_secret(secret_file)
    with start_server(0.05, secret_file=secret_file,
                      extra_args=["--l2-url", redis_srv.url]) as s:
        assert OPEN_L2 in s.log() and "--l2-mac" in s.log()
    with start_server(0.05, extra_args=["--l2-url", redis_srv.url]) as s:   # --insecure
        assert OPEN_L2 not in s.log()
