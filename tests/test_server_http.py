"""The HTTP API of a real server: health, status, config, metrics, cache listing/deletion."""
from __future__ import annotations

import httpx
import pytest

from kvedit.client import KVClient
from kvedit.layout import ModelLayout, RopeParams
from kvedit.server.launch import start_server
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


def test_cache_pagination(server):
    page = get(server, "/cache", params={"limit": 4}).json()
    assert page["total"] == 6 and len(page["items"]) == 4 and page["next_offset"] == 4
    rest = get(server, "/cache", params={"offset": 4, "limit": 4}).json()
    assert len(rest["items"]) == 2 and rest["next_offset"] is None
    keys = {i["key"] for i in page["items"] + rest["items"]}
    assert key(0, "b").hex() in keys and len(keys) == 6
    only_b = get(server, "/cache", params={"model": "b"}).json()
    assert [i["model"] for i in only_b["items"]] == ["b"]
    assert only_b["items"][0]["bytes"] == ROPE_LAYOUT.chunk_bytes
    assert only_b["items"][0]["age_s"] >= 0
    bad = get(server, "/cache", params={"limit": 0})
    assert bad.status_code == 400 and "limit" in bad.json()["error"]


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
