"""The HTTP API of a real server: health, status, config, metrics, cache listing/deletion."""
from __future__ import annotations

import httpx
import pytest

from kvedit.client import KVClient
from kvedit.layout import ModelLayout, RopeParams
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key

ROPE_LAYOUT = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                          chunk_size=256, rope=RopeParams(theta=1e6, rotary_dim=32,
                                                          rope_type="llama3",
                                                          scaling={"factor": 8.0}))


@pytest.fixture(scope="module")
def server():
    with start_server(0.05) as s, KVClient(s.url) as c:
        c.register("a", SMALL)
        c.register("b", ROPE_LAYOUT)
        c.store("a", [key(i, "a") for i in range(5)], [chunk_for(key(i, "a")) for i in range(5)])
        c.store("b", [key(0, "b")], [chunk_for(key(0, "b"), ROPE_LAYOUT)])
        yield s


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.http_url + path, timeout=10, **kw)


def test_health_and_config(server):
    assert get(server, "/health").json()["status"] == "ok"
    cfg = get(server, "/config").json()
    assert cfg["port"] == server.port and cfg["http_port"] == server.http_port
    assert cfg["shm_name"] == server.shm_name and cfg["eviction_policy"] == "LRU"
    assert cfg["chunk_size"] == 256 and cfg["l1_use_lazy"] is True


def test_status(server):
    st = get(server, "/status").json()
    assert st["transfer_mode"] == "shm" and st["shm_path"] == f"/dev/shm/{server.shm_name}"
    assert st["objects"]["ready"] == 6
    used = 5 * SMALL.chunk_bytes + ROPE_LAYOUT.chunk_bytes
    assert st["pool"]["used"] == used and st["pool"]["free"] == st["pool"]["bytes"] - used
    b = st["models"]["b"][0]
    assert b["num_layers"] == 2 and b["dtype"] == "bfloat16" and b["chunk_bytes"] == 131072
    assert b["rope"]["theta"] == 1e6 and b["rope"]["scaling"] == {"factor": 8.0}
    assert st["models"]["a"][0]["rope"] is None
    assert any("lazy pool" in n for n in st["notes"])


def test_metrics(server):
    def sample(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[1])

    before = get(server, "/metrics").text
    with KVClient(server.url) as c:
        ks = [key(i, "a") for i in range(5)] + [key(9, "missing")]
        c.retrieve("a", ks).release()
    after = get(server, "/metrics").text
    assert sample(after, "kvedit_hits_total") - sample(before, "kvedit_hits_total") == 5
    assert sample(after, "kvedit_misses_total") - sample(before, "kvedit_misses_total") == 1
    assert sample(after, 'kvedit_objects{state="ready"}') == 6
    assert sample(after, "kvedit_store_bytes_total") >= 5 * SMALL.chunk_bytes
    assert "kvedit_retrieve_seconds_bucket" in after and "kvedit_evictions_total" in after
    # the loop's own busy figure (CPU time per turn): counted, and the same as /status's
    assert sample(after, "kvedit_loop_turns_total") > sample(before, "kvedit_loop_turns_total")
    assert 0 < sample(after, "kvedit_loop_turn_max_seconds") < 60
    assert 'kvedit_loop_slow_turns_total{over_ms="50"}' in after
    counters = get(server, "/status").json()["counters"]
    assert counters["loop_turns"] >= sample(after, "kvedit_loop_turns_total")
    assert counters["loop_turns_over_10ms"] >= counters["loop_turns_over_50ms"] >= 0


def test_cache_pagination(server):
    page = get(server, "/cache", params={"limit": 4}).json()
    assert page["total"] == 6 and len(page["items"]) == 4 and page["next_after"]
    rest = get(server, "/cache", params={"after": page["next_after"], "limit": 4}).json()
    assert len(rest["items"]) == 2 and rest["next_after"] is None
    keys = {i["key"] for i in page["items"] + rest["items"]}
    assert key(0, "b").hex() in keys and len(keys) == 6
    only_b = get(server, "/cache", params={"model": "b"}).json()
    assert [i["model"] for i in only_b["items"]] == ["b"] and only_b["total"] == 1
    assert only_b["items"][0]["bytes"] == ROPE_LAYOUT.chunk_bytes
    assert only_b["items"][0]["age_s"] >= 0
    for params, word in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                         ({"limit": 1001}, "limit"), ({"offset": 4}, "next_after"),
                         ({"after": "a" * 2000}, "after")):
        bad = get(server, "/cache", params=params)
        assert bad.status_code == 400 and word in bad.json()["error"], params
    r = get(server, "/cache", params={"model": "nobody"})
    assert r.status_code == 404 and "'a'" in r.json()["error"]


def test_wrong_method_is_json_405(server):
    r = httpx.post(server.http_url + "/cache", timeout=10)
    assert r.status_code == 405 and "POST" in r.json()["error"]
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "DELETE"}


def test_openapi_describes_every_endpoint(server):
    spec = get(server, "/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    assert set(spec["paths"]) == {"/health", "/status", "/config", "/metrics", "/cache",
                                  "/openapi.json"}
    limit = next(p for p in spec["paths"]["/cache"]["get"]["parameters"] if p["name"] == "limit")
    assert limit["schema"]["maximum"] == 1000


def test_early_disconnect_leaves_no_traceback(server):
    """Clients that vanish mid-request or before reading the reply: no traceback, server up."""
    import socket
    import struct
    for req in (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",   # reply never read (RST)
                b"GET /cache?limit=1000 HTTP/1.1\r\nHo",       # headers cut off
                b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n" * 50):  # pipelined, then gone
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.http_port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(req)
            s.close()
    assert get(server, "/health").json()["status"] == "ok"
    log = server.log()
    assert "Traceback" not in log and "BrokenPipe" not in log and "Error" not in log, log


def test_unknown_path_is_404(server):
    r = get(server, "/nope")
    assert r.status_code == 404 and "/status" in r.json()["error"]


def test_delete_cache_one_model_then_all(server):
    r = httpx.delete(server.http_url + "/cache", params={"model": "nobody"})
    assert r.status_code == 404 and "'a'" in r.json()["error"]
    r = httpx.delete(server.http_url + "/cache", params={"model": "b"})
    assert r.json()["deleted"] == 1
    assert get(server, "/cache").json()["total"] == 5
    assert httpx.delete(server.http_url + "/cache").json()["deleted"] == 5
    assert get(server, "/status").json()["pool"]["used"] == 0


@pytest.fixture(scope="module")
def secret_server(tmp_path_factory):
    from kvedit import auth
    path = tmp_path_factory.mktemp("secret") / "secret"
    auth.generate_secret(path)
    with start_server(0.05, secret_file=path) as s, \
            KVClient(s.url, secret_file=str(path)) as c:
        c.register("a", SMALL)
        c.store("a", [key(0, "s")], [chunk_for(key(0, "s"))])
        yield s, auth.load_secret(None, path)


def test_secret_guards_status_config_and_cache(secret_server):
    from kvedit import auth
    server, secret = secret_server
    good = auth.bearer_header(secret)   # the token derived for HTTP, never the secret
    for method, path in (("GET", "/status"), ("GET", "/config"), ("GET", "/cache"),
                         ("DELETE", "/cache")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": secret.decode()},
                        {"Authorization": "Basic " + secret.decode()},
                        {"Authorization": "Bearer " + secret.decode()}):
            r = httpx.request(method, server.http_url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers)
            assert "Authorization: Bearer" in r.json()["error"] or \
                "the kvedit secret itself" in r.json()["error"]
            assert r.headers["www-authenticate"].startswith("Bearer")
    # nothing was deleted by the refused DELETEs; with the token everything answers
    page = httpx.get(server.http_url + "/cache", headers=good, timeout=10).json()
    assert page["total"] == 1 and page["items"][0]["key"] == key(0, "s").hex()
    assert httpx.get(server.http_url + "/status", headers=good,
                     timeout=10).json()["objects"]["ready"] == 1
    assert httpx.get(server.http_url + "/config", headers=good, timeout=10).status_code == 200
    # /health and /metrics stay open, and /metrics names no model or key
    assert httpx.get(server.http_url + "/health", timeout=10).json()["status"] == "ok"
    metrics = httpx.get(server.http_url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and 'kvedit_objects{state="ready"} 1.0' in metrics.text
    assert key(0, "s").hex() not in metrics.text and 'model="a"' not in metrics.text
    r = httpx.delete(server.http_url + "/cache", headers=good, timeout=10)
    assert r.json()["deleted"] == 1


@pytest.mark.slow  # real-time waits past the idle timeout
def test_silent_connections_are_closed(server):
    """More silent peers than one peer may hold (and one with half a request head): the
    server closes each of them (the oldest ones as newer arrive, the rest at the head
    timeout), then serves requests again."""
    import socket

    from kvedit.server.config import ServerConfig
    d = ServerConfig(l1_size_gb=1)
    peers = [socket.create_connection(("127.0.0.1", server.http_port))
             for _ in range(d.http_max_conns_per_peer + 6)]
    peers[-1].sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    try:
        for p in peers:
            p.settimeout(d.http_head_timeout * 3)
            assert p.recv(100) == b""   # closed by the server, not by our timeout
    finally:
        for p in peers:
            p.close()
    assert get(server, "/health").json()["status"] == "ok"
    assert "Traceback" not in server.log()


def test_server_stops_cleanly_with_http_connections_open():
    """SIGTERM with a keep-alive client, a silent peer and a half-sent head connected: the
    HTTP thread ends with the server (exit code 0, the stop does not need SIGKILL)."""
    import socket
    s = start_server(0.05)
    try:
        keep = httpx.Client(base_url=s.http_url, timeout=10)
        assert keep.get("/health").status_code == 200
        silent = socket.create_connection(("127.0.0.1", s.http_port))
        half = socket.create_connection(("127.0.0.1", s.http_port))
        half.sendall(b"GET /status HTTP/1.1\r\nHo")
        assert s.stop(timeout=20) == 0
    finally:
        s.stop()
    for sock in (silent, half):
        sock.settimeout(5)
        assert sock.recv(100) == b""   # closed by the server's shutdown
        sock.close()
    keep.close()
