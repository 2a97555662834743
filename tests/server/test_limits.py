"""Issue 9 items 3-6: every resource a client can make the server hold is bounded, and the
numbers the server reports come from one source.

Reproductions against a real server process with small limits given as flags.
"""
from __future__ import annotations

import re
import secrets

import httpx
import pytest

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.fixtures_server import (ask, call, close_dealer, dealer, session_dealer, status,
                                   wait_until)
from tests.kv_helpers import SMALL, chunk_for, key

MAX_MODELS = 30
FLAGS = ["--max-models", str(MAX_MODELS), "--max-model-name", "64",
         "--max-keys-per-request", "1000", "--max-message-bytes", str(4 << 20),
         "--max-waits-per-client", "3", "--max-waits-total", "5", "--max-wait-seconds", "60"]


@pytest.fixture(scope="module")
def server():
    with start_server(16 * SMALL.chunk_bytes / 2**30, extra_args=FLAGS) as s:
        with KVClient(s.url) as c:
            c.register("m", SMALL)
        yield s


def _error(sock, msg) -> P.Error:
    reply = call(sock, msg)
    assert isinstance(reply, P.Error), reply
    return reply


def test_long_model_names_are_refused_with_a_short_reply(server):
    d = dealer(server.url)
    try:
        rid, reply = ask(d, b"1", P.encoder.encode(P.Register(model="x" * (1 << 20),
                                                                layout=SMALL)))
        assert isinstance(reply, P.Error) and reply.code == "name_too_long"
        assert len(reply.message) < 200 and "--max-model-name" in reply.message
        # an unknown model named with 1 MiB is quoted back truncated, not in full
        reply = _error(d, P.Lookup(model="y" * (1 << 20), keys=[key(0)]))
        assert reply.code == "unknown_model" and len(reply.message) < 2000
    finally:
        close_dealer(d)
    assert status(server)["models"] == 1


def test_model_count_is_bounded_listed_briefly_and_unregister_frees(server):
    d = dealer(server.url)
    try:
        for i in range(MAX_MODELS - 1):
            assert isinstance(call(d, P.Register(model=f"model-{i:02d}", layout=SMALL)), P.Ok)
        reply = _error(d, P.Register(model="one-too-many", layout=SMALL))
        assert reply.code == "too_many_models" and f"at most {MAX_MODELS}" in reply.message
        reply = _error(d, P.Lookup(model="ghost", keys=[key(0)]))
        assert reply.code == "unknown_model"
        assert reply.message.count("[tp_rank 0]") == 20 and "and 10 more" in reply.message
        for i in range(MAX_MODELS - 1):   # Unregister undoes it
            assert call(d, P.Unregister(model=f"model-{i:02d}")) == P.Count(n=0)
        assert isinstance(call(d, P.Register(model="one-too-many", layout=SMALL)), P.Ok)
        assert call(d, P.Unregister(model="one-too-many")) == P.Count(n=0)
        assert _error(d, P.Unregister(model="never")).code == "unknown_model"
    finally:
        close_dealer(d)
    assert status(server)["models"] == 1


def test_unregister_waits_for_leases_and_deletes_objects(server):
    with KVClient(server.url) as c:
        c.register("tmp", SMALL)
        ks = [key(i, "unreg") for i in range(3)]
        c.store("tmp", ks, [chunk_for(k) for k in ks])
        d = dealer(server.url)
        try:
            with c.retrieve("tmp", ks[:1]):
                assert _error(d, P.Unregister(model="tmp")).code == "busy"
            assert call(d, P.Unregister(model="tmp")) == P.Count(n=3)
            assert _error(d, P.Lookup(model="tmp", keys=ks)).code == "unknown_model"
        finally:
            close_dealer(d)


def test_too_many_keys_is_refused_and_others_are_served(server):
    d, other = dealer(server.url), dealer(server.url)
    try:
        keys = [secrets.token_bytes(16) for _ in range(1001)]
        for msg in (P.Retrieve(model="m", keys=keys), P.Lookup(model="m", keys=keys),
                    P.PrepareStore(model="m", keys=keys), P.Delete(model="m", keys=keys)):
            reply = _error(d, msg)
            assert reply.code == "too_many_keys" and "at most 1000" in reply.message
        # a message over --max-message-bytes: libzmq drops that connection (no reply is
        # possible); the server and every other client carry on
        d.send_multipart([b"big", P.encoder.encode(P.Retrieve(model="m",
                                                               keys=[b"k" * 64] * 70000))])
        assert isinstance(call(other, P.Hello(protocol=P.PROTOCOL)), P.ServerInfo)
        info = call(other, P.Hello(protocol=P.PROTOCOL))
        assert info.max_keys_per_request == 1000 and info.max_message_bytes == 4 << 20
    finally:
        close_dealer(d)
        close_dealer(other)


def test_parked_lookups_are_bounded_and_dropped_on_disconnect(server):
    missing = [key(i, "never-stored") for i in range(4)]
    a, b = session_dealer(server.url), session_dealer(server.url)
    try:
        for i in range(3):
            a.send_multipart([f"a{i}".encode(), P.encoder.encode(
                P.Lookup(model="m", keys=missing, wait_timeout=60))])
        reply = _error(a, P.Lookup(model="m", keys=missing, wait_timeout=60))
        assert reply.code == "too_many_waits" and "3" in reply.message   # per client
        for i in range(2):
            b.send_multipart([f"b{i}".encode(), P.encoder.encode(
                P.Lookup(model="m", keys=missing, wait_timeout=60))])
        assert wait_until(lambda: status(server)["waiting_lookups"] == 5)
        c = session_dealer(server.url)
        try:
            reply = _error(c, P.Lookup(model="m", keys=missing, wait_timeout=60))
            assert reply.code == "too_many_waits"                         # in total
            assert _error(c, P.Lookup(model="m", keys=missing, wait_timeout=61)).code == \
                "bad_wait"
        finally:
            close_dealer(c)
    finally:
        close_dealer(a)
    assert wait_until(lambda: status(server)["waiting_lookups"] == 2, timeout=10)
    close_dealer(b)
    assert wait_until(lambda: status(server)["waiting_lookups"] == 0, timeout=10)
    assert status(server)["parked_keys"] == 0


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_evictions_metric_equals_status():
    with start_server(8 * SMALL.chunk_bytes / 2**30) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        for i in range(3):
            ks = [key(j, f"evict{i}") for j in range(6)]
            c.store("m", ks, [chunk_for(k) for k in ks])
        st = httpx.get(s.http_url + "/status", timeout=10).json()
        text = httpx.get(s.http_url + "/metrics", timeout=10).text
        assert st["evictions"] == 10          # 18 chunks into 8 slots
        assert _metric(text, "kvedit_evictions_total") == st["evictions"]
        assert _metric(text, "kvedit_objects", '{state="ready"}') == st["objects"]["ready"] == 8
        assert _metric(text, "kvedit_pool_bytes", '{use="used"}') == st["pool"]["used"]


def test_every_malformed_message_is_counted(server):
    def malformed() -> float:
        text = httpx.get(server.http_url + "/metrics", timeout=10).text
        m = re.search(r'^kvedit_errors_total\{code="malformed"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = malformed()
    d = dealer(server.url)
    try:
        bad = [[b"r1"],                                          # wrong frame count
               [b"x" * 17, P.encoder.encode(P.Hello(protocol=P.PROTOCOL))],         # request id too long
               [b"r1", b"\xc1"],                                 # undecodable
               [b"r1", P.encoder.encode(P.Hello(protocol=P.PROTOCOL)), b"extra"]]   # extra frame
        for frames in bad * 3:
            d.send_multipart(frames)
            d.recv_multipart()
    finally:
        close_dealer(d)
    assert malformed() - before == 12


def test_connection_gauges_follow_clients(server):
    base = status(server)["zmq_conns"] - 1   # status() counts its own client's connection
    socks = [dealer(server.url) for _ in range(3)]
    try:
        for s in socks:
            assert isinstance(call(s, P.Hello(protocol=P.PROTOCOL)), P.ServerInfo)
        assert wait_until(lambda: status(server)["zmq_conns"] >= base + 3)
        text = httpx.get(server.http_url + "/metrics", timeout=10).text
        assert _metric(text, "kvedit_zmq_connections") >= base + 3
    finally:
        for s in socks:
            close_dealer(s)
    assert wait_until(lambda: status(server)["zmq_conns"] - 1 <= base)
