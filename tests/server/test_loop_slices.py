"""Work a client can make large is done a slice at a time, the loop serving requests between
the slices, against real server processes (kvedit/server/slices.py).

Reproductions of an outside red-team run: one `unregister` of a model of a million objects
held the control loop 5.4 s (a Hello went unanswered for seconds: a connector with a 2 s
timeout calls the server down); a store that had to evict as many objects as it stored
held it for the whole eviction; a DELETE /cache run beside 64 key watches held it 112 ms
while the pushes it had piled up went out at once. Here each is a job of slices: the
Unregister is answered at once and its objects go in slices, the store is parked while the
loop evicts a slice at a time, and every push of a deletion is a slice's worth.
Timed figures are the bench's (`kvedit bench soak`); these assert what the loop did between
(Hellos answered while the work went on) and bounds of seconds the code before failed.
"""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from tests.fixtures_server import call, close_dealer, dealer, session_dealer, wait_until

# 4 KiB chunks: a quarter of a million objects fit in a GiB of lazy pool, never written
TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_size=256)
BIG = 1 << 16   # keys per request (the protocol's largest)


def _keys(start: int, n: int, tag: bytes = b"o") -> list[bytes]:
    return [tag + i.to_bytes(15, "little") for i in range(start, start + n)]


def _fill(c: KVClient, model: str, n: int) -> None:
    for start in range(0, n, BIG):
        c.prepare_store(model, _keys(start, min(BIG, n - start))).commit()


class Prober:
    """A Hello after each answer on its own socket: (sent at, ms) of every one."""

    def __init__(self, url: str):
        self.sock = dealer(url, timeout_ms=30000)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        close_dealer(self.sock)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            call(self.sock, P.Hello(protocol=P.PROTOCOL))
            self.samples.append((t0, (time.monotonic() - t0) * 1e3))
            time.sleep(0.002)

    def between(self, a: float, b: float) -> list[float]:
        """ms of the Hellos sent at or after `a` and answered by `b`."""
        return [ms for t, ms in self.samples if t >= a and t + ms / 1e3 <= b]

    def max_overlapping(self, a: float, b: float) -> float:
        """The longest wait of a Hello that was waiting at some time in [a, b]."""
        return max((ms for t, ms in self.samples if t <= b and t + ms / 1e3 >= a), default=0)


@pytest.mark.slow   # fills a quarter of a million objects
def test_unregister_of_a_large_model_is_answered_at_once_and_sliced():
    n = 1 << 18
    with start_server(1.2, extra_args=["--max-keys-per-request", str(BIG)]) as s, \
            KVClient(s.url, timeout=120) as c:
        c.register("big", TINY)
        c.register("other", TINY)
        _fill(c, "big", n)
        c.prepare_store("other", _keys(0, 10, b"x")).commit()
        d = session_dealer(s.url)
        try:
            with Prober(s.url) as probe:
                t0 = time.monotonic()
                r = call(d, P.Unregister(model="big"))
                answered = time.monotonic()
                # the registration is gone at once: nothing new arrives while its objects go
                assert call(d, P.Lookup(model="big", keys=_keys(0, 1))).code == "unknown_model"
                again = call(d, P.Register(model="big", layout=TINY))
                while c.stats()["ready"] > 10:
                    time.sleep(0.05)
                t_gone = time.monotonic()
            assert r == P.Count(n=n), r
            assert answered - t0 < 1.0, answered - t0          # was 2.7 s at 262k objects
            assert isinstance(again, P.Error) and again.code == "busy", again
            assert "being deleted" in again.message
            worst = probe.max_overlapping(t0, t_gone)
            assert worst < 1000, worst                         # was the whole deletion
            assert len(probe.between(t0, t_gone)) >= 20        # the loop ran throughout
            assert isinstance(call(d, P.Register(model="big", layout=TINY)), P.Ok)
            assert c.lookup("other", _keys(0, 10, b"x")) == 10   # another model untouched
            st = c.stats()
            assert st["ready"] == 10 and st["pool_used"] == 10 * 4096
        finally:
            close_dealer(d)


def test_unregister_still_waits_for_leases_and_stores():
    with start_server(0.02) as s, KVClient(s.url) as c:
        c.register("m", TINY)
        c.prepare_store("m", _keys(0, 3)).commit()
        with c.retrieve("m", _keys(0, 1)):
            with pytest.raises(KVError) as e:
                c._call(P.Unregister(model="m"))
            assert e.value.code == "busy" and "leased" in e.value.message
        h = c.prepare_store("m", _keys(5, 1))
        with pytest.raises(KVError) as e:
            c._call(P.Unregister(model="m"))
        assert e.value.code == "busy"
        h.abort()
        assert c._call(P.Unregister(model="m")) == P.Count(n=3)


@pytest.mark.slow   # fills 128k objects, evicts 64k
def test_a_store_that_must_evict_much_lets_the_loop_run():
    """A pool full of 2^17 objects and one store of 2^16 new keys: it is parked while the
    loop evicts 512 at a time, Hellos answered between (before: none for the whole store)."""
    n = 1 << 17
    with start_server(n * 4096 / 2**30, extra_args=["--max-keys-per-request", str(BIG)]) as s, \
            KVClient(s.url, timeout=120) as c:
        c.register("m", TINY)
        _fill(c, "m", n)
        assert c.stats()["pool_free"] == 0
        with Prober(s.url) as probe:
            t0 = time.monotonic()
            h = c.prepare_store("m", _keys(n, BIG))
            t1 = time.monotonic()
        assert len(h.missing) == BIG
        h.commit()
        assert c.stats()["evictions"] == BIG and c.lookup("m", _keys(n, BIG)) == BIG
        answered = probe.between(t0, t1)
        assert len(answered) >= 10, (len(answered), t1 - t0)


def _slow_turns(c: KVClient) -> int:
    """Turns of the server's loop over 50 ms of its own CPU time (metrics.py LoopTurns):
    what a request that came during one waited, whatever else loads this box."""
    return c.stats()["loop_turns_over_50ms"]


def _watch_synced(w, model: str) -> int:
    """Subscribe socket `w` to a key watch of `model`; read (and acknowledge) its snapshot
    to the last part -> the last seq."""
    w.send_multipart([b"w", P.encoder.encode(P.WatchKeys(model=model, tp_ranks=[0], epoch=1))])
    seq, end = -1, time.monotonic() + 120
    while time.monotonic() < end:
        rid, body = w.recv_multipart()
        msg = P.reply_decoder.decode(body)
        if rid == b"a":   # the acknowledgement of a renewal
            assert isinstance(msg, P.WatchAck) and msg.seq >= 0, msg
            continue
        assert isinstance(msg, P.KeySnapshot) and msg.seq == seq + 1, msg
        seq = msg.seq
        w.send_multipart([b"a", P.encoder.encode(P.WatchKeys(
            model=model, tp_ranks=[0], epoch=1, renew=True, seen=seq))])
        if not msg.more:
            return seq
    raise AssertionError("the snapshot did not end")


@pytest.mark.slow   # fills 128k objects, evicts 64k
def test_an_evicting_store_is_prepared_in_slices_and_watches_hear_first():
    """A pool full of 2^17 objects, a key watch of them, and one store of 2^16 new keys on
    the watch's own socket. Before: the loop evicted ahead in slices but then made the
    store's 65,536 objects in one turn (one turn of 150-300 ms of CPU here; with 8,192-key
    stores, 20-45 ms, and up to 130 ms when it met a table rebuild: `kvedit bench soak`'s
    evicting_store Hello max was 114 ms). Now no turn of the loop takes 50 ms of CPU while
    the store is prepared, Hellos are answered throughout, every eviction reaches the watch
    before the store's reply (same socket: in order), and the store is whole."""
    n = 1 << 17
    with start_server(n * 4096 / 2**30, extra_args=["--max-keys-per-request", str(BIG)]) as s, \
            KVClient(s.url, timeout=120) as c:
        c.register("m", TINY)
        _fill(c, "m", n)
        assert c.stats()["pool_free"] == 0
        w = session_dealer(s.url)
        w.setsockopt(zmq.RCVTIMEO, 60000)
        try:
            seq = _watch_synced(w, "m")
            before, slow = c.stats()["evictions"], _slow_turns(c)
            removed = 0
            with Prober(s.url) as probe:
                t0 = time.monotonic()
                w.send_multipart([b"s", P.encoder.encode(P.PrepareStore(
                    model="m", keys=_keys(n, BIG)))])
                while True:
                    rid, body = w.recv_multipart()
                    msg = P.reply_decoder.decode(body)
                    if rid == b"s":
                        break
                    if rid == b"a":   # acknowledgements of the snapshot's last renewals
                        continue
                    if isinstance(msg, P.KeyEvents):
                        assert msg.seq == seq + 1 and not msg.added, msg
                        seq = msg.seq
                        removed += sum(len(v) for v in msg.removed.values())
                t1 = time.monotonic()
            assert isinstance(msg, P.StoreSlots) and len(msg.missing) == BIG, msg
            slow_during = _slow_turns(c) - slow
            evicted = c.stats()["evictions"] - before
            # before: (65536, 65024, 1): the last slice's removals came after the reply, and
            # one turn of the loop made all 65,536 objects
            assert (evicted, removed, slow_during) == (BIG, BIG, 0)
            assert len(probe.between(t0, t1)) >= 10, len(probe.between(t0, t1))
            assert call(w, P.Commit(store_id=msg.store_id)) == P.Committed(stored=BIG)
            assert c.lookup("m", _keys(n, BIG)) == BIG
            st = c.stats()
            assert st["ready"] == n and st["writing"] == 0 and st["pool_free"] == 0
        finally:
            close_dealer(w)


def test_a_large_store_is_answered_after_requests_behind_it():
    """A store of 2^16 new keys into a pool with room, and a Hello right behind it on the
    same socket: the Hello's answer comes first (before: after the whole prepare, one turn
    of the loop over 50 ms of CPU); the slots are the same as if prepared in one go."""
    n = BIG
    with start_server(2 * n * 4096 / 2**30, extra_args=["--max-keys-per-request", str(BIG)]
                      ) as s, KVClient(s.url, timeout=120) as c:
        c.register("m", TINY)
        c.prepare_store("m", _keys(0, 100)).commit()   # 100 of its keys are there already
        slow = _slow_turns(c)
        d = session_dealer(s.url)
        d.setsockopt(zmq.RCVTIMEO, 60000)
        try:
            d.send_multipart([b"s", P.encoder.encode(P.PrepareStore(model="m",
                                                                   keys=_keys(0, n)))])
            d.send_multipart([b"h", P.encoder.encode(P.Hello(protocol=P.PROTOCOL))])
            order = [d.recv_multipart() for _ in range(2)]
            assert [rid for rid, _ in order] == [b"h", b"s"], [rid for rid, _ in order]
            slots = P.reply_decoder.decode(order[1][1])
            assert _slow_turns(c) == slow
            assert slots.present == 100 and slots.missing == list(range(100, n))
            assert len(set(slots.offsets)) == n - 100
            assert call(d, P.Commit(store_id=slots.store_id)) == P.Committed(stored=n - 100)
            assert c.lookup("m", _keys(0, n)) == n
        finally:
            close_dealer(d)


WAIT_S = 0.02   # after the store is sent: its keys are being looked up then, most often


def test_an_unregister_while_a_large_store_is_prepared_leaves_nothing_behind():
    """Unregister right behind a store of 2^16 keys (its keys looked up over several
    turns): either the Unregister comes first (Count) and the store is refused
    unknown_model with nothing of it left, or the store's objects came first (busy) and the
    store is whole; never objects of a model that is gone."""
    n = BIG
    with start_server(2 * n * 4096 / 2**30, extra_args=["--max-keys-per-request", str(BIG)]
                      ) as s, KVClient(s.url, timeout=120) as c:
        c.register("m", TINY)
        c.prepare_store("m", _keys(n, 10)).commit()
        d, other = session_dealer(s.url), dealer(s.url, timeout_ms=60000)
        d.setsockopt(zmq.RCVTIMEO, 60000)
        try:
            d.send_multipart([b"s", P.encoder.encode(P.PrepareStore(model="m",
                                                                   keys=_keys(0, n)))])
            time.sleep(WAIT_S)
            u = call(other, P.Unregister(model="m"))
            rid, body = d.recv_multipart()
            got = P.reply_decoder.decode(body)
            what = got.code if isinstance(got, P.Error) else type(got).__name__
            assert rid == b"s"
            if isinstance(u, P.Count):                    # the Unregister came first
                assert u.n == 10
                assert what == "unknown_model", what      # was StoreSlots: 65,536 objects
                # of a model that was gone, committed and never dropped
                assert wait_until(lambda: c.stats()["objects"] == 0)
                assert c.stats()["pool_used"] == 0
            else:                                         # the store's objects came first
                assert isinstance(u, P.Error) and u.code == "busy", u
                assert what == "StoreSlots" and len(got.missing) == n, what
                assert call(d, P.Commit(store_id=got.store_id)) == P.Committed(stored=n)
                assert c.lookup("m", _keys(0, n)) == n
        finally:
            close_dealer(d)
            close_dealer(other)


def test_a_parked_store_is_refused_over_quota_at_once():
    """Parking takes nothing a session may not hold: over its pool share it is refused
    before any eviction."""
    n = 4096
    with start_server(n * 4096 / 2**30 + 0.001, client_pool_fraction=None,   # the default
                      extra_args=["--max-keys-per-request", str(n)]) as s, \
            KVClient(s.url, timeout=60) as c:
        c.register("m", TINY)
        for start in range(0, n, 1024):
            c.prepare_store("m", _keys(start, 1024)).commit()
        before = c.stats()["evictions"]
        with pytest.raises(KVError) as e:
            c.prepare_store("m", _keys(n, n))   # the whole pool: over one session's share
        assert e.value.code == "over_quota"
        assert c.stats()["evictions"] == before


@pytest.mark.slow   # 262k objects deleted beside a key watch
def test_every_push_of_a_deletion_is_a_slice_worth():
    """DELETE /cache of a watched model: the removals reach the watch in pushes of at most a
    slice (512 keys), each sent as its slice ended (before: what the HTTP thread's slices
    piled up between two turns of the loop, thousands of keys, went out at once)."""
    import httpx
    n = 1 << 18
    with start_server(1.2, extra_args=["--max-keys-per-request", str(BIG)]) as s, \
            KVClient(s.url, timeout=120) as c:
        c.register("w", TINY)
        _fill(c, "w", n)
        w = session_dealer(s.url)
        removed: list[int] = []
        try:
            w.send_multipart([b"w", P.encoder.encode(P.WatchKeys(model="w", tp_ranks=[0],
                                                                  epoch=1))])
            seq, done = -1, False
            end = time.monotonic() + 120
            deleting = None
            while time.monotonic() < end:
                msg = P.reply_decoder.decode(w.recv_multipart()[1])
                if isinstance(msg, P.KeySnapshot | P.KeyEvents):
                    assert msg.seq == seq + 1, (msg.seq, seq)
                    seq = msg.seq
                    w.send_multipart([b"w", P.encoder.encode(P.WatchKeys(
                        model="w", tp_ranks=[0], epoch=1, renew=True, seen=seq))])
                if isinstance(msg, P.KeySnapshot) and not msg.more and deleting is None:
                    deleting = threading.Thread(target=lambda: httpx.delete(
                        s.http_url + "/cache", params={"model": "w"}, timeout=120))
                    deleting.start()
                if isinstance(msg, P.KeyEvents) and msg.removed:
                    removed.append(sum(len(v) for v in msg.removed.values()))
                    if sum(removed) == n:
                        done = True
                        break
            deleting.join(60)
        finally:
            close_dealer(w)
        assert done, (sum(removed), len(removed))
        assert max(removed) <= 512, sorted(removed)[-5:]


def test_unregister_of_one_rank_leaves_the_other():
    """A model on two ranks, their objects interleaved in commit order: Unregister of rank 0
    (300 objects, within a slice) deletes all of them although the model's first slice (512
    objects) holds only some, and none of rank 1's."""
    import msgspec
    with start_server(0.05) as s, KVClient(s.url) as c:
        for r in (0, 1):
            c.register("tp", msgspec.structs.replace(TINY, tp_rank=r, tp_size=2))
        for i in range(3):   # 3 x (100 of rank 0, 200 of rank 1)
            c.prepare_store("tp", _keys(i * 100, 100, b"\0"), tp_rank=0).commit()
            c.prepare_store("tp", _keys(i * 200, 200, b"\1"), tp_rank=1).commit()
        assert c._call(P.Unregister(model="tp", tp_rank=0)) == P.Count(n=300)
        for _ in range(100):
            if c.stats()["ready"] == 600:
                break
            time.sleep(0.05)
        assert c.stats()["ready"] == 600
        assert c.lookup("tp", _keys(0, 600, b"\1"), tp_rank=1) == 600
        c.register("tp", msgspec.structs.replace(TINY, tp_rank=0, tp_size=2))
        assert c.lookup("tp", _keys(200, 1, b"\0"), tp_rank=0) == 0
