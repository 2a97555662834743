"""`kvedit bench serve` records what each workload made a kvedit arm's server do (stores,
loads, hits, misses, evictions): the counters come from a real server's /metrics, and the
per-workload figure is their difference around the workload."""
from __future__ import annotations

from kvedit.bench.serve import SERVER_COUNTERS, server_counters
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key


def test_server_counters_move_by_what_a_workload_stored_loaded_and_missed():
    with start_server(0.05, chunk_size=256) as s, KVClient(s.url) as c:
        before = server_counters(s.http_url)
        assert set(before) == set(SERVER_COUNTERS.values())
        c.register("m", SMALL)
        keys = [key(i, "bench") for i in range(3)]
        chunks = [chunk_for(k) for k in keys]
        c.store("m", keys, chunks)
        assert c.lookup("m", keys) == 3
        c.lookup("m", [key(99, "absent")])
        with c.retrieve("m", keys[:2]):
            pass
        after = server_counters(s.http_url)
    moved = {k: after[k] - before[k] for k in after}
    assert moved["stored_bytes"] == sum(x.nbytes for x in chunks)
    assert moved["stores"] == 1                       # one store call of three chunks
    assert moved["retrieved_bytes"] == sum(x.nbytes for x in chunks[:2])
    assert moved["hits"] == 3 + 2 and moved["misses"] == 1   # the lookups, then the retrieve
    assert moved["evictions"] == 0
