"""What the largest messages cost the server, against a real server process.

Reproductions of an outside red-team run: layouts with `tp_size` up to 2^63-1 were accepted;
the largest message within the limits (16 MiB of one-byte keys) held the single-threaded
control loop 0.2-0.4 s; the memory of a million parked lookup keys stayed with the server
after the lookups were gone.
"""
from __future__ import annotations

import secrets
import time

import msgspec
import pytest

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import RopeParams
from tests.fixtures_server import call, close_dealer, dealer, session_dealer, wait_until
from tests.kv_helpers import SMALL


@pytest.fixture(scope="module")
def server():
    with start_server(0.02) as s:
        with KVClient(s.url) as c:
            c.register("m", SMALL)
        yield s


@pytest.mark.parametrize("field,value", [("tp_size", 2**63 - 1), ("num_layers", 1 << 20),
                                         ("head_dim", 1 << 30)])
def test_layout_fields_are_bounded(server, field, value):
    lay = msgspec.structs.replace(SMALL, **{field: value})
    d = dealer(server.url)
    try:
        r = call(d, P.Register(model=f"big-{field}", layout=lay))
        assert isinstance(r, P.Error) and r.code == "bad_layout", r
        assert f"layout.{field}" in r.message and "bound" in r.message
    finally:
        close_dealer(d)


def test_rope_parameters_are_bounded(server):
    d = dealer(server.url)
    try:
        for rope, what in ((RopeParams(scaling={f"k{i}": 1.0 for i in range(65)}), "entries"),
                           (RopeParams(rope_type="y" * 300), "rope_type"),
                           (RopeParams(theta=float("inf")), "theta"),
                           (RopeParams(rotary_dim=SMALL.head_dim + 1), "rotary_dim")):
            r = call(d, P.Register(model="rope", layout=msgspec.structs.replace(SMALL,
                                                                                 rope=rope)))
            assert isinstance(r, P.Error) and r.code == "bad_layout" and what in r.message, r
    finally:
        close_dealer(d)


def _reply_ms(sock, raw: bytes) -> tuple[float, object]:
    rid = secrets.token_bytes(8)
    t0 = time.perf_counter()
    sock.send_multipart([rid, raw])
    while True:
        got, reply = sock.recv_multipart()
        if got == rid:
            return (time.perf_counter() - t0) * 1e3, P.reply_decoder.decode(reply)


def test_the_largest_messages_cost_the_loop_milliseconds(server):
    """The largest message the server takes, filled with one-byte keys, and a Register with
    the largest RoPE map that fits: refused at once (best of 5 on a shared box; each was
    0.2-1.5 s before)."""
    d = dealer(server.url, timeout_ms=20000)
    try:
        cap = call(d, P.Hello(protocol=P.PROTOCOL)).max_message_bytes
        tiny = P.encoder.encode(P.Lookup(model="m", keys=[b"x"] * ((cap - 200) // 3)))
        rope = RopeParams(scaling={f"k{i:07d}": 1.0 for i in range((cap - 2000) // 18)})
        bloated = P.encoder.encode(P.Register(model="rope",
                                              layout=msgspec.structs.replace(SMALL, rope=rope)))
        for raw, code in ((tiny, "too_many_keys"), (bloated, "bad_layout")):
            assert cap - 4096 < len(raw) <= cap
            runs = [_reply_ms(d, raw) for _ in range(5)]
            assert min(ms for ms, _ in runs) < 50, [round(ms, 1) for ms, _ in runs]
            assert all(isinstance(r, P.Error) and r.code == code for _, r in runs), runs[0]
        assert cap <= 1 << 20   # derived from --max-keys-per-request (was 16 MiB)
    finally:
        close_dealer(d)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_parked_lookup_memory_is_returned():
    """A million parked keys (128 lookups × 8192), then their clients go: the server gives
    the memory back (it kept ~65 MB of it before)."""
    with start_server(0.02, extra_args=["--max-waits-per-client", "64"]) as s, \
            KVClient(s.url) as c:
        c.register("m", SMALL)
        bodies = [P.encoder.encode(P.Lookup(model="m", wait_timeout=60, keys=[
            secrets.token_bytes(16) for _ in range(8192)])) for _ in range(128)]
        base = _rss_mb(s.pid)
        clients = [session_dealer(s.url) for _ in range(2)]
        for i, body in enumerate(bodies):
            clients[i % 2].send_multipart([i.to_bytes(8, "little"), body])
        assert wait_until(lambda: c.stats()["parked_keys"] == 128 * 8192)
        for d in clients:
            close_dealer(d)
        assert wait_until(lambda: c.stats()["waiting_lookups"] == 0)
        assert wait_until(lambda: _rss_mb(s.pid) - base < 15, timeout=12), \
            f"{_rss_mb(s.pid) - base:.1f} MiB still held"
