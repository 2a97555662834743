"""What replies to clients that never read them can cost the server, and how many connections
one peer may hold, against real server processes (kvedit/server/replies.py, peers.py).

Reproduction of an outside red-team run: ROUTER queued every reply to a socket that did not
read, up to ZMQ's high-water mark of 1,000 messages, so each such socket grew the server by
18 MiB (+539 MiB at 30 sockets; sockets cost their opener nothing). Here what is queued for a
socket and not yet delivered by the kernel is counted; a socket past --reply-queue-mb (and
the biggest ones past --reply-queue-total-mb) has its connection cut, which frees its queue.
"""
from __future__ import annotations

import secrets
import threading
import time

import pytest
import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.fixtures_server import close_dealer, dealer, wait_until
from tests.kv_helpers import SMALL

NAME = "n" * 250   # long model names: a list of 64 of them is a reply of ~22 KB


def _own_rss_mb(pid: int) -> float:
    """VmRSS without RssShmem: the server's own memory, whatever the pool holds."""
    f = {}
    with open(f"/proc/{pid}/status") as st:
        for line in st:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssShmem"):
                f[name] = int(rest.split()[0]) / 1024
    return f["VmRSS"] - f.get("RssShmem", 0.0)


def _deaf(url: str) -> zmq.Socket:
    """A DEALER that never reads: one message of room, a 4 KiB kernel buffer."""
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16) + bytes(4))
    secret = auth.load_secret(url=url)
    if secret is not None:
        auth.curve_client(s, secret)
    s.connect(url)
    return s


@pytest.mark.slow   # a flood: 30 sockets x 1,500 requests
def test_thirty_sockets_that_never_read_cost_the_server_little():
    with start_server(0.02, extra_args=["--max-models", "64"]) as s, KVClient(s.url) as c:
        for i in range(64):
            c.register(f"{NAME}{i:02d}"[-250:], SMALL)
        body = P.encoder.encode(P.ListModels())
        assert len(c._call(P.ListModels()).models) == 64
        base = _own_rss_mb(s.pid)
        peak = [base]
        stop = threading.Event()

        def sample():
            while not stop.wait(0.05):
                peak.append(_own_rss_mb(s.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deaf = [_deaf(s.url) for _ in range(30)]
        try:
            for _ in range(1500):
                for d in deaf:
                    try:
                        d.send_multipart([b"r", body], zmq.NOBLOCK)
                    except zmq.Again:
                        pass
            end = time.monotonic() + 30   # the server reads the flood (and cuts them)
            while time.monotonic() < end and c.stats().get("reply_cuts", 0) < 30:
                time.sleep(0.5)
            time.sleep(1.0)
            for _ in range(50):   # a client that reads is served beside them
                assert len(c.list_models()) == 64
            st = c.stats()
        finally:
            stop.set()
            sampler.join(5)
            for d in deaf:
                close_dealer(d)
        grown = max(peak) - base
        assert grown <= 64, f"server grew {grown:.0f} MiB"   # was ~+700 MiB here
        assert st.get("reply_cuts", 0) >= 30, st.get("reply_cuts")
        assert st["reply_queued_bytes"] <= 32 << 20


def test_a_peer_holds_a_bounded_number_of_zmq_connections():
    with start_server(0.02, extra_args=["--max-zmq-conns-per-peer", "6"]) as s:
        socks = [dealer(s.url, timeout_ms=1500) for _ in range(10)]
        try:
            answered = 0
            for d in socks:
                d.send_multipart([b"h", P.encoder.encode(P.Hello(protocol=P.PROTOCOL))])
            for d in socks:
                try:
                    d.recv_multipart()
                    answered += 1
                except zmq.Again:
                    pass
            assert answered <= 6 + 1, answered   # (one may slip in as another one leaves)
            for d in socks[:6]:   # when some go, the others get in
                close_dealer(d)
            socks = socks[6:]
            for d in socks:
                assert _answers(d), "a socket of the peer stayed shut after others left"
            with KVClient(s.url) as c:
                assert c.stats()["zmq_conns_refused"] >= 3
        finally:
            for d in socks:
                close_dealer(d)


def _answers(d: zmq.Socket, tries: int = 10) -> bool:
    for _ in range(tries):
        d.send_multipart([b"h", P.encoder.encode(P.Hello(protocol=P.PROTOCOL))])
        try:
            d.recv_multipart()
            return True
        except zmq.Again:
            pass
    return False


def test_the_reply_bounds_are_checked_at_start():
    with pytest.raises(RuntimeError, match="reply-queue-mb"):
        start_server(0.02, extra_args=["--reply-queue-mb", "64", "--reply-queue-total-mb",
                                       "32"])
