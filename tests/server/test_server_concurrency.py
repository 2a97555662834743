"""Several client processes at once; eviction under pressure while others read (checksums)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key, matches

WORKER = textwrap.dedent("""
    import random, sys
    from kvedit.client import KVClient
    from tests.kv_helpers import SMALL, chunk_for, key, matches
    url, me, n, mode, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \\
        float(sys.argv[5])
    c = KVClient(url, use_shm=mode == "shm")
    assert c.transfer_mode == mode
    c.register("m", SMALL)
    mine = [key(i, f"p{me}") for i in range(n)]
    shared = [key(i, "shared") for i in range(n)]
    c.store("m", mine, [chunk_for(k) for k in mine])
    c.store("m", shared, [chunk_for(k) for k in shared])   # all race on these
    seen = 0
    if seconds == 0:  # read everyone's keys once they are all there (server-side wait)
        for other in range(int(sys.argv[6])):
            ks = [key(i, f"p{other}") for i in range(n)]
            assert c.lookup("m", ks, wait_timeout=60) == n
            with c.retrieve("m", ks + shared) as r:
                assert len(r.tensors) == 2 * n
                bad = [i for i, (k, t) in enumerate(zip(ks + shared, r.tensors))
                       if not matches(k, t)]
                assert not bad, f"torn or swapped chunks {bad}"
                seen += len(r.tensors)
    else:  # keep storing fresh keys to force evictions, read whatever is still there
        import time
        end, i = time.monotonic() + seconds, 0
        rnd = random.Random(me)
        while time.monotonic() < end:
            new = [key(i + j, f"churn{me}") for j in range(4)]
            c.store("m", new, [chunk_for(k) for k in new])
            i += 4
            back = [key(rnd.randrange(max(1, i)), f"churn{rnd.randrange(int(sys.argv[6]))}")
                    for _ in range(6)]
            for k in back:
                with c.retrieve("m", [k]) as r:
                    for t in r.tensors:
                        assert matches(k, t), "torn read"
                        seen += 1
    c.close()
    print("ok", seen)
""")


def _spawn(url: str, me: int, n: int, mode: str, seconds: float, procs: int):
    return subprocess.Popen([sys.executable, "-c", WORKER, url, str(me), str(n), mode,
                             str(seconds), str(procs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _join(ps) -> list[int]:
    seen = []
    for p in ps:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.startswith("ok"), err[-3000:]
        seen.append(int(out.split()[1]))
    return seen


@pytest.mark.slow  # four client processes, each importing torch
def test_several_client_processes(kv_server):
    """Two shm and two socket clients store their own and common keys, then read all."""
    modes = ["shm", "socket", "shm", "socket"]
    seen = _join([_spawn(kv_server.url, me, 6, mode, 0, len(modes))
                  for me, mode in enumerate(modes)])
    assert seen == [len(modes) * 12] * len(modes)


@pytest.mark.slow  # a flood: three processes churn the pool for seconds
def test_eviction_under_pressure_no_torn_reads():
    """Pool of 24 chunks, 3 processes (shm and socket) churning ~4x that while reading back."""
    with start_server(24 * SMALL.chunk_bytes / 2**30, eviction="LRU") as s:
        ps = [_spawn(s.url, me, 0, mode, 3.0, 3) for me, mode in
              enumerate(["shm", "shm", "socket"])]
        _join(ps)
        with KVClient(s.url) as c:
            st = c.stats()
            assert st["evictions"] > 0 and st["leases"] == 0 and st["writing"] == 0
            assert st["pool_used"] <= 24 * SMALL.chunk_bytes


def test_threads_share_one_client(kv_server):
    """Threads of one client run side by side; one thread's server-side wait blocks nobody."""
    with KVClient(kv_server.url) as c:
        c.register("m", SMALL)
        gate = [key(0, "gate")]
        errors: list[BaseException] = []
        waited: list[int] = []

        def waiter():
            waited.append(c.lookup("m", gate, wait_timeout=60))

        def worker(t: int):
            try:
                ks = [key(i, f"thread{t}") for i in range(8)]
                for k in ks:
                    c.store("m", [k], [chunk_for(k)])
                with c.retrieve("m", ks) as r:
                    assert all(matches(k, x) for k, x in zip(ks, r.tensors))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        w = threading.Thread(target=waiter)
        w.start()
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors and not waited  # all done while the waiter still waits
        c.store("m", gate, [chunk_for(gate[0])])
        w.join(10)
        assert waited == [1]
